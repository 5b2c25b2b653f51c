"""One train step on each (mesh layout, ZeRO stage) equals the single-device step.

Meshes on 8 simulated CPU devices: data=8 (pure data parallel), fsdp=8, data=2 x fsdp=4 and data=4 x fsdp=2,
each with ZeRO stages 0-3: 16 layouts against one single-device reference. Compared in fp32 at 1e-5 relative:
loss, grad norm, the gradients of `make_grad_fn`, Adam's first moment (the clipped gradient the optimizer saw)
and second moment, the updated parameters and the update itself (to within one ulp of the parameter, see
`step_helpers.assert_adam_step_close`, which carries the gradients' tolerance through Adam's conditioning).
Clipping is active on two of the meshes. Adam runs with its default eps, without warmup.

Each test first asserts that its layout really differs from the reference's: the axis under test has more
than one device, and parameters, gradients, optimizer state and the batch are split exactly as the ZeRO stage
says (`jaxpar.parallel.sharding`).

Shape letters: G global batch, T sequence length, L layers, D model width, F mlp hidden width.
"""

import jax
import pytest
from optax import tree_utils as otu
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
    spec_axes,
    to_host,
)

from jaxpar.training.state import init_state

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

RTOL = FP32_RTOL  # fp32 whole-model parity: reordered sums (step_helpers.FP32_RTOL says why)
SEED = 3
T = 8
# 16 rows (2 per device on 8 devices) with uneven valid-token counts, one row fully masked.
VALID = (8, 3, 8, 0, 5, 8, 1, 8, 8, 7, 2, 8, 8, 4, 8, 6)
G = len(VALID)
MESHES = {"data8": (8, 1), "fsdp8": (1, 8), "data2_fsdp4": (2, 4), "data4_fsdp2": (4, 2)}  # (data, fsdp)
CLIP_NORM = 0.05  # well below this model's initial gradient norm (~1.5)
CLIPPED_MESHES = ("data8", "data2_fsdp4")


def _overrides(data: int, fsdp: int, zero: int, clipped: bool) -> list[str]:
    clip = CLIP_NORM if clipped else 0  # 0 disables clipping: both optimizer chains get exercised
    return [
        *FP32,
        *FIRST_STEP_AT_PEAK,
        f"optimizer.grad_clip_norm={clip}",
        f"optimizer.zero_stage={zero}",
        f"mesh.data={data}",
        f"mesh.fsdp={fsdp}",
        f"train.global_batch_size={G}",
    ]


def _w_up(tree):
    return tree["blocks"]["mlp"]["w_up"]  # [L, D, F]: sharded along D (embed)


@pytest.fixture(scope="module")
def reference():
    """Single-device results and initial state per clipping setting, computed once each."""
    cache = {}

    def get(clipped: bool) -> dict:
        if clipped not in cache:
            plan = make_plan(_overrides(1, 1, 0, clipped), jax.devices()[:1])
            state = init_state(plan, SEED)
            host_state = to_host(state)
            batch = device_batch(plan, host_batch(VALID, T, SEED))
            cache[clipped] = dict(one_adam_step(plan, state, batch), host_state=host_state)
        return cache[clipped]

    return get


# Every ZeRO stage and every mesh runs by default; the other 11 pairs run under `-m slow` (suite time budget).
DEFAULT_PAIRS = {("data8", 0), ("data8", 1), ("data2_fsdp4", 2), ("data4_fsdp2", 3), ("fsdp8", 3)}
PAIRS = [
    pytest.param(m, z, id=f"{m}-{z}", marks=() if (m, z) in DEFAULT_PAIRS else pytest.mark.slow)
    for m in MESHES
    for z in (0, 1, 2, 3)
]


@pytest.mark.parametrize("mesh_name,zero", PAIRS)
def test_one_step_equals_single_device(mesh_name, zero, reference, need_devices):
    need_devices(8)
    data, fsdp = MESHES[mesh_name]
    clipped = mesh_name in CLIPPED_MESHES
    ref = reference(clipped)
    plan = make_plan(_overrides(data, fsdp, zero, clipped), jax.devices()[:8])

    # The layout under test. Parameters are identical for every layout (tests/parity/test_init.py), so the
    # reference's initial state is placed onto this layout's shardings instead of compiling init again.
    state = jax.device_put(ref["host_state"], plan.state_shardings)
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    w, mu = _w_up(state["params"]), _w_up(otu.tree_get(state["opt_state"], "mu"))
    L, D, F = w.shape
    for axis, size in (("data", data), ("fsdp", fsdp)):
        assert plan.mesh.shape[axis] == size
    assert plan.mesh.shape["data"] * plan.mesh.shape["fsdp"] == 8 and max(data, fsdp) > 1
    assert shard_shape(batch["inputs"]) == (G // 8, T)  # the reference holds all G rows on one device
    params_over = fsdp * (data if zero == 3 else 1)
    opt_over = fsdp * (data if zero >= 1 else 1)
    if data > 1:  # ZeRO partitions over `data`; with data = 1 every stage has the same layout
        assert ("data" in spec_axes(w.sharding)) == (zero == 3)
        assert ("data" in spec_axes(mu.sharding)) == (zero >= 1)
    assert shard_shape(w) == (L, D // params_over, F) and shard_shape(mu) == (L, D // opt_over, F)
    assert len(w.sharding.device_set) == 8
    if params_over == 1:  # data=8 below ZeRO-3: plain data parallelism, parameters replicated on 8 devices
        assert w.sharding.is_fully_replicated
    else:
        assert shard_shape(w) != w.shape
    if zero in (1, 2) and data > 1:
        assert shard_shape(mu) != shard_shape(w)  # optimizer state split further than parameters

    out = one_adam_step(plan, state, batch)
    grads_over = fsdp * (data if zero >= 2 else 1)
    if data > 1:
        assert ("data" in spec_axes(_w_up(out["grads_shardings"]))) == (zero >= 2)
    assert tuple(_w_up(out["grads_shardings"]).shard_shape(w.shape)) == (L, D // grads_over, F)
    # No sharding drift across the step (the jit cache key includes input shardings).
    new = out["new_state"]
    assert _w_up(new["params"]).sharding == w.sharding
    assert _w_up(otu.tree_get(new["opt_state"], "mu")).sharding == mu.sharding

    m, ref_m = out["metrics"], ref["metrics"]
    assert m["tokens"] == ref_m["tokens"] == out["grad_tokens"] == sum(VALID)
    assert m["learning_rate"] == ref_m["learning_rate"] > 0
    assert_scalar_close(m["loss"], ref_m["loss"], RTOL, "loss")
    assert_scalar_close(out["grad_loss"], ref_m["loss"], RTOL, "grad_fn loss")
    assert_scalar_close(m["grad_norm"], ref_m["grad_norm"], RTOL, "grad_norm")
    if clipped:
        assert ref_m["grad_norm"] > 2 * CLIP_NORM and m["grad_norm"] > 2 * CLIP_NORM
    assert_tree_close(out["grads"], ref["grads"], RTOL)
    assert_adam_step_close(out, ref, out["params0"], RTOL, **adam_step_args(plan, m))
