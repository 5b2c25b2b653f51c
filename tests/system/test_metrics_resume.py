"""Metrics exactly once across a crash: a run killed with SIGKILL between checkpoints and resumed writes the same
metrics.jsonl rows and TensorBoard scalars as a run that was never interrupted, each step once (timing aside)."""

import json
import os
import subprocess
import sys

import pytest
from step_helpers import child_env
from tb_events import scalars

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Measured per machine and process, not by the step: left out of the comparison.
TIMING = {"tokens_per_s", "step_time_s", "mfu", "hfu", "memory_peak_bytes"}


def _train(run_dir, **env):
    cmd = [
        sys.executable,
        "-m",
        "jaxpar.cli.train",
        os.path.join(ROOT, "configs", "tiny.yaml"),
        "--cpu-devices",
        "8",
        f"train.run_dir={run_dir}",
        "model.n_layers=2",
        "data.seq_len=32",
        "data.max_bytes=300000",
        "data.validation_fraction=0.3",
        "train.global_batch_size=8",
        "train.eval_batches=1",
        "train.progress_bar=false",
        "train.sample_tokens=0",
        "train.steps=8",
        "train.log_every=1",
        "train.eval_every=4",
        "checkpoint.every_steps=3",
        "checkpoint.async_save=false",
    ]
    return subprocess.run(cmd, env=child_env(compile_cache=True, **env), capture_output=True, text=True, timeout=300)


def _rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]


@pytest.mark.slow  # three short training runs in subprocesses (about 40 s on 2 cores)
def test_a_run_killed_between_checkpoints_resumes_with_each_step_logged_once(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    done = _train(whole)
    assert done.returncode == 0, done.stderr[-3000:]
    # SIGKILL before step 6: the rows of steps 4 and 5 are past step 3's checkpoint.
    crash = _train(killed, JAXPAR_INJECT_FAULT="kill@6")
    assert crash.returncode == -9, crash.stderr[-3000:]
    before = [r["step"] for r in _rows(killed)]
    assert before == [0, 1, 2, 3, 4, 5], before
    _, first_attempt = scalars(str(killed / "tensorboard"))
    assert set(range(1, 4)) <= set(first_attempt[0]["loss"]), first_attempt  # flushed at the checkpoint of step 3

    resumed = _train(killed)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step 3" in resumed.stdout + resumed.stderr
    want = _rows(whole)
    assert [r["step"] for r in want] == list(range(9))
    assert _rows(killed) == want  # each step once, bitwise the uninterrupted run's values
    shown, _ = scalars(str(killed / "tensorboard"))
    whole_shown, _ = scalars(str(whole / "tensorboard"))
    assert {k: v for k, v in shown.items() if k not in TIMING} == {
        k: v for k, v in whole_shown.items() if k not in TIMING
    }
    assert sorted(shown["loss"]) == list(range(1, 9)) and sorted(shown["val_loss"]) == [0, 4, 8]
