"""Injected faults: non-finite gradients are skipped and counted, then stop the run; SIGTERM saves and exits 0."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from step_helpers import child_env

from jaxpar.config import load_config
from jaxpar.training.hooks import Hook, default_hooks
from jaxpar.training.loop import TrainingDiverged, train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = [
    "model.n_layers=2",
    "data.seq_len=32",
    "data.max_bytes=300000",
    "data.validation_fraction=0.3",
    "train.global_batch_size=8",
    "train.eval_batches=1",
    "train.progress_bar=false",
    "train.sample_tokens=0",
    "train.log_every=1",
    "train.eval_every=0",
]


@pytest.mark.slow  # training runs until the skip limit stops them (about 10 s on 2 cores)
def test_non_finite_gradients_are_skipped_then_stop_the_run(tmp_path):
    # Weights of size 1e30 overflow the forward: every gradient is NaN or inf from the first step.
    cfg = load_config(
        os.path.join(ROOT, "configs", "tiny.yaml"),
        [
            *SMALL,
            f"train.run_dir={tmp_path}",
            "model.init_std=1e30",
            "train.steps=20",
            "train.max_bad_steps=3",
            "checkpoint.every_steps=0",
        ],
    )
    with pytest.raises(TrainingDiverged, match=r"3 consecutive updates up to step 3 .*train.max_bad_steps=3"):
        train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows] == [1, 2, 3, 4][: len(rows)] and len(rows) >= 3
    assert not np.isfinite(rows[0]["grad_norm"])
    assert all(r["learning_rate"] == 0.0 for r in rows)  # no update was applied: the rate applied is 0


@pytest.mark.slow
def test_divergence_rolls_back_to_the_last_good_checkpoint(tmp_path, monkeypatch):
    """Parameters poisoned with NaN at step 6: steps 6 and 7 are skipped, no checkpoint is taken of the bad
    state, the run rolls back to step 4 once and finishes with finite losses on later batches."""
    monkeypatch.setenv("JAXPAR_INJECT_FAULT", "nan@6")
    overrides = [
        *SMALL,
        f"train.run_dir={tmp_path}",
        "train.steps=10",
        "train.max_bad_steps=2",
        "checkpoint.every_steps=2",
        "checkpoint.keep=10",
        "checkpoint.async_save=false",
    ]
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [*overrides, "train.divergence_rollbacks=1"])
    first_losses = {}

    class FirstLosses(Hook):  # the losses of steps 1-7 before the rollback undoes them
        def on_step(self, run, step, state, metrics):
            first_losses.setdefault(step, run.host_metrics(step, metrics)["loss"])

    result = train(cfg, hooks=[*default_hooks(cfg), FirstLosses()])
    assert not np.isfinite(first_losses[6]) and not np.isfinite(first_losses[7]) and np.isfinite(first_losses[5])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, 11))  # steps 5-7 ran again after the rollback to 4: their rows are the new ones
    assert [r["rollbacks"] for r in rows] == [0] * 4 + [1] * 6
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert result.losses[5] != first_losses[5]  # step 5 again, but on the batch after the skipped ones
    assert sorted(int(d) for d in os.listdir(tmp_path / "checkpoints")) == [2, 4, 6, 8, 10]
    assert result.val_loss is not None and np.isfinite(result.val_loss)

    monkeypatch.setenv("JAXPAR_INJECT_FAULT", "nan@3")  # no rollback allowed: stop, naming the last good step
    with pytest.raises(TrainingDiverged, match=r"up to step 4 .*last good checkpoint is step 2"):
        train(
            load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [*overrides, f"train.run_dir={tmp_path / 'stop'}"])
        )


@pytest.mark.slow  # one compile of a one-layer model (about 5 s on 2 cores)
def test_a_run_ending_diverged_exits_1_naming_the_step_and_the_fix(tmp_path, capsys):
    """A learning rate of 1e30: update 1 applies (finite gradients), then every gradient is NaN and the updates
    are skipped; the run ends before train.max_bad_steps (10) is reached. jaxpar-train exits 1 with one line naming
    the step it went wrong and the fixes, and no checkpoint of a skipped step is saved."""
    from jaxpar.cli import train as train_cli

    argv = [
        os.path.join(ROOT, "configs", "tiny.yaml"),
        "--cpu-devices",
        "8",
        *SMALL,
        "mesh.data=8",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "model.n_layers=1",
        "model.d_model=32",
        "model.n_heads=2",
        "model.n_kv_heads=2",
        "model.d_ff=64",
        "data.seq_len=16",
        "train.steps=3",
        "optimizer.warmup_steps=0",
        "optimizer.learning_rate=1e30",
        "checkpoint.every_steps=1",
        "checkpoint.async_save=false",
        f"train.run_dir={tmp_path}",
    ]
    assert train_cli.main(argv) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxpar-train")]
    assert len(err) == 1, err
    assert err[0].startswith(
        "jaxpar-train: stopped: the run reached its last step, 3, diverged: its gradients have been NaN or inf "
        "(updates skipped) since step 2 (train.max_bad_steps=10 skipped updates in a row not reached)"
    ), err[0]
    assert f"the last good checkpoint is step 1 in {tmp_path}" in err[0] and "Lower optimizer.learning_rate" in err[0]
    assert os.listdir(tmp_path / "checkpoints") == ["1"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_saves_the_current_step_and_exits_zero(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "jaxpar.cli.train",
        os.path.join(ROOT, "configs", "tiny.yaml"),
        "--cpu-devices",
        "8",
        f"train.run_dir={tmp_path}",
        *SMALL,
        "train.steps=100000",
        "checkpoint.every_steps=1000",
    ]
    env = child_env(compile_cache=True)  # no pipeline stages
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 200
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 3) and time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-2000:]
        time.sleep(0.05)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-2000:]
    assert time.monotonic() - sent < 60
    saved = int(out.split("preempted: saved step ")[1].split()[0])
    assert saved >= 3 and os.listdir(tmp_path / "checkpoints") == [str(saved)]

    resumed = subprocess.run(
        [*cmd[:-2], f"train.steps={saved + 1}", "checkpoint.every_steps=1000"],
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed at step {saved}" in resumed.stdout
