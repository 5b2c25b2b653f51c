"""An FP8 training run end to end (`precision.fp8.enabled`): the command trains, evaluates and reports
`mfu_fp8_peak` beside `mfu`, on data 2 x fsdp 2 x tensor 2 (sequence parallel) simulated CPU devices. A CPU has no
peaks in the tables: the run gives both (1 and 2 TFLOP/s), so the FP8 MFU is half the bf16 one."""

import json
import os
import subprocess
import sys

import pytest
from step_helpers import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # a training run in a subprocess (about 30 s on 2 cores)
def test_an_fp8_run_trains_and_reports_mfu_against_both_peaks(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "jaxpar.cli.train",
        os.path.join(ROOT, "configs", "tiny.yaml"),
        "--cpu-devices",
        "8",
        f"train.run_dir={tmp_path}",
        "precision.fp8.enabled=true",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "data.seq_len=32",
        "data.max_bytes=300000",
        "train.global_batch_size=8",
        "train.eval_batches=1",
        "train.progress_bar=false",
        "train.sample_tokens=0",
        "train.steps=6",
        "train.log_every=1",
        "train.eval_every=6",
        "checkpoint.every_steps=0",
        "train.peak_flops_per_device=1e12",
        "train.peak_fp8_flops_per_device=2e12",
    ]
    done = subprocess.run(cmd, env=child_env(compile_cache=True), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert all(r["mfu_fp8_peak"] == pytest.approx(r["mfu"] / 2, rel=1e-12) and r["mfu"] > 0 for r in steps)
    assert all(r["skipped_steps"] == 0 for r in steps)
    assert steps[-1]["loss"] < steps[0]["loss"] and rows[-1]["val_loss"] is not None


@pytest.mark.slow  # two training runs in subprocesses (about 60 s on 2 cores)
def test_a_delayed_scaling_run_checkpoints_its_history_and_resumes_on_another_mesh(tmp_path):
    """`precision.fp8.scaling=delayed`: the amax history is in the checkpoint; the run resumes from it on another
    mesh (pipeline 2 x data 2 x tensor 2 after data 2 x fsdp 2 x tensor 2) and trains on; a restore reads the
    history back onto any mesh, and a restore with current scaling leaves it out."""
    import jax
    import numpy as np

    from jaxpar import restore

    common = [
        f"train.run_dir={tmp_path}",
        "precision.fp8.enabled=true",
        "precision.fp8.scaling=delayed",
        "precision.fp8.amax_history=4",
        "mesh.tensor=2",
        "mesh.data=2",
        "data.seq_len=32",
        "data.max_bytes=300000",
        "train.global_batch_size=8",
        "train.eval_batches=1",
        "train.progress_bar=false",
        "train.sample_tokens=0",
        "train.log_every=1",
        "train.eval_every=0",
        "checkpoint.every_steps=3",
    ]

    def train(*extra):
        cmd = [
            sys.executable,
            "-m",
            "jaxpar.cli.train",
            os.path.join(ROOT, "configs", "tiny.yaml"),
            "--cpu-devices",
            "8",
        ]
        done = subprocess.run([*cmd, *common, *extra], env=child_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]

    train("mesh.fsdp=2", "train.steps=3")
    train("mesh.pipeline=2", "mesh.fsdp=1", "pipeline.microbatches=2", "train.steps=6")
    with open(tmp_path / "metrics.jsonl") as f:
        steps = [json.loads(line) for line in f if json.loads(line)["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert all(r["skipped_steps"] == 0 for r in steps)
    one = ["mesh.data=1", "mesh.tensor=1", "mesh.pipeline=1", "mesh.fsdp=1", "pipeline.microbatches=1"]
    history = np.asarray(restore(str(tmp_path), one, devices=jax.devices()[:1]).state["fp8"]["amax_history"])
    assert history.shape[-1] == 4 and np.all(history > 0)  # six steps seen: the window of 4 is full
    spread = restore(str(tmp_path), ["mesh.pipeline=2", "mesh.fsdp=1", "mesh.data=4", "mesh.tensor=1"])
    np.testing.assert_array_equal(np.asarray(spread.state["fp8"]["amax_history"]), history)
    current = restore(str(tmp_path), [*one, "precision.fp8.scaling=current"], devices=jax.devices()[:1])
    assert "fp8" not in current.state and current.step == 6
