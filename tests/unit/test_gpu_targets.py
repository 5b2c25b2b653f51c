"""GPU compile targets (jaxpar.analysis.gpu.targets): the shipped descriptions, their memory and peak, cluster names.

No CUDA plugin needed: the descriptions are parsed here as text (the plugin's own parsing is exercised by
tests/system/test_plan_gpu.py where the `gpu-compile` extra is installed).
"""

from __future__ import annotations

import ast
import os

import pytest
from doc_commands import pyproject_section

from jaxpar.analysis.gpu import targets as gpu_targets
from jaxpar.model import flops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name: (device kind, bytes per GPU from the datasheet, compute capability, dense bf16 peak FLOP/s)
EXPECTED = {
    "h100": ("NVIDIA H100 80GB HBM3", 80e9, (9, 0), 989e12),
    "h200": ("NVIDIA H200", 141e9, (9, 0), 989e12),
    "a100": ("NVIDIA A100-SXM4-80GB", 80e9, (8, 0), 312e12),
    "b200": ("NVIDIA B200", 180e9, (10, 0), 2.25e15),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shipped_targets_load_with_memory_and_peak(name):
    t = gpu_targets.target(name.upper())
    kind, memory, cc, peak = EXPECTED[name]
    assert (t.name, t.device_kind, t.memory_bytes, t.compute_capability) == (name, kind, memory, cc)
    assert t.peak_flops == peak == flops.peak_flops(kind)  # one table of peaks
    info = gpu_targets.parse_text_proto(t.text)["gpu_device_info"]
    assert info["threads_per_warp"] == 32 and info["core_count"] > 0 and info["clock_rate_ghz"] > 1


def test_target_names_and_unknown_target():
    assert gpu_targets.target_names() == ("a100", "b200", "h100", "h200")
    with pytest.raises(ValueError, match="unknown GPU target 'v100'.*a100, b200, h100, h200"):
        gpu_targets.target("v100")


def test_parse_text_proto():
    text = """# comment
    a { b: 1  c: -2.5 # trailing
        d { e: ENUM_VALUE } }
    s: "NVIDIA X"
    r { k: 1 } r: { k: 2 }
    """
    assert gpu_targets.parse_text_proto(text) == {
        "a": {"b": 1, "c": -2.5, "d": {"e": "ENUM_VALUE"}},
        "s": "NVIDIA X",
        "r": [{"k": 1}, {"k": 2}],
    }
    for bad, message in (
        ("a { b: 1", "unbalanced"),
        ("a: 1 }", "unbalanced"),
        ("a b: 1", "no value"),
        ("{ b: 1 }", "without a field name"),
    ):
        with pytest.raises(ValueError, match=message):
            gpu_targets.parse_text_proto(bad)


def test_target_text_missing_field_platform_or_peak_is_refused():
    text = gpu_targets.target("h100").text
    with pytest.raises(ValueError, match="missing field.*threads_per_warp"):
        gpu_targets.target_from_text("x", text.replace("threads_per_warp: 32", ""))
    with pytest.raises(ValueError, match="platform_name must be"):
        gpu_targets.target_from_text("x", text.replace('platform_name: "CUDA"', 'platform_name: "ROCM"'))
    with pytest.raises(ValueError, match="no dense bf16 peak.*NVIDIA Q1"):
        gpu_targets.target_from_text("x", text.replace("NVIDIA H100 80GB HBM3", "NVIDIA Q1"))


def test_cluster_names():
    c = gpu_targets.parse_cluster(" H100:8x8 ")
    assert (c.target.name, c.nodes, c.gpus_per_node, c.devices, c.topology, c.name) == (
        "h100",
        8,
        8,
        64,
        "1x8x8",
        "h100:8x8",
    )
    for bad in ("h100", "h100:8", "h100:8x", "h100:0x8", "h100:2x0"):
        with pytest.raises(ValueError):
            gpu_targets.parse_cluster(bad)
    with pytest.raises(ValueError, match="unknown GPU target"):
        gpu_targets.parse_cluster("x100:1x8")
    with pytest.raises(ValueError, match="nodes must be a positive integer"):
        gpu_targets.cluster("h100", 0, 8)


def test_targets_are_package_data():
    shipped = ast.literal_eval(pyproject_section("tool.setuptools.package-data")["jaxpar"])
    assert "analysis/gpu/targets/*.txtpb" in shipped
    files = {f for f in os.listdir(os.path.join(ROOT, "jaxpar", "analysis", "gpu", "targets")) if f.endswith(".txtpb")}
    assert files == set(gpu_targets.TARGET_FILES.values())


def test_fits_uses_the_memory_fraction_the_slurm_script_gives_jax():
    """`fits` compares a peak with the share of GPU memory a jax process may use; the launch script sets that
    share (XLA_PYTHON_CLIENT_MEM_FRACTION), so the two must agree."""
    import re

    script = open(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "tools", "slurm_gpu.sbatch")).read()
    fractions = re.findall(r"^export XLA_PYTHON_CLIENT_MEM_FRACTION=([0-9.]+)$", script, re.MULTILINE)
    assert [float(f) for f in fractions] == [gpu_targets.MEMORY_FRACTION]
    assert gpu_targets.target("h100").usable_bytes == pytest.approx(gpu_targets.MEMORY_FRACTION * 80e9)
