"""The training loop's parts are hooks a script adds, removes or replaces (`jaxpar.training.hooks`): a hook of its
own runs every N steps with the step, state and metrics; without `EvalHook` nothing is evaluated; a replaced
`CheckpointHook` decides what is saved; a hook that raises leaves no watchdog, SIGTERM handler or open
checkpointer behind; entries that are not hooks are refused before any device work."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading

import pytest

from jaxpar.config import load_config
from jaxpar.training.hooks import CheckpointHook, EvalHook, Hook, MetricsHook, default_hooks
from jaxpar.training.loop import train

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "configs", "tiny.yaml")
SMALL = [
    "model.n_layers=1",
    "model.d_model=64",
    "model.d_ff=128",
    "data.seq_len=32",
    "data.max_bytes=200000",
    "data.validation_fraction=0.3",
    "train.global_batch_size=8",
    "train.eval_batches=1",
    "train.progress_bar=false",
    "train.sample_tokens=0",
    "checkpoint.async_save=false",
    "checkpoint.keep=10",
]


def _cfg(run_dir, *overrides):
    return load_config(CONFIG, [*SMALL, f"train.run_dir={run_dir}", *overrides])


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(run_dir) -> list[int]:
    return sorted(int(d) for d in os.listdir(run_dir / "checkpoints"))


class Recorder(Hook):
    """Records what the loop shows it: each due step with the state's step, the metrics' keys and the loss."""

    every = 2

    def __init__(self):
        self.seen, self.events = [], []

    def on_start(self, run):
        self.events.append(("start", run.start_step))

    def on_step(self, run, step, state, metrics):
        self.seen.append((step, int(state["step"]), sorted(metrics), run.host_metrics(step, metrics)["loss"]))

    def on_end(self, run, result):
        self.events.append(("end", result.val_loss is not None))


def test_a_hook_added_to_the_defaults_runs_every_n_steps_with_step_state_and_metrics(tmp_path, caplog):
    cfg = _cfg(tmp_path, "train.steps=5", "train.log_every=3", "train.eval_every=0", "checkpoint.every_steps=0")
    assert [type(h).__name__ for h in default_hooks(cfg)] == [
        "DivergenceHook",
        "EvalHook",
        "MetricsHook",
        "ProgressLogHook",  # train.progress_bar=false: a log line instead of the bar
        "PreemptionHook",
        "CheckpointHook",
        "WatchdogHook",
    ]
    recorder = Recorder()
    with caplog.at_level(logging.INFO, logger="jaxpar"):
        result = train(cfg, hooks=[*default_hooks(cfg), recorder])
    assert re.findall(r"step (\d)/5: loss \d\.\d{4}, grad_norm", caplog.text) == ["3"]  # every train.log_every
    assert result.initial_val_loss is None  # train.eval_every=0: no evaluation at step 0

    assert [(step, state_step) for step, state_step, _, _ in recorder.seen] == [(2, 2), (4, 4)]
    assert all({"loss", "grad_norm", "tokens"} <= set(keys) for _, _, keys, _ in recorder.seen)
    assert recorder.events == [("start", 0), ("end", True)]
    assert [(s, result.losses[s]) for s, _, _, _ in recorder.seen] == [(s, loss) for s, _, _, loss in recorder.seen]
    # The defaults still write their rows on their own steps (every 3, and the last, which evaluates).
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [3, 5]
    assert rows[0]["val_loss"] is None and rows[1]["val_loss"] == result.val_loss


@pytest.mark.slow  # a training run (default-suite budget)
def test_without_eval_hook_nothing_is_evaluated(tmp_path):
    cfg = _cfg(tmp_path, "train.steps=3", "train.log_every=1", "train.eval_every=1", "checkpoint.every_steps=0")
    result = train(cfg, hooks=[h for h in default_hooks(cfg) if not isinstance(h, EvalHook)])
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["val_loss"] is None and r["val_tokens"] is None for r in rows)
    assert result.val_loss is None and result.initial_val_loss is None
    assert sorted(result.losses) == [1, 2, 3]


class SaveOddSteps(Hook):
    """A checkpoint hook of a script's own: saves after odd steps only."""

    def on_step(self, run, step, state, metrics):
        if step % 2:
            run.checkpointer.save(
                step, state, data_state=run.train_loader.get_state(), config=run.cfg.to_dict(), force=True
            )


class StopAt(Hook):
    def __init__(self, step):
        self.step = step

    def on_step(self, run, step, state, metrics):
        if step == self.step:
            run.stop()


@pytest.mark.slow  # a training run with checkpoints (about 8 s on 2 cores)
def test_a_replaced_checkpoint_hook_decides_what_is_saved(tmp_path):
    # The default CheckpointHook would save steps 2 (checkpoint.every_steps) and 3 (where the run stops).
    cfg = _cfg(tmp_path, "train.steps=6", "train.log_every=1", "train.eval_every=0", "checkpoint.every_steps=2")
    hooks = [SaveOddSteps() if isinstance(h, CheckpointHook) else h for h in default_hooks(cfg)]
    result = train(cfg, hooks=[*hooks, StopAt(3)])
    assert _checkpoints(tmp_path) == [1, 3]
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3]  # stopped after step 3's hooks
    assert result.preempted_at is None and int(result.state["step"]) == 3
    assert result.val_loss is not None  # a stop that is not a preemption still ends with the final evaluation


class Boom(Hook):
    def on_step(self, run, step, state, metrics):
        if step == 2:
            raise RuntimeError("boom")


@pytest.mark.slow  # a training run plus a subprocess check (about 12 s on 2 cores)
def test_a_hook_that_raises_leaves_nothing_open(tmp_path):
    sigterm = signal.getsignal(signal.SIGTERM)
    overrides = ["train.log_every=1", "train.eval_every=0", "checkpoint.every_steps=1", "train.watchdog_s=600"]
    cfg = _cfg(tmp_path, "train.steps=3", *overrides)
    with pytest.raises(RuntimeError, match="boom"):
        train(cfg, hooks=[*default_hooks(cfg), Boom()])  # after step 2's checkpoint and metrics row
    assert not [t for t in threading.enumerate() if t.name == "jaxpar-watchdog"]
    assert signal.getsignal(signal.SIGTERM) == sigterm  # PreemptionWatch's handler removed
    assert _checkpoints(tmp_path) == [1, 2] and [r["step"] for r in _rows(tmp_path)] == [1, 2]

    resumed = train(_cfg(tmp_path, "train.steps=3", *overrides))  # the same process, the same run directory
    assert resumed.start_step == 2 and sorted(resumed.losses) == [3]
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3] and _checkpoints(tmp_path) == [1, 2, 3]


class EveryMinusOne(Hook):
    every = -1


@pytest.mark.parametrize(
    "entry, error, match",
    [
        (
            EvalHook,
            TypeError,
            r"hooks\[1\] is the class EvalHook, not a jaxpar.training.hooks.Hook instance.*MyHook\(\)",
        ),
        (print, TypeError, r"hooks\[1\] is <built-in function print>, not a jaxpar.training.hooks.Hook instance"),
        (EveryMinusOne(), ValueError, r"hooks\[1\] \(EveryMinusOne\) has every=-1; give a whole number of steps"),
    ],
)
def test_entries_that_are_not_hooks_are_refused_before_any_work(tmp_path, entry, error, match):
    run_dir = tmp_path / "never"
    with pytest.raises(error, match=match):
        train(_cfg(run_dir, "train.steps=1"), hooks=[MetricsHook(1), entry])
    assert not run_dir.exists()


@pytest.mark.slow  # two training runs (about 15 s on 2 cores)
def test_a_stop_asked_by_a_hook_after_the_checkpoint_hook_still_saves_the_step(tmp_path):
    """StopAt comes after the default CheckpointHook in the list, so that hook had passed step 1 when the stop
    came; its on_stop saves the step anyway (the run resumes there)."""
    cfg = _cfg(tmp_path, "train.steps=4", "train.log_every=1", "train.eval_every=0", "checkpoint.every_steps=2")
    result = train(cfg, hooks=[*default_hooks(cfg), StopAt(1)])
    assert int(result.state["step"]) == 1 and _checkpoints(tmp_path) == [1]
    resumed = train(_cfg(tmp_path, "train.steps=2", "train.log_every=1", "train.eval_every=0"))
    assert resumed.start_step == 1 and sorted(resumed.losses) == [2]


class ReturnsMetrics(Hook):
    def on_step(self, run, step, state, metrics):
        return metrics


@pytest.mark.slow  # a training run with a checkpoint (about 10 s on 2 cores)
def test_a_hook_returning_no_state_is_named(tmp_path):
    cfg = _cfg(tmp_path, "train.steps=2", "train.eval_every=0")
    with pytest.raises(TypeError, match=r"ReturnsMetrics.on_step returned dict; return None, or a train state"):
        train(cfg, hooks=[*default_hooks(cfg), ReturnsMetrics()])


def test_a_single_hook_instead_of_a_list_is_refused(tmp_path):
    with pytest.raises(TypeError, match=r"hooks must be a list of Hook instances.*got MetricsHook"):
        train(_cfg(tmp_path / "never", "train.steps=1"), hooks=MetricsHook(1))
    assert not (tmp_path / "never").exists()
