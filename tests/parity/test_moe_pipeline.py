"""Mixture of experts inside pipeline stages: one train step on mesh.pipeline=2 equals the single-device step.

Model: tiny (step_helpers.TINY) with 4 blocks as U = 2 MoE units (model.moe.every=2: a dense block, then an MoE
block of E=4 experts, top-2, one shared expert), so each of the 2 stages holds one MoE unit; the interleaved case
has U = 4 units (every=1) over 2 stages x 2 virtual stages, one unit per model chunk; so does the zb-v case. Each
stage's blocks return their units' router statistics; the weighted auxiliary losses enter the loss on the stage that
computed them and are differentiated through that stage's routers and input
(`jaxpar.parallel.pipeline.StageParts.blocks_loss`).

Compared in fp32 at step_helpers.FP32_RTOL, as tests/parity/test_moe_parity.py does: the loss (cross-entropy
plus the weighted auxiliary losses), the MoE metrics, the gradients (router included), Adam's moments and the
updated parameters; and the step's expert loads per unit [U, E] exactly (whole assignment counts), in model
order (the reference's rows differ between units, so a unit mapped to the wrong row fails). The evaluation
(cross-entropy only, `make_eval_step` through `forward_loss`) equals the single device's.

Cases: 1F1B with data=2 x fsdp=2 x pipeline=2 (ZeRO-1), dropless, and zb-v on the same mesh with experts over
data x fsdp, in the default suite; under `-m slow`
capacity routing on the same layout, GPipe on data=2 x pipeline=2 with ZeRO-3 over fsdp=2, 1F1B with the
stage forward recomputed inside gradient accumulation (capacity routing, ZeRO-2, 2 x 2 microbatches), 1F1B on
fsdp=2 x tensor=2 x pipeline=2 (experts' hidden width over tensor), and
interleaved 1F1B with virtual_stages=2 (U = 4), and zb-h1 on fsdp=2 x tensor=2 (sequence parallel) x pipeline=2
with capacity routing. In the default suite too: zb-h1 with the uneven split pipeline.stage_layers=[3, 1] (U = 4,
experts over data x fsdp).

`test_chunk_rows_in_model_order` checks the placement of each stage's per-unit rows (chunk order -> model order)
alone, for interleaved layouts too, in the default suite.

Each test asserts its layout really differs from the reference's: the MoE units' parameters are split over
`pipeline` along the stacked units dimension (a device holds U / p units) and the rows over data x fsdp.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
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

from jaxpar.config.errors import ConfigError
from jaxpar.parallel import pipeline
from jaxpar.training.state import init_state
from jaxpar.training.step import make_eval_step

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
    "model.moe.capacity_factor=0.5",
    "model.moe.aux_loss_weight=0.1",
    "model.moe.z_loss_weight=0.01",
    "model.n_layers=4",
)
METRICS = ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "moe_load_max_mean")
# name: (routing, every, mesh and pipeline overrides)
CASES = {
    "data2_fsdp2_pipeline2_1f1b_dropless": (
        "dropless",
        2,
        ("mesh.data=2", "mesh.fsdp=2", "mesh.pipeline=2", "optimizer.zero_stage=1", "pipeline.microbatches=2"),
    ),
    "data2_fsdp2_pipeline2_1f1b_capacity": (
        "capacity",
        2,
        ("mesh.data=2", "mesh.fsdp=2", "mesh.pipeline=2", "optimizer.zero_stage=1", "pipeline.microbatches=2"),
    ),
    "data2_fsdp2_pipeline2_gpipe_zero3": (
        "dropless",
        2,
        (
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.pipeline=2",
            "optimizer.zero_stage=3",
            "pipeline.microbatches=2",
            "pipeline.schedule=gpipe",
        ),
    ),
    "data2_fsdp2_pipeline2_1f1b_recompute_zero2_accum2": (
        "capacity",
        2,
        (
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.pipeline=2",
            "optimizer.zero_stage=2",
            "pipeline.microbatches=2",
            "pipeline.recompute=true",
            "train.grad_accum_steps=2",
        ),
    ),
    "fsdp2_tensor2_pipeline2_1f1b": (
        "dropless",
        2,
        ("mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "mesh.pipeline=2", "pipeline.microbatches=2"),
    ),
    "data2_fsdp2_pipeline2_virtual2": (
        "dropless",
        1,
        ("mesh.data=2", "mesh.fsdp=2", "mesh.pipeline=2", "pipeline.microbatches=2", "pipeline.virtual_stages=2"),
    ),
    # Expert parallelism inside the stages: the all-to-alls run among the devices of one stage.
    "data2_fsdp2_pipeline2_1f1b_ep4_dropless": (
        "dropless",
        2,
        (
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.pipeline=2",
            "optimizer.zero_stage=1",
            "pipeline.microbatches=2",
            "model.moe.expert_axes=[data,fsdp]",
        ),
    ),
    "fsdp2_tensor2_sp_pipeline2_1f1b_ep2_capacity": (
        "capacity",
        2,
        (
            "mesh.data=1",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            "mesh.pipeline=2",
            "tensor.sequence_parallel=true",
            "pipeline.microbatches=2",
            "model.moe.expert_axes=[fsdp]",
        ),
    ),
    # Zero-bubble schedules (`jaxpar.parallel.pipeline_zb`): the blocks' auxiliary losses go through B, the
    # routers' gradients through W.
    "data2_fsdp2_pipeline2_zbv_ep4_dropless": (
        "dropless",
        1,
        (
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.pipeline=2",
            "pipeline.microbatches=2",
            "pipeline.schedule=zb-v",
            "pipeline.virtual_stages=2",
            "model.moe.expert_axes=[data,fsdp]",
        ),
    ),
    "fsdp2_tensor2_sp_pipeline2_zbh1_capacity": (
        "capacity",
        2,
        (
            "mesh.data=1",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            "mesh.pipeline=2",
            "tensor.sequence_parallel=true",
            "pipeline.microbatches=2",
            "pipeline.schedule=zb-h1",
        ),
    ),
    # An uneven split (`jaxpar.parallel.layer_split`): 3 units on stage 0, 1 on stage 1 (padded to 3, skipped);
    # the all-to-alls inside the skip's cond, the units' loads back to model order from the stage layout.
    "data2_fsdp2_pipeline2_zbh1_uneven_ep4_dropless": (
        "dropless",
        1,
        (
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.pipeline=2",
            "pipeline.microbatches=2",
            "pipeline.schedule=zb-h1",
            "pipeline.stage_layers=[3,1]",
            "model.moe.expert_axes=[data,fsdp]",
        ),
    ),
}
DEFAULT_CASES = (
    "data2_fsdp2_pipeline2_1f1b_ep4_dropless",
    "data2_fsdp2_pipeline2_zbv_ep4_dropless",
    "data2_fsdp2_pipeline2_zbh1_uneven_ep4_dropless",
)


def _overrides(routing: str, every: int, extra=()) -> list[str]:
    return [
        *FP32,
        *FIRST_STEP_AT_PEAK,
        *MOE,
        f"model.moe.routing={routing}",
        f"model.moe.every={every}",
        f"train.global_batch_size={G}",
        *extra,
    ]


def _single_device(routing: str, every: int) -> list[str]:
    return _overrides(routing, every, ("mesh.data=1", "mesh.fsdp=1", "mesh.pipeline=1", "optimizer.zero_stage=0"))


def _experts(tree):
    return tree["blocks"]["moe"]["mlp"]  # w_up [U, E, D, F], router [U, D, E]


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(routing: str, every: int) -> dict:
        key = (routing, every)
        if key not in cache:
            plan = make_plan(_single_device(routing, every), jax.devices()[:1])
            state = init_state(plan, SEED)
            host_state = to_host(state)
            batch = device_batch(plan, host_batch(VALID, T, SEED))
            eval_sum, eval_count = make_eval_step(plan)(state["params"], batch)
            out = one_adam_step(plan, state, batch, moe_sums=True)
            cache[key] = dict(out, host_state=host_state, eval=(float(eval_sum), float(eval_count)))
        return cache[key]

    return get


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in DEFAULT_CASES else pytest.mark.slow) for c in CASES])
def test_one_step_equals_single_device(case, reference, devices8):
    routing, every, extra = CASES[case]
    ref = reference(routing, every)
    plan = make_plan(_overrides(routing, every, extra), devices8)
    p, data, fsdp, tensor = (plan.mesh.shape[a] for a in ("pipeline", "data", "fsdp", "tensor"))
    zero = plan.cfg.optimizer.zero_stage
    state = jax.device_put(ref["host_state"], plan.state_shardings)
    batch = device_batch(plan, host_batch(VALID, T, SEED))

    # The layout differs from the reference's: MoE units over pipeline (U / p per device, at least one), the
    # experts' and router's D over fsdp (and data at ZeRO-3), their hidden width over tensor, rows over data x fsdp;
    # with expert axes whole experts over those axes (E / ep per device, D no longer split over them).
    w_up, router = _experts(state["params"])["w_up"], _experts(state["params"])["router"]
    U, e, D, F = w_up.shape
    assert (U, e) == (4 // every, E) and p == 2 and U // p >= 1
    params_over = fsdp * (data if zero == 3 else 1)
    axes = plan.expert_axes
    ep = math.prod(plan.mesh.shape[a] for a in axes)
    expert_d = (fsdp if "fsdp" not in axes else 1) * (data if zero == 3 and "data" not in axes else 1)
    assert shard_shape(w_up) == (U // p, E // ep, D // expert_d, F // tensor)
    assert plan.tensor_parallel.sequence_parallel == ("tensor.sequence_parallel=true" in extra or tensor > 1)
    assert shard_shape(router) == (U // p, D // params_over, E)
    assert shard_shape(batch["inputs"]) == (G // (data * fsdp), T)

    out = one_adam_step(plan, state, batch, moe_sums=True)
    m, ref_m = out["metrics"], ref["metrics"]
    assert m["tokens"] == ref_m["tokens"] == sum(VALID)
    for name in METRICS:
        assert_scalar_close(m[name], ref_m[name], RTOL, name)
    assert_scalar_close(out["grad_loss"], ref_m["loss"], RTOL, "grad_fn loss")
    if routing == "capacity":
        assert ref_m["moe_dropped_fraction"] > 0.2  # the batch overflows capacity
    else:
        assert ref_m["moe_dropped_fraction"] == 0
    # Expert loads per unit: whole counts, in model order; the reference's units differ, so order is checked.
    load, ref_load = out["moe_sums"]["load"], ref["moe_sums"]["load"]
    assert load.shape == ref_load.shape == (U, E)
    assert all(not np.array_equal(ref_load[u], ref_load[u + 1]) for u in range(U - 1))
    np.testing.assert_array_equal(load, ref_load)
    assert np.abs(_experts(ref["grads"])["router"]).max() > 0
    assert_tree_close(out["grads"], ref["grads"], RTOL)
    assert_adam_step_close(out, ref, out["params0"], RTOL, **adam_step_args(plan, m))


def test_eval_equals_single_device(reference, devices8):
    """`make_eval_step` with MoE on a pipeline (`forward_loss`, no auxiliary terms): the summed cross-entropy
    and token count equal the single device's."""
    routing, every, extra = CASES["data2_fsdp2_pipeline2_1f1b_dropless"]
    ref = reference(routing, every)
    plan = make_plan(_overrides(routing, every, extra), devices8)
    params = jax.device_put(ref["host_state"]["params"], plan.state_shardings["params"])
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    compiled = make_eval_step(plan).lower(params, batch).compile()
    assert "collective-permute" in compiled.as_text()  # activations pass between stages
    total, count = compiled(params, batch)
    assert float(count) == ref["eval"][1] == sum(VALID)
    assert_scalar_close(total, ref["eval"][0], RTOL, "eval loss sum")
    # The training loss adds the auxiliary terms; evaluation reports the cross-entropy only.
    assert ref["metrics"]["loss"] * sum(VALID) > ref["eval"][0] * (1 + 1e-3)


@pytest.mark.parametrize(
    "every,extra,match",
    [
        (
            4,
            ("mesh.pipeline=2", "mesh.data=4", "mesh.fsdp=1"),
            r"model\.n_layers / model\.moe\.every = 4 / 4 = 1 MoE units .* divisible by mesh\.pipeline \* "
            r"pipeline\.virtual_stages = 2 \* 1 = 2",
        ),
        (
            2,
            (
                "mesh.pipeline=2",
                "mesh.data=4",
                "mesh.fsdp=1",
                "pipeline.virtual_stages=2",
                "pipeline.microbatches=2",
            ),
            r"= 2 MoE units .* 2 \* 2 = 4",
        ),
    ],
)
def test_units_must_split_into_stages(every, extra, match, devices8):
    """MoE units that do not split evenly into the pipeline's model chunks are refused at load, naming the keys
    (model.n_layers=4 itself splits into the chunks)."""
    with pytest.raises(ConfigError, match=match):
        make_plan(_overrides("dropless", every, extra), devices8)


@pytest.mark.parametrize("p,v", [(2, 1), (2, 2), (4, 3)])
def test_chunk_rows_in_model_order(p, v):
    """Per-unit rows a stage computed in chunk order (as `to_chunk_order` lays out its layers: model chunk
    j*p + s in chunk j of stage s), placed by `chunk_rows_in_model_order` and summed over `pipeline`, are every
    unit's rows in model order on every stage: what the step does with the expert loads [U, E]."""
    n = 2  # units per chunk
    units = p * v * n
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:p]), (pipeline.AXIS,))
    load = jnp.arange(units * 3, dtype=jnp.float32).reshape(units, 3)  # unit u's row: 3u, 3u + 1, 3u + 2

    def body(x):
        rows = pipeline.to_chunk_order(x, p, v).reshape(v, n, 3)  # this stage's units, chunk order
        placed = pipeline.chunk_rows_in_model_order(rows, p)
        return jax.lax.psum(placed, pipeline.AXIS)[None]

    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(pipeline.AXIS), out_specs=P(pipeline.AXIS)))(load)
    for s in range(p):
        np.testing.assert_array_equal(np.asarray(out)[s], np.asarray(load))
