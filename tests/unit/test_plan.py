"""The planner (jaxpar.analysis.planner.plan, jaxpar.analysis.planner.comm) against the model, the hand-computed
formulas and the compiled step.

The compiled checks compile the real train step of a small model ahead of time on the 8 simulated CPU devices
(nothing runs) and compare like with like: params + optimizer state bytes (XLA's arguments minus the batch and
the 0-d counters) with the plan within 1%; the (mesh axes, kind) of every array collective in the XLA:CPU
executable with the plan for cpu, and in the partitioned program (the HLO after the SPMD partitioner, before
any backend pass, which keeps bf16 collectives bf16) with the plan for gpu. Collective bounds, the same for
both: the keys equal, the total within 1% and each (axes, kind) within 5%. The 5% is for the executable, whose
all-reduce combiner can put a few grad-norm scalars (tens of bytes) into a tuple beside an array; the plan is
integer arithmetic and the partitioned program has no combined ops, so its rows match exactly (ratio 1.0000
measured), and a dtype error is a factor of 2, far outside either bound.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import jax
import pytest

from jaxpar.analysis.planner.comm import collective_terms
from jaxpar.analysis.planner.dims import param_leaves, rank_params_split
from jaxpar.analysis.planner.plan import (
    activation_bytes,
    attention_working_bytes,
    exercise_activations,
    plan,
    smallest_fitting_devices,
    state_bytes,
    temp_bytes,
    zero_exercise,
)
from jaxpar.cli import plan as plan_cli
from jaxpar.config import load_config, resolve_config
from jaxpar.log import GB
from jaxpar.model import init_params, logical_axes
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.plan import build_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_YAML = os.path.join(ROOT, "configs", "tiny.yaml")
LLAMA_13B = os.path.join(ROOT, "configs", "llama_13b.yaml")
# Compile time dominates: the model is as small as the checks allow (d_model 64 divides by 8 state shards).
SMALL = [
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=128",
    "data.seq_len=8",
    "train.global_batch_size=8",
]
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


def _rank_params_from_specs(cfg) -> int:
    """P per tensor/pipeline rank counted from the real parameters and the step's PartitionSpecs: each leaf's
    size divided by the tensor and pipeline sizes its spec uses."""
    step_plan = build_plan(cfg, build_mesh(cfg))
    params = jax.eval_shape(lambda: init_params(cfg.model, 0))
    shape = step_plan.mesh_shape

    def rank_size(x, spec):
        used = {a for dim in spec for a in ((dim,) if isinstance(dim, str) else tuple(dim or ()))}
        return x.size // math.prod(shape[a] for a in ("tensor", "pipeline") if a in used)

    return sum(
        jax.tree.leaves(
            jax.tree.map(
                rank_size,
                params,
                step_plan.specs["params"],
                is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
            )
        )
    )


def test_rank_params_match_the_step_on_a_tensor_pipeline_mesh():
    cfg = _cfg(["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "mesh.pipeline=2", "model.n_layers=4"])
    total = sum(leaf.size for leaf in param_leaves(cfg.model))
    p = sum(rank_params_split(cfg.model, {"data": 1, "fsdp": 2, "tensor": 2, "pipeline": 2}))
    assert p == _rank_params_from_specs(cfg)
    assert total / 4 < p < total  # the embedding and head are on both stages


def test_state_bytes_by_hand():
    # 16p ZeRO-1 on data=4 x fsdp=2: (4P + 12P/4) / 2 with P the whole model (tensor = pipeline = 1).
    cfg = _cfg(["mesh.data=4", "mesh.fsdp=2", "mesh.tensor=1", "precision.layout=16p", "optimizer.zero_stage=1"])
    p = sum(leaf.size for leaf in param_leaves(cfg.model))
    out = state_bytes(cfg)
    assert (out["params"], out["grads"], out["opt_state"]) == (2 * p / 2, 2 * p / 2, 12 * p / 8)
    assert out["expression"] == "ZeRO-1 16p: (4P + 12P/N)/F"


def test_activation_formula_by_hand():
    # remat=full, no pipeline: each layer keeps its block input b*s*D; outside, the embedding output b*s*D and
    # the logits b*s*V in the compute dtype. data=8: b = 8 / 8 = 1 row.
    xla = ["model.attention=xla"]
    cfg = _cfg(
        ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "model.remat=full", "precision.compute_dtype=bfloat16", *xla]
    )
    b, s, d, v, layers, heads = 1, 8, 64, 264, 2, 4
    act = activation_bytes(cfg)
    assert act["per_layer"] == b * s * d * 2
    assert act["total"] == layers * b * s * d * 2 + b * s * d * 2 + b * s * v * 2
    assert act["korthikanti"] == layers * 2 * s * b * d  # Table 2, full recomputation: 2sbh per layer
    # XLA's attention path: one layer's backward holds fp32 logits and their gradient and bf16 probabilities and
    # their gradient, 2*4 + 2*2 bytes per score element [b, H, s, s]; no fused kernel keeps them on chip.
    assert attention_working_bytes(cfg) == 12 * b * heads * s * s
    assert temp_bytes(cfg)["attention_working"] == 12 * b * heads * s * s
    none_overrides = [
        "mesh.data=8",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "model.remat=none",
        "precision.compute_dtype=bfloat16",
    ]
    none = activation_bytes(_cfg([*none_overrides, *xla]))
    assert none["korthikanti"] == layers * s * b * d * (34 + 5 * 4 * s / d)
    # remat none keeps, per layer, q, k, v (4 heads of 16, 2 key/value heads), two projection outputs, gate and
    # up (d_ff 128), the attention context, and the fp32 probabilities.
    kv, f = 2, 128
    matmuls = b * s * ((heads + 2 * kv) * 16 + 2 * d + 2 * f) * 2
    assert none["per_layer"] == b * s * d * 2 + matmuls + b * s * heads * 16 * 2 + 4 * b * heads * s * s
    # cuDNN's fused kernel (model.attention auto on a GPU, bf16, head width 16): no scores in memory; remat none
    # keeps its fp32 softmax statistics [b, H, s] instead of the probabilities.
    fused = _cfg(none_overrides)
    assert attention_working_bytes(fused) == 0
    assert activation_bytes(fused)["per_layer"] == b * s * d * 2 + matmuls + b * s * heads * 16 * 2 + 4 * b * heads * s
    assert attention_working_bytes(fused, "cpu") == 12 * b * heads * s * s  # auto is xla on cpu
    # 1F1B with recompute keeps a ring of 2p - 1 stage inputs [b, s, D] whatever m; compute_dtype auto is bf16 on
    # a GPU target and fp32 on CPU. Without recompute it keeps 2p - 1 microbatches' layers instead.
    mesh = ["mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipeline=2", "model.remat=full"]
    pipe = _cfg([*mesh, "pipeline.microbatches=2", "pipeline.recompute=true"])
    assert activation_bytes(pipe, "gpu")["stage_inputs"] == 3 * (8 // 4 // 2) * s * d * 2
    assert activation_bytes(pipe, "cpu")["stage_inputs"] == 3 * (8 // 4 // 2) * s * d * 4
    kept = activation_bytes(_cfg([*mesh, "pipeline.microbatches=2"]), "gpu")
    assert kept["stage_inputs"] == 0 and kept["in_flight"] == 3
    assert kept["layers"] == 3 * activation_bytes(pipe, "gpu")["layers"]  # 2p - 1 microbatches instead of 1


def test_seed_exercise_numbers():
    ex = zero_exercise(13e9, 8, 24 * GB, "16p")
    assert [s["bytes"] / GB for s in ex["stages"]] == pytest.approx([208.0, 71.5, 48.75, 26.0], rel=1e-12)
    assert [s["expression"] for s in ex["stages"]] == [
        "DDP 16p: 16P",
        "ZeRO-1 16p: 4P + 12P/N",
        "ZeRO-2 16p: 2P + 14P/N",
        "ZeRO-3 16p: 16P/N",
    ]
    assert ex["smallest_devices_zero3"] == 9 and ex["zero3_bytes_at_smallest"] / GB == pytest.approx(208 / 9)
    cfg = load_config(LLAMA_13B, validate=False)
    acts = exercise_activations(cfg, ex)
    assert acts["n_params"] == 13_015_864_320  # Llama 2 13B
    s, h, a, layers = 4096, 5120, 40, 40
    assert acts["korthikanti_none"] == pytest.approx(layers * s * h * (34 + 5 * a * s / h))
    assert acts["korthikanti_full"] == 2 * s * h * layers
    # 16P/9 = 23.1 GB leaves 0.9 GB: model state + activations (remat full, ~2 GB) first fit at N = 10.
    assert 1.5 * GB < acts["jaxpar_activations"] < 2.5 * GB
    # model.attention auto is cuDNN's fused kernel on a GPU: no scores in memory. XLA's path would hold fp32
    # logits + grad and bf16 probabilities + grad of one layer.
    assert acts["attention_working_at_smallest"] == 0 and acts["attention"] == "cudnn"
    assert acts["attention_working_xla_at_smallest"] == 12 * a * s * s
    xla = exercise_activations(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="xla")), ex)
    assert xla["attention_working_at_smallest"] == 12 * a * s * s
    assert xla["fit_temp"] > acts["fit_temp"]
    assert acts["fit_state_acts"] == 10
    assert acts["fit_temp"] > acts["fit_state_acts"]
    assert acts["fit_temp_shardable"] >= acts["fit_temp"] and 5120 % acts["fit_temp_shardable"] == 0
    assert smallest_fitting_devices(cfg, 1 * GB, False, False, max_devices=64) is None  # activations alone > 1 GB


def test_cli_exercise(capsys):
    assert plan_cli.main(["--exercise-13b"]) == 0
    out = capsys.readouterr().out
    for needle in (
        "DDP     16P              208 GB",
        "ZeRO-1  4P + 12P/N      71.5 GB",
        "ZeRO-2  2P + 14P/N     48.75 GB",
        "ZeRO-3  16P/N             26 GB",
        "N = 9 (23.11 GB per device)",
        "no recomputation",
        "Smallest N for model state + jaxpar activations <= 24 GB: 10",
        "the backward keeps no attention scores; on XLA's attention path (model.attention xla) each layer's "
        "backward would also hold them, 12 bytes per score element: 8.053 GB",
    ):
        assert needle in out, needle
    assert plan_cli.main(["--exercise-13b", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["exercise"]["smallest_devices_zero3"] == 9


@pytest.mark.parametrize(
    "argv, needle",
    [
        ([TINY_YAML, "model.hidden=3"], "unknown config key model.hidden"),
        (
            [TINY_YAML, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "--devices", "16"],
            "= 8 but there are 16 devices; run on 8 devices (jaxpar-plan --devices 8",
        ),
        ([TINY_YAML, "mesh.data=1", "mesh.tensor=8"], "must be divisible by mesh.tensor=8"),
        (["configs/missing.yaml"], "does not exist"),
        ([TINY_YAML, "--devices", "0"], "--devices must be >= 1"),
        ([], "give a CONFIG file"),
    ],
)
def test_cli_bad_input(capsys, argv, needle):
    assert plan_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_cli_plans_64_devices_without_them():
    """--devices 64 in a process that has one CPU device: the analytic plan needs no devices."""
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="1", JAX_PLATFORMS="cpu")
    cmd = [
        sys.executable,
        "-m",
        "jaxpar.cli.plan",
        os.path.join(ROOT, "configs", "llama_7b.yaml"),
        "--devices",
        "64",
        "mesh.data=1",
        "mesh.fsdp=8",
        "mesh.tensor=8",
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True, timeout=300)
    p = json.loads(out.stdout)["plan"]
    assert p["devices"] == 64 and p["mesh"]["tensor"] == 8
    # ZeRO-3 (llama_1b.yaml) over data x fsdp = 8: 16 bytes per parameter of a tensor rank, / 8.
    assert p["memory"]["model_state"] == pytest.approx(16 * p["params"]["per_rank"] / 8)
    assert p["params"]["per_rank"] < p["params"]["total"] / 7  # tensor=8 splits all but the norms
    assert {"fsdp all-gather", "fsdp reduce-scatter", "tensor all-gather", "tensor reduce-scatter"} <= set(p["by_axis"])


# ---- planned vs compiled -------------------------------------------------------------------------------------

MESHES = {  # name -> overrides; those not in SLOW are in the default suite, the others run with -m slow
    "ddp_data8": ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "optimizer.zero_stage=0"],
    "zero1_d2f2t2_sp": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "optimizer.zero_stage=1"],
    # bf16 working parameters and compute: XLA:CPU widens every bf16 collective, so the plans for cpu and gpu
    # differ by 2x in the updated-parameter gather (ZeRO-1/2), the fsdp weight gathers and the tensor
    # activations, and with reduce_dtype bf16 (ZeRO-2 below) in the gradient reduce-scatters.
    "zero1_d2f2t2_16p": [
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "optimizer.zero_stage=1",
        "precision.layout=16p",
        "precision.compute_dtype=bfloat16",
    ],
    "zero2_d4f2_16p": [
        "mesh.data=4",
        "mesh.fsdp=2",
        "mesh.tensor=1",
        "optimizer.zero_stage=2",
        "precision.layout=16p",
        "precision.compute_dtype=bfloat16",
        "precision.reduce_dtype=bfloat16",
    ],
    "zero3_d4f2_16p": ["mesh.data=4", "mesh.fsdp=2", "mesh.tensor=1", "optimizer.zero_stage=3", "precision.layout=16p"],
    "zero1_d2f2p2_1f1b": [
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=1",
        "mesh.pipeline=2",
        "model.n_layers=4",
        "pipeline.microbatches=2",
        "optimizer.zero_stage=1",
    ],
    "zero2_f2t2p2_gpipe": [
        "mesh.data=1",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "mesh.pipeline=2",
        "model.n_layers=4",
        "pipeline.microbatches=2",
        "pipeline.schedule=gpipe",
        "optimizer.zero_stage=2",
        "tensor.sequence_parallel=false",
        "model.remat=full",
    ],
    # Context parallelism (jaxpar.analysis.planner.context), seq_len 8 = 2c x 2 and c x t x 2: ring attention with
    # tensor + sequence parallelism (the norm scales' gradients all-reduced over context and tensor in one op), and
    # K/V all-gathered over 4 context devices under ZeRO-3 over fsdp.
    "ring_c2_d2t2_sp": ["mesh.context=2", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=2", "context.strategy=ring"],
    "gather_c4_f2_zero3": [
        "mesh.context=4",
        "mesh.data=1",
        "mesh.fsdp=2",
        "mesh.tensor=1",
        "optimizer.zero_stage=3",
        "context.strategy=all_gather",
    ],
}
SLOW = {"zero3_d4f2_16p", "zero1_d2f2p2_1f1b", "zero2_f2t2p2_gpipe"}
_COMPILED: dict = {}


def _compiled(name, capsys) -> dict:
    """The CLI's --compile --json output for a mesh (compiled once per session, in this process)."""
    if name not in _COMPILED:
        assert plan_cli.main([TINY_YAML, *SMALL, *MESHES[name], "--devices", "8", "--compile", "--json", *FAST]) == 0
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


def _assert_rows_match(rows, overrides):
    """The collective bounds of the module docstring, for `compare_collectives` rows."""
    compiled = {r["key"] for r in rows if r["compiled_bytes"] > 0}
    planned = {r["key"] for r in rows if r["planned_bytes"] > 0}
    assert compiled == planned
    assert len(planned) >= 1 + ("tensor=2" in " ".join(overrides))
    total_c = sum(r["compiled_bytes"] for r in rows)
    total_p = sum(r["planned_bytes"] for r in rows)
    assert total_c == pytest.approx(total_p, rel=0.01)
    for r in rows:
        # Small tuple all-reduces can carry a few grad-norm scalars next to an array (a few bytes): 5%.
        assert r["compiled_bytes"] == pytest.approx(r["planned_bytes"], rel=0.05), r


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in MESHES])
def test_planned_collectives_equal_compiled(name, capsys):
    """The plan for cpu against the XLA:CPU executable (bf16 collectives widened to fp32 in both)."""
    out = _compiled(name, capsys)
    _assert_rows_match(out["compiled"]["collectives"], MESHES[name])
    # What is left unplanned is scalar all-reduces only.
    assert set(out["compiled"]["scalars"]["kinds"]) <= {"all-reduce"}


# The partitioned program still holds what the backends' generic simplifier later hoists or drops in pipeline
# layouts (loop-invariant gathers, unread shifts; jaxpar.analysis.planner.compiled), which the plan counts after that.
PARTITIONED = [n for n in MESHES if "mesh.pipeline=2" not in MESHES[n]]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in PARTITIONED])
def test_planned_collectives_for_gpu_equal_partitioned_program(name, capsys):
    """The plan for gpu against the partitioned program, the HLO every backend receives (bf16 stays bf16)."""
    out = _compiled(name, capsys)
    part = out["compiled"]["partitioned"]
    assert part["platform"] == "gpu" and part["compute_dtype"] == out["plan"]["compute_dtype"]
    _assert_rows_match(part["collectives"], MESHES[name])
    assert set(part["scalars"]["kinds"]) <= {"all-reduce"}
    program = {r["key"]: r["compiled_bytes"] for r in part["collectives"]}
    executable = {r["key"]: r["compiled_bytes"] for r in out["compiled"]["collectives"]}
    if "precision.layout=16p" not in MESHES[name]:  # fp32 throughout: XLA:CPU rewrites no collective's width
        assert program == pytest.approx(executable, rel=0.05)


@pytest.mark.parametrize("name", ["zero1_d2f2t2_16p", "zero2_d4f2_16p"])
def test_updated_parameters_are_gathered_in_bf16_before_the_cpu_backend(name, capsys):
    """16p ZeRO-1/2: the partitioner gathers the updated parameters over data in bf16, 2 bytes per parameter of
    the fsdp shard ((n-1)/n of it per device); XLA:CPU widens that gather to fp32. Counted from the model, not
    from the planner."""
    out = _compiled(name, capsys)
    cfg = _cfg(MESHES[name])
    n = cfg.mesh.data
    shard = _rank_params_from_specs(cfg) / cfg.mesh.fsdp
    program = {r["key"]: r for r in out["compiled"]["partitioned"]["collectives"]}["data all-gather"]
    executable = {r["key"]: r for r in out["compiled"]["collectives"]}["data all-gather"]
    assert program["compiled_bytes"] == pytest.approx(2 * shard * (n - 1) / n, rel=1e-9)
    assert executable["compiled_bytes"] == pytest.approx(4 * shard * (n - 1) / n, rel=1e-9)
    assert program["planned_bytes"] == program["compiled_bytes"]  # plan for gpu
    assert executable["planned_bytes"] == executable["compiled_bytes"]  # plan for cpu


@pytest.mark.slow
def test_cli_compile_in_a_fresh_process():
    """`jaxpar-plan CONFIG --compile` sets the CPU device count itself before jax starts."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    cmd = [
        sys.executable,
        "-m",
        "jaxpar.cli.plan",
        TINY_YAML,
        *SMALL,
        "mesh.data=1",
        "--devices",
        "4",
        "--compile",
        "--fast-compile",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True, timeout=600).stdout
    assert "data=1 pipeline=1 fsdp=2 context=1 tensor=2 (4 devices)" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("params + optimizer state"))
    assert line.split()[-1] == "1.0000"
    assert "XLA memory_analysis" in out and re.search(r"^  tensor +reduce-scatter +[\d,]+ ", out, re.MULTILINE)


def _gathered_updates(cfg, platform) -> float:
    (term,) = [t for t in collective_terms(cfg, platform) if t.name.startswith("updated parameters")]
    return term.size_bytes


def test_13b_zero1_16p_gathers_bf16_updates_on_gpu():
    """Llama 2 13B, 16p, ZeRO-1 over data=8: the updated parameters are gathered in bf16 on a GPU, 2 bytes per
    parameter (26.0 GB per step, S of the ring formula); only the plan for cpu counts 4 (XLA:CPU widens)."""
    cfg = resolve_config(
        load_config(LLAMA_13B, ["mesh.data=8", "mesh.fsdp=1", "optimizer.zero_stage=1"], validate=False), 8
    )
    p = sum(leaf.size for leaf in param_leaves(cfg.model))
    assert p == 13_015_864_320
    assert _gathered_updates(cfg, "gpu") == 2 * p == _gathered_updates(cfg, "tpu")
    assert _gathered_updates(cfg, "cpu") == 4 * p
    out = plan(cfg, "gpu")
    assert out["by_axis"]["data all-gather"] == pytest.approx(2 * p * 7 / 8)
    assert out["platform"] == "gpu" and "bf16 stays bf16" in out["collective_dtypes"]
    # The fp32 layout gathers fp32 on every platform.
    fp32 = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, layout="fp32"))
    assert _gathered_updates(fp32, "gpu") == _gathered_updates(fp32, "cpu") == 4 * p


def test_cpu_plan_widens_every_bf16_collective():
    """The plan for cpu is the plan for gpu with each bf16 collective counted at fp32 (XLA:CPU's
    AllReducePromotion and FloatNormalization); the fp32 cross-entropy statistics stay as they are."""
    cfg = _cfg(
        [
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            "precision.layout=16p",
            "precision.compute_dtype=bfloat16",
            "precision.reduce_dtype=bfloat16",
        ]
    )
    gpu, cpu = collective_terms(cfg, "gpu"), collective_terms(cfg, "cpu")
    assert [t.name.split(" (")[0] for t in gpu] == [t.name.split(" (")[0] for t in cpu]
    for g, c in zip(gpu, cpu):
        want = g.size_bytes if g.name == "cross-entropy statistics" else 2 * g.size_bytes
        assert c.size_bytes == want, (g, c)


def test_platform_is_checked_and_stated(capsys):
    cfg = _cfg(["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"])
    with pytest.raises(ValueError, match="'cuda' is not one of gpu, tpu, cpu"):
        plan(cfg, "cuda")
    assert (
        plan_cli.main(
            [
                TINY_YAML,
                *SMALL,
                "mesh.data=8",
                "mesh.fsdp=1",
                "mesh.tensor=1",
                "optimizer.zero_stage=1",
                "precision.layout=16p",
                "--platform",
                "cpu",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "planned for platform cpu: as XLA:CPU compiles them" in out
    assert "updated parameters (bf16, fp32 on cpu)" in out
    assert (
        plan_cli.main(
            [
                TINY_YAML,
                *SMALL,
                "mesh.data=8",
                "mesh.fsdp=1",
                "mesh.tensor=1",
                "optimizer.zero_stage=1",
                "precision.layout=16p",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)["plan"]
    assert data["platform"] == "gpu" and data["collective_dtypes"].startswith("collectives in the partitioned")


def test_plan_is_json_ready():
    p = plan(_cfg(["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]))
    assert json.loads(json.dumps(p))["mesh"] == {"data": 2, "pipeline": 1, "fsdp": 2, "context": 1, "tensor": 2}


# ---- context parallelism ---------------------------------------------------------------------------------------

RING = MESHES["ring_c2_d2t2_sp"]


def test_context_terms_by_hand():
    """The ring case counted from the model's shape, not from the planner's code: b = 8/2 = 4 rows, r = 8/2 = 4
    tokens per device, one key/value head of width 16 per tensor rank (kv = 4*4*1*16 elements, fp32 on cpu), L = 2.
    Per layer the forward permutes K and V once (c - 1 = 1), the backward again and the fp32 dK, dV sums twice
    (c = 2); positions and segment ids (int32 [4, 4]) once per step in the CPU executable, and in the partitioned
    program (the plan for gpu) once per forward pass and once per layer in the backward. With bf16 compute the
    K/V blocks halve on gpu, the fp32 sums do not."""
    cfg = _cfg([*RING, "precision.compute_dtype=float32"])  # fp32 on gpu too
    kv, ints, layers, c = 4 * 4 * 1 * 16 * 4, 4 * 4 * 4, 2, 2
    blocks = layers * (2 * (c - 1) * 2 * kv + 2 * c * kv)
    got = {p: plan(cfg, p)["by_axis"]["context collective-permute"] for p in ("cpu", "gpu")}
    assert got["cpu"] == blocks + 2 * (c - 1) * ints  # ring bytes of a permute: S
    assert got["gpu"] == blocks + 2 * (c - 1) * ints * (1 + layers)
    bf16 = plan(_cfg(RING), "gpu")["by_axis"]["context collective-permute"]
    assert bf16 == got["gpu"] - layers * 2 * (c - 1) * 2 * kv / 2
    # every per-token activation is r = 4 tokens (2 between blocks under sequence parallelism): the block input
    acts = activation_bytes(cfg, "cpu")
    context = {"size": 2, "strategy": "ring", "tokens_per_device": 4, "tokens_between_blocks": 2}
    assert plan(cfg, "cpu")["context_parallel"] == context
    assert acts["formula"].endswith("(b=4, s=8, r=s/c=4, s'=2)")
    # remat none saves every step's fp32 scores and their masks: 5 bytes per element of [b, H/t, r, s] = [4, 2, 4, 8]
    per_layer = {k: v for k, v in _layer_terms(cfg).items() if "scores" in k or "masks" in k}
    assert sum(per_layer.values()) == 5 * 4 * 2 * 4 * 8
    # the batch: 3 arrays of [4 rows, 8 tokens] all-gathered (4 bytes per token), half of each sent
    (batch,) = [t for t in collective_terms(cfg, "cpu") if t.name.startswith("batch arrays")]
    assert (batch.count, batch.size_bytes, batch.bytes) == (3, 3 * 4 * 8 * 4, 3 * 4 * 8 * 4 / 2)


def _layer_terms(cfg) -> dict:
    from jaxpar.analysis.planner.dims import dims
    from jaxpar.analysis.planner.plan import _layer_bytes

    return _layer_bytes(cfg, dims(cfg, "cpu"), "cpu")


def test_context_positions_are_hoisted_by_the_cpu_backend(capsys):
    """The partitioned program permutes the int32 positions and segment ids (packed as one [4, 4, 2] array) again in
    each layer's backward (2 layers, c - 1 = 1 step: 2 permutes of 128 B); XLA:CPU moves them out of the loops and
    merges them with the forward's. The plans for gpu and cpu count each program as it is, op for op."""
    out = _compiled("ring_c2_d2t2_sp", capsys)
    executable = {r["key"]: r for r in out["compiled"]["collectives"]}["context collective-permute"]
    program = {r["key"]: r for r in out["compiled"]["partitioned"]["collectives"]}["context collective-permute"]
    assert program["compiled_bytes"] - executable["compiled_bytes"] == 2 * 128
    assert program["compiled_count"] - executable["compiled_count"] == 2
    for row in (executable, program):
        assert (row["compiled_bytes"], row["compiled_count"]) == (row["planned_bytes"], row["planned_count"])


def test_context_gradients_are_reduced_over_context(capsys):
    """ZeRO-3 over fsdp = 2 and context = 4: every gradient, as stored (1/2 of it), is all-reduced over context
    once per step, 2(c-1)/c of it sent; the K/V all-gathers and dK/dV reduce-scatters match op for op."""
    out = _compiled("gather_c4_f2_zero3", capsys)
    cfg = _cfg(MESHES["gather_c4_f2_zero3"])
    shard = sum(leaf.size for leaf in param_leaves(cfg.model)) / 2 * 4  # fp32
    rows = {r["key"]: r for r in out["compiled"]["partitioned"]["collectives"]}
    assert rows["context all-reduce"]["compiled_bytes"] == pytest.approx(2 * 3 / 4 * shard, rel=1e-12)
    for key in ("context all-gather", "context reduce-scatter"):
        assert rows[key]["compiled_count"] == rows[key]["planned_count"], rows[key]


def test_cli_shows_the_context_slice_and_rows(capsys):
    """`jaxpar-plan` text: the per-device sequence slice and the context rows (planned, no compile)."""
    assert plan_cli.main([TINY_YAML, *SMALL, *RING, "--devices", "8"]) == 0
    out = capsys.readouterr().out
    assert "context parallel c=2 (ring): each device holds r = s/c = 4 tokens of every sequence" in out
    assert "2 between blocks (sequence parallel)" in out
    rows = {tuple(line.split()[:2]) for line in out.splitlines() if line.startswith("  context")}
    assert {("context", "all-gather"), ("context", "all-reduce"), ("context", "collective-permute")} <= rows
    assert ("context,tensor", "all-reduce") in rows  # the norm scales' gradients, over both axes in one op
