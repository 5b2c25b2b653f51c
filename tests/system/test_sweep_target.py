"""Sweeps for a GPU cluster (`target:` in a sweep file; jaxpar.analysis.sweep.run, jaxpar.analysis.sweep.gpu,
jaxpar.analysis.sweep.report).

Everything but the last test runs without jax's CUDA plugin: the GPU compile of each point is replaced by a fake
runner, and the plugin check by a monkeypatch (so the tests do not depend on the environment running them). The
last test compiles one small point for 8 H100s and is skipped without the gpu-compile extra, with the reason the
library gives.
"""

from __future__ import annotations

import json
import os

import pytest

from jaxpar.analysis.gpu import deviceless as plan_gpu
from jaxpar.analysis.planner.plan import plan
from jaxpar.analysis.sweep.gpu import gpu_summary, target_command
from jaxpar.analysis.sweep.report import objective_value
from jaxpar.analysis.sweep.run import SweepError, factorisations, load_sweep, points, run_sweep
from jaxpar.cli import sweep as sweep_cli
from jaxpar.config import load_config, resolve_config
from jaxpar.config.mesh_axes import CONFIG_AXES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_YAML = os.path.join(ROOT, "configs", "tiny.yaml")
SMALL = [
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=128",
    "data.seq_len=8",
    "train.global_batch_size=8",
]
H100 = 80e9


def _write(tmp_path, text: str, name: str = "sweep.yaml") -> str:
    path = tmp_path / name
    path.write_text(f"base: {TINY_YAML}\noverrides: {json.dumps(SMALL)}\n{text}")
    return str(path)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("target: v100:1x8\n", "target: unknown GPU target 'v100'; shipped targets: a100, b200, h100, h200"),
        ("target: h100:8\n", "target: cluster 'h100:8': expected KIND:NODESxGPUS such as h100:8x8 (kinds: a100, b200,"),
        ("target: 8\n", "target: expected KIND:NODESxGPUS such as h100:8x8 (kinds: a100, b200, h100, h200), got 8"),
        (
            "target: h100:1x8\ndevices: 16\n",
            "devices: 16 conflicts with target: h100:1x8 (1 x 8 = 8 GPUs): the device count follows from the cluster",
        ),
        (
            "target: h100:2x8\nmeshes: [{data: 16}, {data: 4, fsdp: 2}]\n",
            "meshes[1]: {'data': 4, 'fsdp': 2} spans 8 devices, but target: h100:2x8 has 2 x 8 = 16 GPUs",
        ),
        (
            "target: h100:1x8\nmeasure_steps: 2\n",
            "measure_steps: 2 with target: h100:1x8: nothing can run without the cluster's GPUs",
        ),
        (
            "target: h100:1x8\nobjective: tokens_per_s\n",
            "objective: tokens_per_s needs measured steps, which target: h100:1x8 cannot run",
        ),
        (
            "target: h100:1x8\nplatform: cpu\n",
            "platform: 'cpu' with target: h100:1x8: a GPU cluster is planned for platform gpu",
        ),
        ("target: h100:1x8\nplatform: tpu\n", "platform: 'tpu' with target: h100:1x8"),
        ("target: h100:1x8\nreal_devices: true\n", "real_devices: true does not apply with target: h100:1x8"),
        ("target: h100:1x8\nfast_compile: true\n", "fast_compile: true does not apply with target: h100:1x8"),
    ],
)
def test_bad_target_keys(tmp_path, text, needle):
    with pytest.raises(SweepError) as err:
        load_sweep(_write(tmp_path, text))
    assert needle in str(err.value)


def test_the_device_count_is_the_clusters(tmp_path):
    sweep = load_sweep(_write(tmp_path, "target: H100:1x8\nconstraints: {max_tensor: 2, max_pipeline: 1}\n"))
    assert (sweep.target, sweep.platform) == ("h100:1x8", "gpu")
    pts = points(sweep)
    assert pts and all(p["devices"] == 8 for p in pts) and len(pts) == 4 + 3  # data x fsdp, tensor 1 and 2
    same = load_sweep(_write(tmp_path, "target: h100:1x8\ndevices: 8\nplatform: gpu\n", name="same.yaml"))
    assert [p["mesh"] for p in points(same)] == factorisations(8, {}, n_layers=2, n_heads=4)


def test_the_point_command_compiles_for_the_cluster():
    cmd, env = target_command("base.yaml", ["mesh.data=8"], "h100:1x8", 2e9)
    assert cmd[1:] == [
        "-m",
        "jaxpar.cli.plan",
        "base.yaml",
        "mesh.data=8",
        "--target",
        "h100:1x8",
        "--compile",
        "--json",
        "--memory-budget-gb",
        "2.0",
    ]
    assert env == {"JAX_PLATFORMS": "cpu"}  # jax must not try to start CUDA in the subprocess


def _no_plugin(monkeypatch):
    """What a machine without jax's CUDA plugin sees, whether or not this environment has it."""
    monkeypatch.setattr(plan_gpu, "CUDA_PLUGIN_DISTRIBUTIONS", ("jaxpar-no-such-plugin",))
    assert plan_gpu.unavailable_reason() is not None


def test_without_the_plugin_a_compiling_target_sweep_stops_before_any_point(tmp_path, monkeypatch, capsys):
    _no_plugin(monkeypatch)
    path = _write(tmp_path, "target: h100:1x8\nmeshes: [{data: 8}, {fsdp: 8}]\ncompile: true\n")
    out = tmp_path / "out"
    assert sweep_cli.main([path, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "jaxpar-sweep: target: h100:1x8 with compile: true: compiling for a GPU cluster needs jax's CUDA plugin"
    )
    assert "pip install 'jaxpar[gpu-compile]'" in err and "compile: false" in err and "Traceback" not in err
    assert not out.exists()
    calls: list = []  # nothing already saved is touched, and no point runs
    out.mkdir()
    (out / "results.json").write_text("earlier results")
    with pytest.raises(plan_gpu.GpuCompileUnavailable, match=r"gpu-compile"):
        run_sweep(load_sweep(path), str(out), log=lambda _: None, runner=_fake_runner(calls, {}))
    assert calls == [] and os.listdir(out) == ["results.json"]
    assert (out / "results.json").read_text() == "earlier results"


def test_without_the_plugin_an_analytic_target_sweep_plans_for_gpu(tmp_path, monkeypatch):
    _no_plugin(monkeypatch)
    path = _write(tmp_path, "target: h100:1x8\nmeshes: [{data: 8}, {data: 2, fsdp: 4}]\ncompile: false\n")
    records = run_sweep(load_sweep(path), str(tmp_path / "out"), log=lambda _: None)
    assert [r["status"] for r in records] == ["ok", "ok"]
    for r in records:
        cfg = resolve_config(load_config(TINY_YAML, [*SMALL, *r["overrides"]], validate=False), 8)
        assert r["planned"]["platform"] == "gpu" and r["gpu_compiled"] is None
        assert r["planned"]["peak_estimate"] == plan(cfg, "gpu")["memory"]["peak_estimate"]
    md = (tmp_path / "out" / "results.md").read_text()
    assert "Compiled for **h100:1x8** (8 x NVIDIA H100 80GB HBM3, 80 GB each)" in md


def _gpu_compiled(peak: float, fits: bool = True) -> dict:
    """A minimal `compile_for_gpu` result (the JSON "gpu_compiled" of jaxpar-plan --target --compile)."""
    rows = [
        {
            "key": "fsdp all-gather",
            "compiled_bytes": 1000.0,
            "compiled_count": 4,
            "planned_bytes": 1000.0,
            "planned_count": 8,
            "ratio": 1.0,
        },
        {
            "key": "fsdp all-reduce",
            "compiled_bytes": 24.0,
            "compiled_count": 2,
            "planned_bytes": 0.0,
            "planned_count": 0,
            "ratio": None,
        },
    ]
    return {
        "cluster": "h100:1x8",
        "target": "h100",
        "device_kind": "NVIDIA H100 80GB HBM3",
        "devices": 8,
        "mesh": {},
        "compute_dtype": "bfloat16",
        "compile_seconds": 1.5,
        "memory": {
            "argument_bytes": peak / 4,
            "output_bytes": peak / 4,
            "alias_bytes": peak / 4,
            "temp_bytes": peak / 2,
            "generated_code_bytes": 0,
            "peak_bytes": peak,
        },
        "memory_bytes": H100,
        "fraction_of_memory": peak / H100,
        "fits": fits,
        "collectives": {},
        "scalars": {"count": 0, "bytes": 0.0, "kinds": [], "axes": []},
        "fused_attention": [],
        "attention_scores": {"materialised": True, "shapes": ["f32[2,8,8]"], "largest_bytes": 512},
        "planned": {"peak_bytes": peak / 2, "ratio": 2.0, "collectives": rows},
    }


def _fake_runner(calls: list, peaks: dict, budget: float | None = None, unfit: frozenset = frozenset()):
    """Stands in for `jaxpar-plan ... --target h100:1x8 --compile --json`: the GPU peak of each mesh from `peaks`
    ({"data=8 fsdp=1 ...": bytes}); over budget as that CLI decides it (the GPU-compiled peak > budget)."""

    def run(sweep, point):
        calls.append(point["key"])
        mesh = " ".join(f"{a}={n}" for a, n in point["mesh"].items())
        peak = peaks[mesh]
        out = {
            "plan": {},
            "target": {},
            "gpu_compiled": _gpu_compiled(peak, mesh not in unfit),
            "compiled": None,
            "measured": None,
            "over_budget": budget is not None and peak > budget,
        }
        return 0, json.dumps(out) + "\n", ""

    return run


def test_memory_ranks_by_the_gpu_compiled_peak(tmp_path, monkeypatch):
    """Fake GPU peaks in the opposite order of the plan's: the ranking follows the GPU compiler; a point over
    the budget by its GPU peak, and one whose GPU peak does not fit one H100, are marked over budget."""
    monkeypatch.setattr(plan_gpu, "unavailable_reason", lambda: None)
    meshes = {
        "data=8 fsdp=1 tensor=1 pipeline=1 context=1": {"data": 8},
        "data=1 fsdp=8 tensor=1 pipeline=1 context=1": {"fsdp": 8},
        "data=2 fsdp=2 tensor=2 pipeline=1 context=1": {"data": 2, "fsdp": 2, "tensor": 2},
        "data=4 fsdp=2 tensor=1 pipeline=1 context=1": {"data": 4, "fsdp": 2},
    }
    planned = {}
    for name, mesh in meshes.items():
        over = [f"mesh.{a}={mesh.get(a, 1)}" for a in CONFIG_AXES]
        cfg = resolve_config(load_config(TINY_YAML, [*SMALL, *over], validate=False), 8)
        planned[name] = plan(cfg, "gpu")["memory"]["peak_estimate"]
    order = sorted(planned, key=planned.get)  # planned peak, lowest first
    assert planned[order[0]] < planned[order[-1]]
    top = max(planned.values())
    budget = 10 * top  # above every planned peak: every point is compiled
    peaks = {order[0]: 8 * top, order[1]: 11 * top, order[2]: 2 * top, order[3]: 4 * top}
    path = _write(
        tmp_path,
        f"target: h100:1x8\nmeshes: {json.dumps(list(meshes.values()))}\nobjective: memory\n"
        f"memory_budget_bytes: {budget}\n",
    )
    calls: list = []
    records = run_sweep(
        load_sweep(path),
        str(tmp_path / "out"),
        log=lambda _: None,
        runner=_fake_runner(calls, peaks, budget, unfit=frozenset({order[2]})),
    )
    assert len(calls) == 4
    by_mesh = {" ".join(f"{a}={n}" for a, n in r["mesh"].items()): r for r in records}
    for name, r in by_mesh.items():
        assert r["planned"]["platform"] == "gpu" and r["compiled"] is None  # budgeted with the plan for gpu
        assert r["gpu_compiled"]["peak_bytes"] == peaks[name] == objective_value(r, "memory")
    assert by_mesh[order[1]]["status"] == "over_budget"
    assert by_mesh[order[1]]["error"].startswith("skipped: over budget (GPU-compiled peak for h100:1x8")
    assert by_mesh[order[2]]["status"] == "over_budget"
    assert by_mesh[order[2]]["error"].startswith("does not fit: GPU-compiled peak for h100:1x8")
    assert "of one NVIDIA H100 80GB HBM3" in by_mesh[order[2]]["error"]
    gpu = by_mesh[order[3]]["gpu_compiled"]
    assert gpu == gpu_summary(_gpu_compiled(peaks[order[3]]))
    assert (gpu["fits"], gpu["scores_materialised"], gpu["largest_scores_bytes"], gpu["comm_bytes"]) == (
        True,
        True,
        512,
        1024.0,
    )
    assert gpu["comm_ratio"] == pytest.approx(1.024) and gpu["temp_bytes"] == peaks[order[3]] / 2

    md = (tmp_path / "out" / "results.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and "rank" not in line]
    ranked_meshes = [" ".join(f"{a}={v}" for a, v in zip(CONFIG_AXES, line.split(" | ")[1:6])) for line in rows]
    assert ranked_meshes == [order[3], order[0], order[1], order[2]]  # by GPU peak; over budget unranked
    assert rows[0].startswith("| 1 |") and rows[1].startswith("| 2 |") and rows[2].startswith("| - |")
    assert "by XLA's GPU compiler on this machine, without GPUs" in md and "**h100:1x8**" in md
    assert "| GPU peak |" in md and "scores materialised (512 B)" in md and "| no |" in md
    assert (tmp_path / "out" / "plot.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["target"] == {
        "cluster": "h100:1x8",
        "device_kind": "NVIDIA H100 80GB HBM3",
        "devices": 8,
        "memory_bytes": 80_000_000_000,
    }

    # Results compiled for one cluster are not mixed with another's.
    other = tmp_path / "other.yaml"
    other.write_text(open(path).read().replace("h100:1x8", "h200:1x8"))
    with pytest.raises(SweepError, match=r"target 'h100:1x8' -> 'h200:1x8'"):
        run_sweep(load_sweep(str(other)), str(tmp_path / "out"), log=lambda _: None, runner=_fake_runner([], peaks))


@pytest.mark.requires_gpu_compile
def test_one_point_compiled_for_eight_h100s(tmp_path):
    """The real per-point subprocess (`jaxpar-plan --target h100:1x8 --compile --json`) for the small tiny model:
    XLA's GPU compiler's peak ranks the point, and its collectives carry the plan's bytes."""
    path = _write(tmp_path, "target: h100:1x8\nmeshes: [{data: 2, fsdp: 2, tensor: 2}]\ncompile: true\n")
    [rec] = run_sweep(load_sweep(path), str(tmp_path / "out"), log=lambda _: None)
    assert rec["status"] == "ok", rec["error"]
    gpu = rec["gpu_compiled"]
    assert gpu["cluster"] == "h100:1x8" and gpu["compute_dtype"] == "bfloat16" and gpu["fits"]
    assert gpu["argument_bytes"] < gpu["peak_bytes"] == objective_value(rec, "memory")
    assert gpu["fraction_of_memory"] == gpu["peak_bytes"] / H100
    assert gpu["fused_attention"]  # model.attention auto on H100s with bf16: cuDNN's fused kernel
    rows = {r["key"]: r for r in gpu["collectives"]}
    for key in ("fsdp all-gather", "tensor all-gather", "tensor reduce-scatter"):
        assert rows[key]["ratio"] == pytest.approx(1.0, rel=0.01), rows[key]
    assert "GPU peak" in (tmp_path / "out" / "results.md").read_text()
