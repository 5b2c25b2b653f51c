"""MetricsWriter: JSON lines, TensorBoard events, append on resume, and a disabled writer that writes nothing."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.training.metrics import MetricsWriter


def _lines(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_jsonl_and_tensorboard(tmp_path):
    w = MetricsWriter(str(tmp_path))
    w.write(1, {"loss": jnp.float32(2.5), "tokens": np.int64(4096), "mfu": None, "lr": 1e-3})
    w.write(2, {"loss": np.array(2.0, np.float32), "tokens": 8192, "mfu": 0.4, "lr": 2e-3})
    w.close()
    lines = _lines(tmp_path)
    assert lines == [
        {"step": 1, "loss": 2.5, "tokens": 4096, "mfu": None, "lr": 1e-3},
        {"step": 2, "loss": 2.0, "tokens": 8192, "mfu": 0.4, "lr": 2e-3},
    ]
    assert type(lines[0]["tokens"]) is int and type(lines[0]["loss"]) is float
    events = [f for f in os.listdir(tmp_path / "tensorboard") if f.startswith("events.out.tfevents")]
    assert len(events) == 1 and os.path.getsize(tmp_path / "tensorboard" / events[0]) > 0


def test_reopen_appends(tmp_path):
    for step in (1, 2):
        w = MetricsWriter(str(tmp_path))
        w.write(step, {"loss": float(step)})
        w.close()
    assert [r["step"] for r in _lines(tmp_path)] == [1, 2]


def test_disabled_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    w = MetricsWriter(str(run_dir), enabled=False)
    w.write(1, {"loss": 1.0})
    w.close()
    assert not run_dir.exists()


def test_non_scalar_rejected(tmp_path):
    w = MetricsWriter(str(tmp_path))
    with pytest.raises(TypeError, match="shape"):
        w.write(1, {"loss": np.zeros(3)})
    w.close()


def test_first_step_purges_the_rows_a_resumed_run_writes_again(tmp_path):
    """A writer opened with first_step drops metrics.jsonl's rows at that step and later, and a torn last line,
    and opens TensorBoard with a purge step: each step once, the latest attempt's values."""
    from tb_events import scalars

    w = MetricsWriter(str(tmp_path), first_step=0)
    for step in range(5):
        w.write(step, {"loss": float(step)})
    w.flush()
    w.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # a process killed mid-write
    w = MetricsWriter(str(tmp_path), first_step=3)  # resumed from a checkpoint at step 2
    for step in (3, 4, 5):
        w.write(step, {"loss": 10.0 + step})
    w.close()
    assert [(r["step"], r["loss"]) for r in _lines(tmp_path)] == [(0, 0), (1, 1), (2, 2), (3, 13), (4, 14), (5, 15)]
    shown, raw = scalars(str(tmp_path / "tensorboard"))
    assert shown == {"loss": {0: 0, 1: 1, 2: 2, 3: 13, 4: 14, 5: 15}}
    assert raw[0]["loss"] == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4}  # without the purge step they would be shown twice


def test_purge_at_a_rollback_and_a_fresh_start(tmp_path):
    w = MetricsWriter(str(tmp_path))
    for step in (1, 2, 3):
        w.write(step, {"loss": float(step)})
    w.purge(2)  # a divergence rollback to step 1: steps 2 and 3 run again
    w.write(2, {"loss": 20.0})
    w.close()
    assert [(r["step"], r["loss"]) for r in _lines(tmp_path)] == [(1, 1), (2, 20)]
    MetricsWriter(str(tmp_path), first_step=0).close()  # a fresh start in a directory without checkpoints
    assert _lines(tmp_path) == []
