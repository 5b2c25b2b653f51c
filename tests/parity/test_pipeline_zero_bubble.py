"""Zero-bubble pipeline schedules (pipeline.schedule zb-h1 and zb-v, `jaxpar.parallel.pipeline_zb`): one train
step equals the single-device step.

Model: tiny with L = 8 layers (so zb-v's 2p chunks split the stack at p = 4), d_model 64, T 8, fp32; one global
batch of G = 48 rows with uneven valid-token counts (three rows fully masked). One single-device reference serves
every case. Compared as tests/parity/test_pipeline.py does, at step_helpers.FP32_RTOL: loss, grad norm, Adam's
moments and the update (clipping off, so the first moment is (1 - b1) x the gradient).

Cases (p stages, m microbatches, the other axes):
  * zb-h1, p = 2, m = 4; p = 4, m = 3 (m < p); interleaved (virtual_stages 2), p = 2, m = 4, on data 2 x fsdp 2
    with ZeRO-3 (weights gathered in every F, B and W; B's boundary holds gathered values);
  * zb-v, p = 4, m = 6 (any m, here not a multiple of p); p = 2, m = 4 on fsdp 2 x tensor 2 with sequence
    parallelism (ZeRO-1);
  * under -m slow: zb-v with pipeline.recompute inside gradient accumulation on data 2 (ZeRO-2), zb-h1 with
    ZeRO-0 on data 2 x fsdp 2, and zb-h1 on tensor 2 without sequence parallelism.
MoE stages and packed documents under zero-bubble schedules are in tests/parity/test_moe_pipeline.py and
tests/parity/test_document_masking.py.

Each case asserts its layout differs from the reference's: the blocks are split over `pipeline` along the layer
dimension.
"""

import jax
import pytest
from step_helpers import (
    CONFIG,
    FIRST_STEP_AT_PEAK,
    FP32,
    FP32_RTOL,
    TINY,
    assert_step_equals,
    compile_fast,
    device_batch,
    host_batch,
    make_plan,
    mesh_devices,
    shard_shape,
    stepped,
    to_host,
)

from jaxpar.config import ConfigError, load_config
from jaxpar.training.state import init_state
from jaxpar.training.step import make_train_step

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

RTOL = FP32_RTOL
SEED = 5
T = 8
L = 8
VALID = (8, 3, 8, 0, 5, 8, 1, 8, 8, 7, 2, 8, 8, 4, 8, 6) * 3
G = len(VALID)
ZBV = ("pipeline.schedule=zb-v", "pipeline.virtual_stages=2")
CASES = {
    "zbh1_p2_m4": ("mesh.pipeline=2", "pipeline.schedule=zb-h1", "pipeline.microbatches=4"),
    "zbh1_p4_m3": ("mesh.pipeline=4", "pipeline.schedule=zb-h1", "pipeline.microbatches=3"),
    "zbh1_v2_p2_m4_data2_fsdp2_zero3": (
        "mesh.pipeline=2",
        "mesh.data=2",
        "mesh.fsdp=2",
        "optimizer.zero_stage=3",
        "pipeline.schedule=zb-h1",
        "pipeline.virtual_stages=2",
        "pipeline.microbatches=4",
    ),
    "zbv_p4_m6": ("mesh.pipeline=4", *ZBV, "pipeline.microbatches=6"),
    "zbv_p2_m4_fsdp2_tensor2_sp": (
        "mesh.pipeline=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "tensor.sequence_parallel=true",
        *ZBV,
        "pipeline.microbatches=4",
    ),
    "zbv_p2_recompute_data2_zero2_accum2": (
        "mesh.pipeline=2",
        "mesh.data=2",
        "optimizer.zero_stage=2",
        *ZBV,
        "pipeline.microbatches=2",
        "pipeline.recompute=true",
        "train.grad_accum_steps=2",
    ),
    "zbh1_p2_data2_fsdp2_zero0": (
        "mesh.pipeline=2",
        "mesh.data=2",
        "mesh.fsdp=2",
        "optimizer.zero_stage=0",
        "pipeline.schedule=zb-h1",
        "pipeline.microbatches=2",
    ),
    "zbh1_p2_tensor2": (
        "mesh.pipeline=2",
        "mesh.tensor=2",
        "tensor.sequence_parallel=false",
        "pipeline.schedule=zb-h1",
        "pipeline.microbatches=4",
    ),
}
SLOW = {"zbv_p2_recompute_data2_zero2_accum2", "zbh1_p2_data2_fsdp2_zero0", "zbh1_p2_tensor2"}


def _overrides(*extra: str) -> list[str]:
    return [
        *FP32,
        *FIRST_STEP_AT_PEAK,
        "optimizer.grad_clip_norm=0",
        f"model.n_layers={L}",
        f"train.global_batch_size={G}",
        "mesh.data=1",
        "mesh.fsdp=1",
        *extra,
    ]


@pytest.fixture(scope="module")
def reference() -> dict:
    plan = make_plan(_overrides(), jax.devices()[:1])
    state = init_state(plan, SEED)
    host_state = to_host(state)
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    out = stepped(compile_fast(make_train_step(plan), state, batch), state, batch)
    assert out["metrics"]["tokens"] == sum(VALID)
    return {"host_state": host_state, **out}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] * (c in SLOW)) for c in CASES])
def test_one_step_equals_single_device(case, reference, need_devices):
    ref = reference
    n = mesh_devices(CASES[case])
    need_devices(n)
    plan = make_plan(_overrides(*CASES[case]), jax.devices()[:n])
    p = plan.mesh.shape["pipeline"]
    assert plan.cfg.pipeline.schedule in ("zb-h1", "zb-v") and p > 1
    state = jax.device_put(ref["host_state"], plan.state_shardings)
    for leaf in jax.tree.leaves(state["params"]["blocks"]):
        assert leaf.sharding.spec[0] == "pipeline" and shard_shape(leaf)[0] == L // p
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    got = stepped(compile_fast(make_train_step(plan), state, batch), state, batch)
    assert_step_equals(plan, got, ref, RTOL)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            ("mesh.pipeline=2", "pipeline.schedule=zb-v"),
            r"zb-v runs two model chunks per device .*virtual_stages=2 \(got 1\)",
        ),
        (
            ("mesh.pipeline=4", "pipeline.schedule=zb-h1", "pipeline.virtual_stages=2", "pipeline.microbatches=6"),
            r"pipeline\.microbatches=6 must be a multiple of mesh\.pipeline=4 .* use 4 or 8",
        ),
        (("mesh.pipeline=2", "pipeline.schedule=zb-v", "pipeline.virtual_stages=2", "model.n_layers=6"), r"2 \* 2 = 4"),
    ],
)
def test_config_errors(overrides, match):
    """A schedule's sizes that do not work are refused at the config check, naming the values that do."""
    with pytest.raises(ConfigError, match=match):
        load_config(CONFIG, [*TINY, *_overrides(*overrides)], num_devices=mesh_devices(overrides))
