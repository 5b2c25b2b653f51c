"""benchmarks/all.py: one table of ratios; the quick mode end to end in a subprocess (slow), and the row
and table helpers of `jaxpar.analysis.bench.report` (cheap)."""

import json
import math
import os
import subprocess
import sys

import pytest

from jaxpar.analysis.bench.report import format_report, memory_rows, row

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_row_and_table():
    rows = [
        row("memory", "DDP fp32 data=8", "total (16P)", 1600, 1600, "bytes", "1.000"),
        row("overhead", "1 device", "step time jaxpar/reference", 0.0125, 0.0100, "s", "<= 1.03"),
        row("tensor", "sp=on", "all-to-all HLO/Megatron", 5.0, 0.0, "bytes", "1.00"),
    ]
    assert rows[0]["ratio"] == 1.0 and rows[1]["ratio"] == pytest.approx(1.25)
    assert math.isnan(rows[2]["ratio"])  # no formula term: never a division by zero
    lines = format_report(rows).splitlines()
    assert lines[0].split() == ["group", "case", "metric", "measured", "reference", "ratio", "target"]
    assert "1,600" in lines[2] and "1.0000" in lines[2]
    assert "12.50 ms" in lines[3] and "10.00 ms" in lines[3] and "1.2500" in lines[3]
    json.dumps(rows)  # --json output


def test_memory_rows_keep_state_kinds_only():
    table = [
        {
            "kind": k,
            "measured_bytes": 8,
            "formula_bytes": None if k in ("scalars", "temp") else 8,
            "formula": "-",
            "expression": "ZeRO-1 fp32: 8P + 8P/N",
            "data": 8,
        }
        for k in ("params", "grads", "opt_state", "total", "scalars", "temp")
    ]
    rows = memory_rows({1: table})
    assert [r["metric"].split()[0] for r in rows] == ["params", "grads", "opt_state", "total"]
    assert {r["case"] for r in rows} == {"ZeRO-1 fp32 data=8"}


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_quick_mode_prints_every_ratio(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "all.py"),
            "--quick",
            "--json",
            "--config",
            os.path.join(ROOT, "configs", "tiny.yaml"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)
    for r in rows:
        assert math.isfinite(r["measured"]) and math.isfinite(r["reference"]) and math.isfinite(r["ratio"]), r
        if r["metric"].startswith("ZB") and "1-dp/FLOPs" in r["metric"]:
            # a zero-bubble step runs no masked work: data parallelism's matmul FLOPs exactly
            assert abs(r["measured"]) < 1e-9, r
            continue
        assert r["ratio"] > 0 or "1-dp/time" in r["metric"], r  # a timed bubble may come out at or below 0
    groups = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r)
    assert {r["metric"] for r in groups["overhead"]} == {
        "step time jaxpar/reference",
        "XLA FLOPs jaxpar/reference",
        "XLA bytes accessed",
    }
    memory = {(r["case"], r["metric"].split()[0]) for r in groups["memory"]}
    assert memory == {
        (f"{stage} fp32 data=8", kind)
        for stage in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
        for kind in ("params", "grads", "opt_state", "total")
    }
    for r in groups["memory"]:
        assert r["ratio"] == pytest.approx(1.0, abs=1e-3), r
    totals = {r["case"]: r for r in groups["tensor"] if r["metric"].startswith("total")}
    assert sorted(totals) == ["tensor=2 fsdp=4 sp=off", "tensor=2 fsdp=4 sp=on"]
    for r in totals.values():
        assert 1.0 <= r["ratio"] <= 1.02, r
    pipeline = {r["metric"]: r for r in groups["pipeline"]}
    names = ("1F1B", "1F1B recompute", "GPipe", "interleaved 1F1B v=2", "ZB-H1", "ZB-V")
    ticks = dict.fromkeys(names, "1/(1-bubble)")
    assert sorted(pipeline) == sorted(
        ["temp bytes 1F1B/GPipe"]
        + [
            f"{name} {metric}"
            for name, tick in ticks.items()
            for metric in (
                f"FLOPs/dp over {tick}",
                "step time/dp",
                "bubble 1-dp/FLOPs over formula",
                "bubble 1-dp/time over formula",
            )
        ]
    )
    # Matmul FLOPs are deterministic: within 3% of the tick ratio without recompute, a third of the blocks more
    # with it; interleaving's bubble is below plain 1F1B's.
    for name in ("1F1B", "GPipe", "interleaved 1F1B v=2", "ZB-H1", "ZB-V"):
        assert pipeline[f"{name} FLOPs/dp over {ticks[name]}"]["ratio"] <= 1.03, pipeline
    assert pipeline["1F1B recompute FLOPs/dp over 1/(1-bubble)"]["ratio"] > 1.03, pipeline
    bubble = "bubble 1-dp/FLOPs over formula"
    assert pipeline[f"interleaved 1F1B v=2 {bubble}"]["measured"] < pipeline[f"1F1B {bubble}"]["measured"], pipeline


@pytest.mark.slow  # a benchmark run in a subprocess (default-suite budget)
@pytest.mark.timeout(120)
def test_data_rss_benchmark_prints_the_ratio(tmp_path):
    """benchmarks/data_rss.py on two tiny sets (three short subprocesses): a table and the RSS ratio."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    script = os.path.join(ROOT, "benchmarks", "data_rss.py")
    args = ["--sizes", "20000", "50000", "--batches", "3", "--global-batch", "4", "--seq-len", "64"]
    proc = subprocess.run(
        [sys.executable, script, *args, "--dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=110
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("streamed ") for line in lines) == 2 and any(line.startswith("in RAM") for line in lines)
    ratio = float(lines[-1].split("= ")[1].split()[0])
    assert 0.5 < ratio < 2.0 and lines[-1].endswith("(goal <= 1.1)")
    assert os.listdir(tmp_path) == []  # the sets are deleted


def test_synthetic_shard_set_is_a_valid_one(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_data_rss", os.path.join(ROOT, "benchmarks", "data_rss.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from jaxpar.data.shards import ShardSet

    bench.SHARD_TOKENS = 30_000  # several shards
    manifest = bench.write_shard_set(str(tmp_path / "set"), 100_000)
    s = ShardSet(str(tmp_path / "set"))
    s.verify()
    assert s.num_tokens == 100_000 and s.num_shards == 4 and manifest["documents"] == s.num_documents
    for d in (0, s.num_documents // 2, s.num_documents - 1):
        doc = s.document(d)
        assert doc[0] == 1 and doc[-1] == 2 and doc.size >= 2
