"""The planner (jaxpar.plan, jaxpar.plan_comm) against the model, the hand-computed formulas and the compiled step.

The compiled checks compile the real train step of a small model ahead of time on the 8 simulated CPU devices
(nothing runs) and compare: params + optimizer state bytes (XLA's arguments minus the batch and the 0-d
counters) with the plan within 1%, and the (mesh axes, kind) of every array collective in the HLO with the
plan's list, bytes within 1% overall.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from jaxpar.cli import plan as plan_cli
from jaxpar.comm import tensor_parallel_bytes, tensor_parallel_terms
from jaxpar.config import load_config, resolve_config
from jaxpar.memory import tensor_rank_params
from jaxpar.mesh import build_mesh
from jaxpar.model import init_params, logical_axes
from jaxpar.plan import (
    GB,
    activation_bytes,
    exercise_activations,
    param_leaves,
    plan,
    rank_params,
    smallest_fitting_devices,
    state_bytes,
    zero_exercise,
)
from jaxpar.plan_comm import by_axis, collective_terms
from jaxpar.train.step import build_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_YAML = os.path.join(ROOT, "configs", "tiny.yaml")
LLAMA_13B = os.path.join(ROOT, "configs", "llama_13b.yaml")
# Compile time dominates: the model is as small as the checks allow (d_model 64 divides by 8 state shards).
SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
         "data.seq_len=8", "train.global_batch_size=8"]
FAST = ["--fast-compile"]


def _cfg(overrides, devices=8, path=TINY_YAML):
    return resolve_config(load_config(path, [*SMALL, *overrides], validate=False), devices)


def _paths(tree) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))[0]
    return {"/".join(k.key for k in path): leaf for path, leaf in flat}


@pytest.mark.parametrize("tied", [False, True])
def test_param_table_matches_the_model(tied):
    cfg = _cfg([f"model.tie_embeddings={str(tied).lower()}", "model.n_kv_heads=1", "mesh.tensor=1"])
    shapes = _paths(jax.eval_shape(lambda: init_params(cfg.model, 0)))
    axes = _paths(logical_axes(cfg.model))
    table = {leaf.path: leaf for leaf in param_leaves(cfg.model)}
    assert set(table) == set(shapes) == set(axes)
    for path, leaf in table.items():
        assert leaf.shape == shapes[path].shape, path
        assert leaf.axes == axes[path], path


def test_rank_params_match_memory_on_a_tensor_pipeline_mesh():
    cfg = _cfg(["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "mesh.pipeline=2", "model.n_layers=4"])
    step_plan = build_plan(cfg, build_mesh(cfg))
    params = jax.eval_shape(lambda: init_params(cfg.model, 0))
    total = sum(leaf.size for leaf in param_leaves(cfg.model))
    assert rank_params(cfg) == tensor_rank_params(step_plan, params)
    assert total / 4 < rank_params(cfg) < total  # the embedding and head are on both stages


def test_state_bytes_by_hand():
    # 16p ZeRO-1 on data=4 x fsdp=2: (4P + 12P/4) / 2 with P the whole model (tensor = pipeline = 1).
    cfg = _cfg(["mesh.data=4", "mesh.fsdp=2", "mesh.tensor=1", "precision.layout=16p", "optimizer.zero_stage=1"])
    p = sum(leaf.size for leaf in param_leaves(cfg.model))
    out = state_bytes(cfg)
    assert (out["params"], out["grads"], out["opt_state"]) == (2 * p / 2, 2 * p / 2, 12 * p / 8)
    assert out["expression"] == "ZeRO-1 16p: (4P + 12P/N)/F"


def test_activation_formula_by_hand():
    # remat=full, no pipeline: each layer keeps its block input b*s*D; outside, the embedding output b*s*D and
    # the logits b*s*V in the compute dtype and in fp32. data=8: b = 8 / 8 = 1 row.
    cfg = _cfg(["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "model.remat=full",
                "precision.compute_dtype=bfloat16"])
    b, s, d, v, layers = 1, 8, 64, 264, 2
    act = activation_bytes(cfg)
    assert act["per_layer"] == b * s * d * 2
    assert act["total"] == layers * b * s * d * 2 + b * s * d * 2 + b * s * v * (2 + 4)
    assert act["korthikanti"] == layers * 2 * s * b * d  # Table 2, full recomputation: 2sbh per layer
    none = activation_bytes(_cfg(["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "model.remat=none"]))
    assert none["korthikanti"] == layers * s * b * d * (34 + 5 * 4 * s / d)
    # 1F1B keeps a ring of 2p - 1 stage inputs [b, s, D] whatever m; compute_dtype auto is bf16 on a GPU target
    # and fp32 on CPU.
    pipe = _cfg(["mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipeline=2", "model.remat=full",
                 "pipeline.microbatches=2"])
    assert activation_bytes(pipe, "gpu")["stage_inputs"] == 3 * (8 // 4 // 2) * s * d * 2
    assert activation_bytes(pipe, "cpu")["stage_inputs"] == 3 * (8 // 4 // 2) * s * d * 4


@pytest.mark.parametrize("sp,remat", [(False, "none"), (True, "none"), (True, "full"), (False, "full")])
def test_tensor_terms_agree_with_comm(sp, remat):
    """Without a pipeline the planner's tensor-axis bytes equal jaxpar.comm's independent Megatron count."""
    cfg = _cfg(["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", f"tensor.sequence_parallel={str(sp).lower()}",
                f"model.remat={remat}", "train.grad_accum_steps=2", "train.global_batch_size=16"])
    terms = tensor_parallel_terms(rows=2, seq_len=8, d_model=64, n_layers=2, microbatches=2, tensor=2,
                                  sequence_parallel=sp, compute_dtype="bfloat16", reduce_dtype="float32",
                                  fsdp_shards=2, remat=remat)
    want = tensor_parallel_bytes(terms, 2)
    got = {kind: b for (axes, kind), b in by_axis(collective_terms(cfg, "gpu")).items() if axes == ("tensor",)}
    assert got == pytest.approx(want, rel=1e-12)


def test_seed_exercise_numbers():
    ex = zero_exercise(13e9, 8, 24 * GB, "16p")
    assert [s["bytes"] / GB for s in ex["stages"]] == pytest.approx([208.0, 71.5, 48.75, 26.0], rel=1e-12)
    assert [s["expression"] for s in ex["stages"]] == ["DDP 16p: 16P", "ZeRO-1 16p: 4P + 12P/N",
                                                       "ZeRO-2 16p: 2P + 14P/N", "ZeRO-3 16p: 16P/N"]
    assert ex["smallest_devices_zero3"] == 9 and ex["zero3_bytes_at_smallest"] / GB == pytest.approx(208 / 9)
    cfg = load_config(LLAMA_13B, validate=False)
    acts = exercise_activations(cfg, ex)
    assert acts["n_params"] == 13_015_864_320  # Llama 2 13B
    s, h, a, layers = 4096, 5120, 40, 40
    assert acts["korthikanti_none"] == pytest.approx(layers * s * h * (34 + 5 * a * s / h))
    assert acts["korthikanti_full"] == 2 * s * h * layers
    # 16P/9 = 23.1 GB leaves 0.9 GB: model state + activations (remat full, ~2.5 GB) first fit at N = 10.
    assert 2 * GB < acts["jaxpar_activations"] < 3 * GB
    assert acts["fit_state_acts"] == 10
    assert acts["fit_temp"] > acts["fit_state_acts"]
    assert acts["fit_temp_shardable"] >= acts["fit_temp"] and 5120 % acts["fit_temp_shardable"] == 0
    assert smallest_fitting_devices(cfg, 1 * GB, False, False, max_devices=64) is None  # activations alone > 1 GB


def test_cli_exercise(capsys):
    assert plan_cli.main(["--exercise-13b"]) == 0
    out = capsys.readouterr().out
    for needle in ("208.00 GB", "71.50 GB", "48.75 GB", "26.00 GB", "N = 9 (23.11 GB per device)",
                   "no recomputation", "Smallest N for model state + jaxpar activations <= 24 GB: 10"):
        assert needle in out, needle
    assert plan_cli.main(["--exercise-13b", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["exercise"]["smallest_devices_zero3"] == 9


@pytest.mark.parametrize("argv, needle", [
    ([TINY_YAML, "model.hidden=3"], "unknown config key model.hidden"),
    ([TINY_YAML, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "--devices", "16"],
     "make the product equal the device count"),
    ([TINY_YAML, "mesh.data=1", "mesh.tensor=8"], "must be divisible by mesh.tensor=8"),
    (["configs/missing.yaml"], "does not exist"),
    ([TINY_YAML, "--devices", "0"], "--devices must be >= 1"),
    ([], "give a CONFIG file"),
])
def test_cli_bad_input(capsys, argv, needle):
    assert plan_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_cli_plans_64_devices_without_them():
    """--devices 64 in a process that has one CPU device: the analytic plan needs no devices."""
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="1", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jaxpar.cli.plan", os.path.join(ROOT, "configs", "llama_7b.yaml"), "--devices",
           "64", "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=8", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True, timeout=300)
    p = json.loads(out.stdout)["plan"]
    assert p["devices"] == 64 and p["mesh"]["tensor"] == 8
    # ZeRO-3 (llama_1b.yaml) over data x fsdp = 8: 16 bytes per parameter of a tensor rank, / 8.
    assert p["memory"]["model_state"] == pytest.approx(16 * p["params"]["per_rank"] / 8)
    assert p["params"]["per_rank"] < p["params"]["total"] / 7  # tensor=8 splits all but the norms
    assert {"fsdp all-gather", "fsdp reduce-scatter", "tensor all-gather", "tensor reduce-scatter"} <= set(
        p["by_axis"])


# ---- planned vs compiled -------------------------------------------------------------------------------------

MESHES = {  # name -> overrides; the first two are in the default suite, the others run with -m slow
    "ddp_data8": ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "optimizer.zero_stage=0"],
    "zero1_d2f2t2_sp": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "optimizer.zero_stage=1"],
    "zero3_d4f2_16p": ["mesh.data=4", "mesh.fsdp=2", "mesh.tensor=1", "optimizer.zero_stage=3",
                       "precision.layout=16p"],
    "zero1_d2f2p2_1f1b": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=1", "mesh.pipeline=2", "model.n_layers=4",
                          "pipeline.microbatches=2", "optimizer.zero_stage=1"],
    "zero2_f2t2p2_gpipe": ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "mesh.pipeline=2", "model.n_layers=4",
                           "pipeline.microbatches=2", "pipeline.schedule=gpipe", "optimizer.zero_stage=2",
                           "tensor.sequence_parallel=false", "model.remat=full"],
}
SLOW = {"zero3_d4f2_16p", "zero1_d2f2p2_1f1b", "zero2_f2t2p2_gpipe"}
_COMPILED: dict = {}


def _compiled(name, capsys) -> dict:
    """The CLI's --compile --json output for a mesh (compiled once per session, in this process)."""
    if name not in _COMPILED:
        assert plan_cli.main([TINY_YAML, *SMALL, *MESHES[name], "--devices", "8", "--compile", "--json",
                              *FAST]) == 0
        _COMPILED[name] = json.loads(capsys.readouterr().out)
    return _COMPILED[name]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in MESHES])
def test_planned_state_equals_compiled(name, capsys):
    out = _compiled(name, capsys)
    state, mem = out["compiled"]["state"], out["plan"]["memory"]
    assert out["plan"]["platform"] == "cpu"
    assert state["params_plus_opt_state"] == pytest.approx(mem["params"] + mem["opt_state"], rel=0.01)
    assert state["params"] == pytest.approx(mem["params"], rel=0.01)
    assert state["scalars"] > 0  # the 0-d counters are measured and set aside, not absorbed by the tolerance


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in MESHES])
def test_planned_collectives_equal_compiled(name, capsys):
    out = _compiled(name, capsys)
    rows = out["compiled"]["collectives"]
    compiled = {r["key"] for r in rows if r["compiled_bytes"] > 0}
    planned = {r["key"] for r in rows if r["planned_bytes"] > 0}
    assert compiled == planned
    assert len(planned) >= 1 + ("tensor=2" in " ".join(MESHES[name]))
    total_c = sum(r["compiled_bytes"] for r in rows)
    total_p = sum(r["planned_bytes"] for r in rows)
    assert total_c == pytest.approx(total_p, rel=0.01)
    for r in rows:
        # Small tuple all-reduces can carry a few grad-norm scalars next to an array (a few bytes): 5%.
        assert r["compiled_bytes"] == pytest.approx(r["planned_bytes"], rel=0.05), r
    # What is left unplanned is scalar all-reduces only.
    assert set(out["compiled"]["scalars"]["kinds"]) <= {"all-reduce"}


@pytest.mark.slow
def test_cli_compile_in_a_fresh_process():
    """`jaxpar-plan CONFIG --compile` sets the CPU device count itself before jax starts."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    cmd = [sys.executable, "-m", "jaxpar.cli.plan", TINY_YAML, *SMALL, "mesh.data=1", "--devices", "4",
           "--compile", "--fast-compile"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True, timeout=600).stdout
    assert "data=1 pipeline=1 fsdp=2 tensor=2 (4 devices)" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("params + optimizer state"))
    assert line.split()[-1] == "1.0000"
    assert "XLA memory_analysis" in out and "tensor           reduce-scatter" in out


def test_plan_is_json_ready():
    p = plan(_cfg(["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]))
    assert json.loads(json.dumps(p))["mesh"] == {"data": 2, "pipeline": 1, "fsdp": 2, "tensor": 2}
