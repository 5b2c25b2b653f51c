"""`jaxpar-plan ... --target KIND:NODESxGPUS [--compile]` (jaxpar.cli.plan,
jaxpar.analysis.planner.report.format_gpu_target).

Without the CUDA plugin (the default environment) the CLI is tested in-process: the flag checks, the error naming
the extra, the plan for the cluster, and the report of a canned `compile_for_gpu` result. With the gpu-compile
extra, one real compile of tiny.yaml for 2 nodes x 8 H100s goes through the CLI (slow; skipped without it, with
the library's reason).
"""

from __future__ import annotations

import json
import os

import pytest

from jaxpar.analysis.gpu import deviceless as plan_gpu
from jaxpar.analysis.planner.report import format_gpu_target
from jaxpar.cli import plan as plan_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_YAML = os.path.join(ROOT, "configs", "tiny.yaml")
TINY = [TINY_YAML, "mesh.fsdp=4"]  # data=2 x fsdp=4 x tensor=2 = 16 GPUs
EXTRA = "pip install 'jaxpar[gpu-compile]'"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--target", "h100"], "--target h100: cluster 'h100': expected KIND:NODESxGPUS such as h100:8x8"),
        (
            ["--target", "v100:1x8"],
            ("--target v100:1x8: unknown GPU target 'v100'; shipped targets: a100, b200, h100, h200"),
        ),
        (["--target", "h100:0x8"], "nodes must be a positive integer"),
        (["--target", "h100:2x8", "--devices", "8"], "--devices 8 conflicts with --target h100:2x8 (2 x 8 = 16 GPUs)"),
        (["--target", "h100:2x8", "--platform", "cpu"], "--platform cpu with --target h100:2x8"),
        (["--target", "h100:2x8", "--compile", "--measure-steps", "2"], "--measure-steps does not apply"),
        (["--target", "h100:2x8", "--compile", "--fast-compile"], "--fast-compile does not apply"),
        (["--target", "h100:2x8", "--compile", "--real-devices"], "--real-devices does not apply"),
        (
            ["--target", "a100:2x8", "precision.fp8.enabled=true"],
            "precision.fp8.enabled=true needs FP8 tensor cores (compute capability 8.9+); NVIDIA A100-SXM4-80GB",
        ),
    ],
)
def test_target_flags_are_checked(argv, needle, capsys, monkeypatch):
    monkeypatch.setattr(plan_gpu, "compile_for_gpu", _never)
    assert plan_cli.main([*TINY, *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err, err


def _never(*args, **kwargs):
    raise AssertionError("compile_for_gpu must not be reached")


def test_without_the_plugin_the_cli_names_the_extra_before_any_work(capsys, monkeypatch):
    """Exit 2 with the install command; the check comes first (a config that does not exist is not read yet)."""
    monkeypatch.setattr(plan_gpu, "CUDA_PLUGIN_DISTRIBUTIONS", ("jaxpar-no-such-plugin",))
    monkeypatch.setattr(plan_gpu, "compile_for_gpu", _never)
    for config in (TINY_YAML, os.path.join(ROOT, "configs", "no_such.yaml")):
        assert plan_cli.main([config, "--compile", "--target", "h100:2x8"]) == 2
        err = capsys.readouterr().err
        assert "--compile --target h100:2x8" in err and f"not installed: {EXTRA}" in err, err


def test_target_plans_for_gpu_on_the_clusters_devices(capsys):
    """Without --compile: the analytic plan for platform gpu at 16 devices, and the target's memory; --devices
    equal to the cluster's count is accepted."""
    assert plan_cli.main([*TINY, "--target", "h100:2x8", "--devices", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["devices"] == 16 and out["plan"]["platform"] == "gpu"
    assert out["plan"]["mesh"] == {"data": 2, "pipeline": 1, "fsdp": 4, "context": 1, "tensor": 2}
    t = out["target"]
    peak = out["plan"]["memory"]["peak_estimate"]
    assert t["cluster"] == "h100:2x8" and t["devices"] == 16 and t["memory_bytes"] == 80 * 10**9
    assert t["planned_peak_bytes"] == peak and t["planned_fraction_of_memory"] == peak / 80e9 and t["planned_fits"]
    assert t["usable_bytes"] == pytest.approx(0.9 * 80e9)  # jaxpar.analysis.gpu.targets.MEMORY_FRACTION
    assert out["gpu_compiled"] is None
    assert plan_cli.main([*TINY, "--target", "h100:2x8"]) == 0
    text = capsys.readouterr().out
    assert "planned for platform gpu" in text
    assert "target h100:2x8: 16 x NVIDIA H100 80GB HBM3, 80 GB each; planned peak 4.513 MB" in text


def test_mesh_that_does_not_fill_the_cluster_is_a_config_error(capsys):
    assert plan_cli.main([TINY_YAML, "mesh.fsdp=2", "--target", "h100:2x8"]) == 2
    assert "config error" in capsys.readouterr().err


def _canned(fits: bool = True) -> dict:
    """A `compile_for_gpu` result (its documented shape) with made-up figures."""
    peak = 7_650_877 if fits else 133_000_000_000
    return {
        "cluster": "h100:2x8",
        "target": "h100",
        "device_kind": "NVIDIA H100 80GB HBM3",
        "devices": 16,
        "mesh": {"data": 2, "pipeline": 1, "fsdp": 4, "context": 1, "tensor": 2},
        "compute_dtype": "bfloat16",
        "compile_seconds": 12.3,
        "memory": {
            "argument_bytes": 859_413,
            "output_bytes": 856_749,
            "alias_bytes": 856_341,
            "temp_bytes": 7_202_432,
            "generated_code_bytes": 0,
            "peak_bytes": peak,
        },
        "memory_bytes": 80_000_000_000,
        "usable_bytes": 72e9,
        "fraction_of_memory": peak / 80e9,
        "fits": fits,
        "collectives": {"fsdp all-gather": {"count": 8, "bytes": 1_233_600.0}},
        "scalars": {"count": 2, "bytes": 14.0, "kinds": ["all-reduce"], "axes": ["data,fsdp"]},
        "fused_attention": [] if fits else ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"],
        "attention_scores": (
            {"materialised": True, "shapes": ["f32[8,128,128]"], "largest_bytes": 524_288}
            if fits
            else {"materialised": False, "shapes": [], "largest_bytes": 0}
        ),
        "overlap": {
            "by_kind": {"all-gather": {"count": 8, "overlapped": 7, "under_gemm": 5}},
            "pipeline_permutes": (
                []
                if fits
                else [{"trips": 8, "direction": "up", "name": "collective-permute-start.2", "compute": 9, "gemms": 1}]
            ),
        },
        "planned": {
            "peak_bytes": 5_062_656,
            "ratio": peak / 5_062_656,
            "collectives": [
                {
                    "key": "fsdp all-gather",
                    "compiled_bytes": 1_233_600.0,
                    "compiled_count": 8,
                    "planned_bytes": 1_233_600.0,
                    "planned_count": 75,
                    "ratio": 1.0,
                },
                {
                    "key": "fsdp,tensor all-reduce",
                    "compiled_bytes": 94.0,
                    "compiled_count": 2,
                    "planned_bytes": 0.0,
                    "planned_count": 0,
                    "ratio": None,
                },
            ],
        },
    }


def test_compiled_report_through_the_cli(capsys, monkeypatch):
    """--compile --target with the compile replaced by a canned result: text and JSON carry its figures, and
    the compile gets the cluster's kind, nodes and GPUs per node with the config resolved at 16 devices."""
    calls = []

    def fake_compile(cfg, target, nodes, gpus_per_node):
        calls.append((target, nodes, gpus_per_node, cfg.mesh.fsdp))
        return _canned()

    monkeypatch.setattr(plan_gpu, "cuda_plugin_version", lambda: "0.10.2")
    monkeypatch.setattr(plan_gpu, "compile_for_gpu", fake_compile)
    assert plan_cli.main([*TINY, "--compile", "--target", "h100:2x8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert calls == [("h100", 2, 8, 4)]
    assert out["gpu_compiled"] == _canned() and out["target"]["cluster"] == "h100:2x8" and out["compiled"] is None
    assert plan_cli.main([*TINY, "--compile", "--target", "h100:2x8"]) == 0
    text = capsys.readouterr().out
    for needle in (
        "compiled for h100:2x8 by XLA's GPU compiler without GPUs",
        "mesh data=2 pipeline=1 fsdp=4 context=1 tensor=2, compute bfloat16, 12.3 s",
        "arguments                                        859,413    859.4 kB",
        "temporaries                                    7,202,432    7.202 MB",
        "peak                                           7,650,877    7.651 MB",
        "peak compiled / planned: 7.651 MB / 5.063 MB = 1.5112",
        (
            "fits: peak 7.651 MB = 0.00956% of the 80 GB of one NVIDIA H100 80GB HBM3 (a jax process may "
            "use 90%: XLA_PYTHON_CLIENT_MEM_FRACTION as tools/slurm_gpu.sbatch sets it)"
        ),
        (
            "fused attention (cuDNN): no (XLA attention path); attention scores materialised: yes, "
            "largest 524.3 kB per device (f32[8,128,128])"
        ),
        "+ scalar all-reduces, not planned: 2 ops, 14 B over data,fsdp",
        (
            "asynchronous collectives with kernels between start and done (scheduled GPU HLO): all-gather 7 of 8 "
            "(5 under a GEMM)"
        ),
    ):
        assert needle in text, needle
    rows = [line.split() for line in text.splitlines()]
    assert ["fsdp", "all-gather", "1,233,600", "75", "1,233,600", "8", "1.0000"] in rows  # planned beside GPU HLO
    assert ["fsdp,tensor", "all-reduce", "0", "0", "94", "2", "-"] in rows


def test_report_of_a_run_that_does_not_fit():
    target = {
        "cluster": "h100:8x8",
        "device_kind": "NVIDIA H100 80GB HBM3",
        "devices": 64,
        "memory_bytes": 80_000_000_000,
        "usable_bytes": 72e9,
        "planned_peak_bytes": 96e9,
        "planned_fraction_of_memory": 1.2,
        "planned_fits": False,
    }
    text = format_gpu_target(target, _canned(fits=False))
    assert "planned peak 96 GB = 120% of it (DOES NOT FIT in the 90% a jax process may use)" in text
    assert "DOES NOT FIT: peak 133 GB = 166% of the 80 GB of one NVIDIA H100 80GB HBM3" in text
    assert (
        "fused attention (cuDNN): yes, __cudnn$fmhaSoftmax, __cudnn$fmhaSoftmaxBackward; attention scores "
        "materialised: no" in text
    )
    assert (
        "pipeline tick loop of 8 trips: collective-permute-start.2 (to the next stage) under 9 kernels, 1 with GEMMs"
        in text
    )
    assert "--compile compiles" in format_gpu_target(target)


@pytest.mark.slow
@pytest.mark.requires_gpu_compile
def test_cli_compiles_tiny_for_two_h100_nodes(capsys):
    """One real compile through the CLI (12-40 s on 2 shared cores): the JSON report's figures are consistent
    with each other and with the plan, and the text report shows them."""
    assert plan_cli.main([*TINY, "--compile", "--target", "h100:2x8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    gpu, plan, target = out["gpu_compiled"], out["plan"], out["target"]
    assert gpu["cluster"] == target["cluster"] == "h100:2x8" and gpu["devices"] == plan["devices"] == 16
    assert gpu["mesh"] == plan["mesh"] == {"data": 2, "pipeline": 1, "fsdp": 4, "context": 1, "tensor": 2}
    m = gpu["memory"]
    assert (
        0
        < m["argument_bytes"]
        < m["peak_bytes"]
        <= (m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"])
    )
    assert gpu["planned"]["peak_bytes"] == plan["memory"]["peak_estimate"] == target["planned_peak_bytes"]
    assert gpu["planned"]["ratio"] == pytest.approx(m["peak_bytes"] / plan["memory"]["peak_estimate"])
    assert gpu["fits"] and gpu["fraction_of_memory"] == pytest.approx(m["peak_bytes"] / 80e9)
    rows = {r["key"]: r for r in gpu["planned"]["collectives"]}
    for key in ("fsdp all-gather", "fsdp reduce-scatter", "tensor all-gather", "tensor reduce-scatter"):
        assert rows[key]["planned_bytes"] == plan["by_axis"][key]
        assert rows[key]["ratio"] == pytest.approx(1.0, rel=0.01), rows[key]
    assert gpu["fused_attention"] and not gpu["attention_scores"]["materialised"]  # cuDNN (model.attention auto)
    text = format_gpu_target(target, gpu)
    assert f"{m['peak_bytes']:,}" in text and f"{m['temp_bytes']:,}" in text and "fits: peak" in text
