"""End to end through the CLI in subprocesses: a run of the default config, and a run killed (SIGKILL) after a
checkpoint and restarted, which must reproduce the uninterrupted run's losses bitwise (CPU, fp32)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from step_helpers import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = [
    "model.n_layers=2",
    "data.seq_len=32",
    "data.max_bytes=1000000",
    "data.validation_fraction=0.2",
    "train.global_batch_size=8",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.eval_every=0",
    "train.progress_bar=false",
    "precision.compute_dtype=float32",
    "optimizer.warmup_steps=5",
]
REQUIRED_METRICS = {
    "step",
    "loss",
    "val_loss",
    "val_tokens",
    "learning_rate",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
    "mfu",
    "memory_peak_bytes",
    "memory_step_bytes",
}


def _cmd(run_dir, *overrides):
    return [
        sys.executable,
        "-m",
        "jaxpar.cli.train",
        os.path.join(ROOT, "configs", "tiny.yaml"),
        "--cpu-devices",
        "8",
        f"train.run_dir={run_dir}",
        *SMALL,
        *overrides,
    ]


def _env():
    return child_env(compile_cache=True)  # the CLI flag must set the device count; no pipeline stages


def _losses(run_dir):
    """step -> loss from metrics.jsonl; a step logged twice (before a kill and after resume) keeps the last."""
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            out[row["step"]] = row["loss"]
    return out


@pytest.mark.slow  # two 40-step runs of the default config in subprocesses, one killed (about 35 s on 2 cores)
@pytest.mark.timeout(400)
def test_default_config_runs_and_resume_after_kill_reproduces_losses(tmp_path):
    steps = 40
    full = tmp_path / "full"
    done = subprocess.run(
        _cmd(full, f"train.steps={steps}", "checkpoint.every_steps=20"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mesh data=2 pipeline=1 fsdp=2 context=1 tensor=2 (8 devices)" in done.stdout
    assert "final val_loss" in done.stdout and "sample:" in done.stdout
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps and REQUIRED_METRICS <= set(rows[0])
    assert rows[-1]["val_loss"] is not None and rows[-1]["loss"] < rows[0]["loss"]
    # eval_batches=1: 8 full sequences of 32 tokens, less each target that would cross a document boundary
    # (document masking); the loader's own count is logged at the start
    scored = int(re.search(r"each evaluation scores ([\d,]+) validation tokens", done.stdout)[1].replace(",", ""))
    assert rows[-1]["val_tokens"] == scored and 8 * 16 < scored <= 8 * 32 and rows[0]["val_tokens"] is None
    assert (full / "config.yaml").exists() and os.listdir(full / "tensorboard")
    assert sorted(os.listdir(full / "checkpoints")) == ["20", "40"]

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        _cmd(killed, f"train.steps={steps}", "checkpoint.every_steps=5"),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    marker = killed / "checkpoints" / "10" / "commit_success.txt"
    deadline = time.time() + 240
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert marker.exists(), "the run never committed checkpoint 10"
    assert proc.returncode == -signal.SIGKILL
    assert len(_losses(killed)) < steps, "the run finished before it was killed; the test proved nothing"

    resumed = subprocess.run(
        _cmd(killed, f"train.steps={steps}", "checkpoint.every_steps=5"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    line = next(x for x in resumed.stdout.splitlines() if x.startswith("resumed at step"))
    start = int(line.split()[3])
    assert 10 <= start < steps
    want, got = _losses(full), _losses(killed)
    assert all(got[s] == want[s] for s in range(start + 1, steps + 1)), "resumed losses differ"
