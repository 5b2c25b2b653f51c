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
