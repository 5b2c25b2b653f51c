"""benchmarks/gpu_acceptance.py in its CPU smoke mode: the code a maintainer runs on one GPU, end to end on tiny
shapes (slow: a subprocess that compiles a few steps), and the verdict and table helpers (cheap)."""

import json
import os
import subprocess
import sys

import pytest

from jaxpar.analysis.gpu.acceptance import ATTENTION_TOLERANCE, format_report, verdict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_cpu_smoke_runs_every_part_and_the_loss_falls(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_acceptance.py"), "--cpu-smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"]["platform"] == "cpu"
    # XLA's bf16 path against the fp32 reference, with and without documents and a window; no cuDNN on CPU
    for docs in ("no_segments", "segments", "window_no_segments", "window_segments"):
        errors = report["attention"][docs]["xla"]
        assert set(errors) == {"out", "dq", "dk", "dv"} and all(0 < e < ATTENTION_TOLERANCE for e in errors.values())
        assert "cudnn" not in report["attention"][docs]
    assert report["candidates"] == ["none", "names"]
    for r in report["remat"]:
        assert r["tokens_per_s"] > 0 and r["compiled_peak_bytes"] > 0 and r["planned_peak_bytes"] > 0
        assert r["mfu"] is None  # no peak FLOP/s known for a CPU
    assert report["best_remat"] in ("none", "names")
    losses = report["learning"]["losses"]
    assert len(losses) == 30 and report["learning"]["falls"]
    assert report["passed"] == {
        "attention": None,
        "context_parallel": None,
        "learning": True,
        "mfu_at_least_50": None,
        "fp8_learning": True,
    }
    # section 7: the kept step with FP8 GEMMs, and the same learning run in FP8 beside bf16's
    fp8 = report["fp8"]
    assert fp8["remat"] == report["best_remat"] and fp8["tokens_per_s"] > 0 and fp8["mfu_fp8_peak"] is None
    assert len(fp8["learning"]["losses"]) == 30 and fp8["learning"]["max_gap"] > 0
    assert "## FP8 GEMMs" in proc.stdout
    # context parallelism's chunk decomposition (two kernel calls per query chunk) on the XLA kernel, fp32
    parity = report["context_parallel"]["parity"]
    assert len(parity) == 6 and all(row["decomposition"] < 1e-5 for row in parity.values()), parity
    assert "not run: no NVIDIA GPU" in proc.stdout and "passed:" in proc.stdout
    # ZB-V against interleaved 1F1B on the simulated devices (skipped on one)
    pipe = report["pipeline_schedules"]
    assert "skipped" in pipe or (pipe["zb-v"]["step_seconds"] > 0 and pipe["zb_v_over_interleaved"] > 0), pipe
    assert "skipped" in pipe or (pipe["vocab_parallel"]["step_seconds"] > 0 and pipe["vocab_over_last"] > 0), pipe
    # section 8: dropless MoE over the emulated transport; XLA:CPU has no ragged all-to-all
    moe = report["dropless_moe"]
    assert "skipped" in moe or (moe["emulated"]["tokens_per_s"] > 0 and "no ragged" in moe["ragged"]["skipped"]), moe
    assert "dropless MoE" in proc.stdout


def _report(cudnn_error: float, last10: float, mfu: float) -> dict:
    errors = {"out": 1e-3, "dq": cudnn_error, "dk": 1e-3, "dv": 1e-3}
    return {
        "jax_version": "x",
        "total_seconds": 1.0,
        "device": {"device_kind": "NVIDIA H200", "platform": "gpu", "memory_bytes": 141e9, "peak_flops": 989e12},
        "attention": {"segments": {"xla": errors, "cudnn": errors}},
        "context_parallel": {"parity": {"chunk7_documents": {"decomposition": 1e-4, "cudnn": errors}}},
        "remat": [
            {
                "remat": "dots",
                "compile_seconds": 1.0,
                "step_seconds": 0.5,
                "tokens_per_s": 6e4,
                "mfu": mfu,
                "hfu": mfu,
                "compiled_peak_bytes": 5e10,
                "planned_peak_bytes": 4.9e10,
                "planned_ratio": 5 / 4.9,
            }
        ],
        "best_remat": "dots",
        "learning": {
            "losses": [10.0] * 10 + [last10] * 10,
            "first10": 10.0,
            "last10": last10,
            "falls": last10 < 9.5,
            "seconds": 1.0,
        },
    }


def test_verdict_holds_cudnn_to_bf16_tolerance_and_the_loss_to_falling():
    good = _report(1e-2, 4.0, 0.55)
    assert verdict(good) == {"attention": True, "context_parallel": True, "learning": True, "mfu_at_least_50": True}
    bad = _report(5e-2, 9.9, 0.40)
    assert verdict(bad) == {"attention": False, "context_parallel": False, "learning": False, "mfu_at_least_50": False}
    good["passed"] = verdict(good)
    table = format_report(good)
    assert "| segments | cudnn | 1.00e-03 | 1.00e-02 |" in table and "55.0%" in table and "1.02" in table
    assert "| chunk7_documents | 1.00e-04 | 1.00e-03 | 1.00e-02 |" in table
