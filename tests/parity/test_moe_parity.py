"""Mixture of experts: one train step on data x fsdp (ZeRO-1 and ZeRO-3) and on tensor=2 equals the single-device
step, for dropless and capacity routing.

Model: tiny (step_helpers.TINY) with two blocks as one MoE group (model.moe.every=2: a dense block, then an MoE
block of E=4 experts, top-2, one shared expert). Every layout also splits its rows into two accumulation
microbatches, the reference into none. Compared in fp32 at step_helpers.FP32_RTOL: the loss (cross-entropy plus
the weighted auxiliary losses), the MoE metrics (load-balancing and z-loss, dropped fraction, expert load),
the gradients (router included), Adam's moments and the updated parameters. Capacity routing runs with
capacity_factor 0.5, so experts overflow and assignments drop; the dropped count and every gradient equal the
single device's, so the same assignments dropped (which ones drop is checked directly in tests/unit/test_moe.py).

Each test asserts its layout really differs from the reference's (expert weights and router split as the ZeRO
stage and tensor size say) and that the check can fail (`test_the_comparison_can_fail`).
"""

import jax
import numpy as np
import pytest
from step_helpers import (
    FIRST_STEP_AT_PEAK,
    FP32,
    FP32_RTOL,
    adam_step_args,
    assert_adam_step_close,
    assert_scalar_close,
    assert_tree_close,
    device_batch,
    host_batch,
    make_plan,
    one_adam_step,
    shard_shape,
    to_host,
)

from jaxpar.training.state import init_state
from jaxpar.training.step import make_grad_fn

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

RTOL = FP32_RTOL
SEED = 3
T = 8
VALID = (8, 3, 8, 0, 5, 8, 1, 8, 8, 7, 2, 8, 8, 4, 8, 6)
G = len(VALID)
E, K = 4, 2
MOE = (
    f"model.moe.num_experts={E}",
    f"model.moe.top_k={K}",
    "model.moe.shared_experts=1",
    "model.moe.every=2",
    "model.moe.capacity_factor=0.5",
    "model.moe.aux_loss_weight=0.1",
    "model.moe.z_loss_weight=0.01",
)
LAYOUTS = {  # (data, fsdp, tensor, zero_stage, sequence_parallel)
    "data2_fsdp4_zero1": (2, 4, 1, 1, False),
    "data4_fsdp2_zero3": (4, 2, 1, 3, False),
    "data2_fsdp2_tensor2_zero1": (2, 2, 2, 1, False),
    "data2_fsdp2_tensor2_sp_zero1": (2, 2, 2, 1, True),
}
METRICS = ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "moe_load_max_mean")


def _overrides(
    routing: str, data: int, fsdp: int, tensor: int, zero: int, accum: int, extra=(), sp: bool = False
) -> list[str]:
    return [
        f"tensor.sequence_parallel={str(sp).lower()}",
        *FP32,
        *FIRST_STEP_AT_PEAK,
        *MOE,
        f"model.moe.routing={routing}",
        f"optimizer.zero_stage={zero}",
        f"mesh.data={data}",
        f"mesh.fsdp={fsdp}",
        f"mesh.tensor={tensor}",
        f"train.global_batch_size={G}",
        f"train.grad_accum_steps={accum}",
        *extra,
    ]


def _experts(tree):
    return tree["blocks"]["moe"]["mlp"]  # w_up [U, E, D, F], router [U, D, E]


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(routing: str, extra=()) -> dict:
        key = (routing, tuple(extra))
        if key not in cache:
            plan = make_plan(_overrides(routing, 1, 1, 1, 0, 1, extra), jax.devices()[:1])
            state = init_state(plan, SEED)
            host_state = to_host(state)
            batch = device_batch(plan, host_batch(VALID, T, SEED))
            cache[key] = dict(one_adam_step(plan, state, batch), host_state=host_state, plan=plan)
        return cache[key]

    return get


# All eight under `-m slow` (default-suite budget: each case compiles two steps); the default suite's MoE layouts
# are the expert-parallel cases below (dropless over fsdp, capacity with tensor and sequence parallelism).
DEFAULT_CASES: set[tuple[str, str]] = set()
CASES = [
    pytest.param(
        layout, routing, id=f"{layout}-{routing}", marks=() if (layout, routing) in DEFAULT_CASES else pytest.mark.slow
    )
    for layout in LAYOUTS
    for routing in ("dropless", "capacity")
]


@pytest.mark.parametrize("layout,routing", CASES)
def test_one_step_equals_single_device(layout, routing, reference, devices8):
    data, fsdp, tensor, zero, sp = LAYOUTS[layout]
    ref = reference(routing)
    plan = make_plan(_overrides(routing, data, fsdp, tensor, zero, 2, sp=sp), devices8)
    state = jax.device_put(ref["host_state"], plan.state_shardings)
    batch = device_batch(plan, host_batch(VALID, T, SEED))

    # The layout differs from the reference's: rows over data x fsdp, experts' D over fsdp (and data at ZeRO-3),
    # their hidden width over tensor, the router's D over fsdp.
    w_up, router = _experts(state["params"])["w_up"], _experts(state["params"])["router"]
    U, e, D, F = w_up.shape
    assert (U, e) == (1, E)
    params_over = fsdp * (data if zero == 3 else 1)
    assert shard_shape(w_up) == (U, E, D // params_over, F // tensor)
    assert shard_shape(router) == (U, D // params_over, E)
    assert shard_shape(batch["inputs"]) == (G // (data * fsdp), T)
    assert plan.tensor_parallel.sequence_parallel == sp  # the router scores each rank's slice of the sequence

    out = one_adam_step(plan, state, batch)
    m, ref_m = out["metrics"], ref["metrics"]
    assert m["tokens"] == ref_m["tokens"] == sum(VALID)
    for name in METRICS:
        assert_scalar_close(m[name], ref_m[name], RTOL, name)
    assert_scalar_close(out["grad_loss"], ref_m["loss"], RTOL, "grad_fn loss")
    if routing == "capacity":
        assert ref_m["moe_dropped_fraction"] > 0.2  # the batch overflows capacity
    else:
        assert ref_m["moe_dropped_fraction"] == 0
    assert np.abs(_experts(ref["grads"])["router"]).max() > 0
    assert_tree_close(out["grads"], ref["grads"], RTOL)
    assert_adam_step_close(out, ref, out["params0"], RTOL, **adam_step_args(plan, m))


# Expert parallelism: (data, fsdp, tensor, zero_stage, expert_axes, experts E). E = 8 so that ep = 4 leaves two
# experts per device (grouping by local expert is exercised) and ep = 2 four.
EP_LAYOUTS = {  # (data, fsdp, tensor, zero_stage, expert_axes, E, sequence_parallel)
    "ep4_fsdp_data2_zero1": (2, 4, 1, 1, ("fsdp",), 8, False),
    "ep2_data_fsdp2_tensor2_sp_zero1": (2, 2, 2, 1, ("data",), 8, True),
    "ep4_data_fsdp_tensor2_zero3": (2, 2, 2, 3, ("data", "fsdp"), 8, False),
    "ep2_data_fsdp4_zero2": (2, 4, 1, 2, ("data",), 8, False),
}
DEFAULT_EP_CASES = {("ep4_fsdp_data2_zero1", "dropless"), ("ep2_data_fsdp2_tensor2_sp_zero1", "capacity")}
EP_CASES = [
    pytest.param(
        layout,
        routing,
        id=f"{layout}-{routing}",
        marks=() if (layout, routing) in DEFAULT_EP_CASES else pytest.mark.slow,
    )
    for layout in EP_LAYOUTS
    for routing in ("dropless", "capacity")
]


@pytest.mark.parametrize("layout,routing", EP_CASES)
def test_expert_parallel_step_equals_single_device(layout, routing, reference, devices8):
    """Experts split over data and/or fsdp, assignments moved by all-to-all: the same step as one device."""
    data, fsdp, tensor, zero, axes, e, sp = EP_LAYOUTS[layout]
    experts = (f"model.moe.num_experts={e}",)
    ref = reference(routing, experts)
    extra = (*experts, f"model.moe.expert_axes=[{','.join(axes)}]")
    plan = make_plan(_overrides(routing, data, fsdp, tensor, zero, 2, extra, sp), devices8)
    state = jax.device_put(ref["host_state"], plan.state_shardings)
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    assert plan.tensor_parallel.sequence_parallel == sp

    # The layout differs: each device holds E / ep whole experts (their D no longer split over the expert
    # axes), the router whole over experts; the all-to-alls are in the compiled step.
    ep = (data if "data" in axes else 1) * (fsdp if "fsdp" in axes else 1)
    assert plan.expert_axes == tuple(a for a in ("data", "fsdp") if a in axes)
    w_up, router = _experts(state["params"])["w_up"], _experts(state["params"])["router"]
    U, _, D, F = w_up.shape
    d_split = (fsdp if "fsdp" not in axes else 1) * (data if zero == 3 and "data" not in axes else 1)
    assert shard_shape(w_up) == (U, e // ep, D // d_split, F // tensor)
    assert shard_shape(router)[-1] == e
    hlo = jax.jit(make_grad_fn(plan)).lower(state["params"], batch).as_text()
    assert "all_to_all" in hlo or "all-to-all" in hlo

    out = one_adam_step(plan, state, batch)
    m, ref_m = out["metrics"], ref["metrics"]
    assert m["tokens"] == ref_m["tokens"] == sum(VALID)
    for name in METRICS:
        assert_scalar_close(m[name], ref_m[name], RTOL, name)
    if routing == "capacity":
        assert ref_m["moe_dropped_fraction"] > 0.2  # the batch overflows capacity: the same assignments drop
    assert_tree_close(out["grads"], ref["grads"], RTOL)
    assert_adam_step_close(out, ref, out["params0"], RTOL, **adam_step_args(plan, m))


@pytest.mark.slow  # two more single-device compiles (default-suite budget)
def test_the_comparison_can_fail(reference):
    """A different capacity drops other assignments: its gradients fail the comparison above."""
    ref = reference("capacity")
    other = reference("capacity", ("model.moe.capacity_factor=0.75",))
    assert other["metrics"]["moe_dropped_fraction"] < ref["metrics"]["moe_dropped_fraction"]
    with pytest.raises(AssertionError):
        assert_tree_close(other["grads"], ref["grads"], RTOL)


@pytest.mark.slow  # two more single-device compiles (default-suite budget)
def test_aux_losses_enter_the_loss_with_their_weights(reference):
    """Same parameters and batch, auxiliary weights 0: the loss drops by exactly the weighted auxiliary terms,
    summed over the MoE blocks (one here), and the router's gradient changes."""
    ref = reference("dropless")
    off = reference("dropless", ("model.moe.aux_loss_weight=0", "model.moe.z_loss_weight=0"))
    m = ref["metrics"]
    terms = 0.1 * m["moe_aux_loss"] + 0.01 * m["moe_z_loss"]
    assert terms > 1e-3
    assert_scalar_close(m["loss"] - terms, off["metrics"]["loss"], RTOL, "loss without the auxiliary terms")
    with pytest.raises(AssertionError):
        assert_tree_close(_experts(off["grads"])["router"], _experts(ref["grads"])["router"], RTOL)


def test_pipeline_stages_are_accepted(devices8):
    """MoE runs inside pipeline stages (tests/parity/test_moe_pipeline.py compares the step) once every stage
    holds whole MoE units: here 2 units of `every`=2 blocks over 2 stages."""
    pipeline = ("mesh.pipeline=2", "mesh.fsdp=1", "mesh.data=4", "model.n_layers=4")
    plan = make_plan([*_overrides("dropless", 2, 2, 1, 1, 1), *pipeline], devices8)
    assert plan.mesh.shape["pipeline"] == 2 and plan.cfg.model.stack_depth == 2
