"""Model-state bytes per device: the ZeRO formula by hand, and the formula against XLA's compiled step."""

import jax
import numpy as np
import pytest

from jaxpar.analysis.hlo.compile_options import COMPILER_OPTIONS
from jaxpar.analysis.planner.memory import (
    format_memory_table,
    formula_expression,
    measured_state_bytes,
    memory_table,
    state_bytes_formula,
)
from jaxpar.config import load_config
from jaxpar.data.batch import abstract_batch
from jaxpar.model.flops import param_count
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.plan import build_plan
from jaxpar.training.state import init_state

GB = 1e9
SMALL = ["model.n_layers=2", "model.d_model=128", "data.seq_len=16", "train.global_batch_size=8"]


# The ZeRO paper's exercise (section 3.1): a 13B model at N=8, 16p layout (2 + 2 + 12 bytes per parameter).
@pytest.mark.parametrize("zero,expected_gb", [(0, 208.0), (1, 71.5), (2, 48.75), (3, 26.0)])
def test_formula_13b_16p(zero, expected_gb):
    out = state_bytes_formula(13e9, "16p", zero, data=8, fsdp=1)
    assert out["total"] / GB == pytest.approx(expected_gb, rel=1e-12)
    assert out["total"] == pytest.approx(out["params"] + out["grads"] + out["opt_state"], rel=1e-12)


def test_formula_13b_fp32_and_kinds():
    p, n = 13e9, 8
    totals = [state_bytes_formula(p, "fp32", z, n, 1)["total"] for z in range(4)]
    assert totals == pytest.approx([16 * p, 8 * p + 8 * p / n, 4 * p + 12 * p / n, 16 * p / n], rel=1e-12)
    z1 = state_bytes_formula(p, "16p", 1, n, 1)
    assert (z1["params"], z1["grads"], z1["opt_state"]) == pytest.approx((2 * p, 2 * p, 12 * p / n), rel=1e-12)


def test_formula_fsdp_divides_every_kind():
    base = state_bytes_formula(1000, "16p", 1, data=2, fsdp=1)
    split = state_bytes_formula(1000, "16p", 1, data=2, fsdp=4)
    for kind in ("params", "grads", "opt_state", "total"):
        assert split[kind] == pytest.approx(base[kind] / 4, rel=1e-12)


def test_smallest_n_for_zero3_13b_in_24gb():
    n = next(n for n in range(1, 64) if state_bytes_formula(13e9, "16p", 3, n, 1)["total"] <= 24 * GB)
    assert n == 9  # 208 GB / 9 = 23.1 GB; / 8 = 26 GB


def test_formula_expression_and_errors():
    assert formula_expression("fp32", 2) == "ZeRO-2 fp32: 4P + 12P/N"
    assert formula_expression("16p", 1) == "ZeRO-1 16p: 4P + 12P/N"
    assert formula_expression("16p", 0) == "DDP 16p: 16P"
    assert formula_expression("fp32", 3, fsdp=2) == "ZeRO-3 fp32: (16P/N)/F"
    with pytest.raises(ValueError, match="layout"):
        state_bytes_formula(10, "fp16", 0, 1, 1)
    with pytest.raises(ValueError, match="zero_stage"):
        state_bytes_formula(10, "fp32", 4, 1, 1)


_MEASURED: dict = {}


def _plan_state_batch(zero: int, layout: str, data: int = 8, fsdp: int = 1):
    overrides = SMALL + [
        "mesh.tensor=1",
        f"mesh.data={data}",
        f"mesh.fsdp={fsdp}",
        f"optimizer.zero_stage={zero}",
        f"precision.layout={layout}",
    ]
    cfg = load_config("configs/tiny.yaml", overrides, num_devices=8)
    plan = build_plan(cfg, build_mesh(cfg))
    state = jax.eval_shape(lambda: init_state(plan, 0))  # abstract: only compiled, never run
    batch = abstract_batch(cfg.train.global_batch_size, cfg.data.seq_len, plan.batch_sharding)
    return plan, state, batch


def _measure(zero: int, layout: str, data: int = 8, fsdp: int = 1):
    """(plan, state, batch, measured_state_bytes), each case compiled once per test session."""
    key = (zero, layout, data, fsdp)
    if key not in _MEASURED:
        plan, state, batch = _plan_state_batch(*key)
        _MEASURED[key] = (plan, state, batch, measured_state_bytes(plan, state, batch, COMPILER_OPTIONS))
    return _MEASURED[key]


# fp32 at every ZeRO stage on data=8; 16p ZeRO-1 on data=8 and ZeRO-3 on data=4 x fsdp=2 (the F divisor).
# Three of them run under `-m slow` only, to keep the default suite within its time budget.
CASES = [
    pytest.param(0, "fp32", 8, 1, marks=pytest.mark.slow),
    (1, "fp32", 8, 1),
    pytest.param(2, "fp32", 8, 1, marks=pytest.mark.slow),
    (3, "fp32", 8, 1),
    pytest.param(1, "16p", 8, 1, marks=pytest.mark.slow),
    (3, "16p", 4, 2),
]


@pytest.mark.parametrize("zero,layout,data,fsdp", CASES)
def test_measured_state_matches_formula(zero, layout, data, fsdp):
    plan, state, batch, measured = _measure(zero, layout, data, fsdp)
    assert dict(plan.mesh.shape)["data"] == data and dict(plan.mesh.shape)["fsdp"] == fsdp
    formula = state_bytes_formula(param_count(state["params"]), layout, zero, data=data, fsdp=fsdp)

    # Persistent state (step arguments minus the batch, from memory_analysis): params + opt_state, plus the
    # 0-d leaves (step and optax counts) that the formula does not count.
    persistent = measured["persistent"] - measured["scalars"]
    assert persistent == pytest.approx(formula["params"] + formula["opt_state"], rel=0.01)
    # int32 step, schedule count, Adam count; apply_if_finite: int32 bad-step counts (2) and a bool
    assert measured["scalars"] == 3 * 4 + 2 * 4 + 1
    assert measured["params"] == pytest.approx(formula["params"], rel=0.01)
    assert measured["opt_state"] == pytest.approx(formula["opt_state"], rel=0.01)
    # Gradients (grad function outputs, from memory_analysis).
    assert measured["grads"] == pytest.approx(formula["grads"], rel=0.01)
    assert measured["total"] == pytest.approx(formula["total"], rel=0.01)
    assert measured["temp"] > 0


def test_memory_analysis_is_per_device():
    # ZeRO-3 on data=8: every kind is 1/8 of its global size, so XLA reports the per-device module.
    _, state, _, measured = _measure(3, "fp32")
    global_params = 4 * param_count(state["params"])
    assert measured["params"] * 8 == global_params
    assert measured["grads"] * 8 == global_params
    assert (measured["persistent"] - measured["scalars"]) * 8 == 3 * global_params


@pytest.mark.slow  # compiles a step per ZeRO stage (about 5 s on 2 cores)
def test_memory_table_format():
    plan, state, batch, measured = _measure(2, "fp32")
    rows = memory_table(plan, state, batch, measured=measured)
    assert [r["kind"] for r in rows] == ["params", "grads", "opt_state", "total", "scalars", "temp"]
    assert [r["formula"] for r in rows[:4]] == ["4P", "4P/N", "8P/N", "4P + 12P/N"]
    assert rows[3]["ratio"] == pytest.approx(1.0, rel=0.01)
    assert rows[4]["formula_bytes"] is None and rows[4]["measured_bytes"] == 21
    text = format_memory_table(rows)
    assert text.splitlines()[0].startswith("ZeRO-2 fp32: 4P + 12P/N")
    assert len(text.splitlines()) == 2 + len(rows)


def test_packed_documents_segment_ids_are_batch_not_optimizer_state():
    """With document masking the step also takes segment_ids int32 [G, T]: they are batch, subtracted with it,
    so opt_state measures the same as without them (it once grew by their bytes: 2,048 per device in tiny.yaml)."""
    plan, state, batch, plain = _measure(1, "fp32")
    packed = {**batch, "segment_ids": jax.device_put(np.ones(batch["inputs"].shape, np.int32), plan.batch_sharding)}
    measured = measured_state_bytes(plan, state, packed, COMPILER_OPTIONS)
    assert measured["opt_state"] == plain["opt_state"] and measured["params"] == plain["params"]
    assert measured["persistent"] == plain["persistent"]


@pytest.mark.parametrize(
    "expert_axes,zero,data,fsdp",
    # under -m slow (suite time budget): the tiny_moe run logs the same table at start
    [pytest.param("[data]", 1, 4, 2, marks=pytest.mark.slow), pytest.param("[fsdp]", 3, 2, 4, marks=pytest.mark.slow)],
)
def test_expert_parallel_state_matches_formula(expert_axes, zero, data, fsdp):
    """With experts split over an axis (model.moe.expert_axes) the compiled step's state equals the formula
    with the experts' P_e divided only by the storage axes that are not expert axes (`memory_table` rows)."""
    overrides = SMALL + [
        "mesh.tensor=1",
        f"mesh.data={data}",
        f"mesh.fsdp={fsdp}",
        f"optimizer.zero_stage={zero}",
        "model.moe.num_experts=8",
        "model.moe.every=2",
        f"model.moe.expert_axes={expert_axes}",
    ]
    cfg = load_config("configs/tiny.yaml", overrides, num_devices=8)
    plan = build_plan(cfg, build_mesh(cfg))
    state = jax.eval_shape(lambda: init_state(plan, 0))
    batch = abstract_batch(cfg.train.global_batch_size, cfg.data.seq_len, plan.batch_sharding)
    rows = {r["kind"]: r for r in memory_table(plan, state, batch, compiler_options=COMPILER_OPTIONS)}
    # The layout differs from the dense one: the experts' leading dimension is split over the expert axis.
    axis = expert_axes.strip("[]")
    assert plan.specs["params"]["blocks"]["moe"]["mlp"]["w_up"][1] == axis
    for kind in ("params", "grads", "opt_state", "total"):
        assert rows[kind]["ratio"] == pytest.approx(1.0, abs=1e-3), kind
