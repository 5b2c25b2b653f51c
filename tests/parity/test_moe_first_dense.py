"""Dense blocks before the MoE stack (`model.moe.first_dense`, DeepSeek-V3's first_k_dense_replace): one train step
on a mesh with a pipeline, tensor parallelism and expert parallelism equals the single-device step.

Model: tiny (step_helpers.TINY) with 4 blocks, the first 2 dense (`first_dense_0`, `first_dense_1`, SwiGLU of
model.d_ff), then 2 MoE blocks (E = 4 experts, top-2, one shared expert) as the layer stack, one per pipeline
stage. The dense blocks run with the embedding on the first stage (`jaxpar.model.llama.Llama.embed_tokens`),
recomputed in its backward like the embedding; their gradients, like the embedding's, are all-reduced over
`pipeline`. Packed documents (segment ids) reach them as they reach the stack.

Compared in fp32 at step_helpers.FP32_RTOL (1e-5: the layouts sum the same terms in another order), as
tests/parity/test_moe_pipeline.py does: the loss with the auxiliary losses, the gradients of every parameter (the
dense blocks' included), Adam's moments and the updated parameters, and the expert loads exactly.

The layout differs from the reference's (asserted): the dense blocks' MLP hidden width split over `tensor` and
replicated over `pipeline`, the MoE stack's rows over `pipeline`, whole experts over `data`.
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
    host_batch,
    make_plan,
    one_adam_step,
    shard_shape,
    to_host,
)

from jaxpar.config.errors import ConfigError
from jaxpar.training.state import init_state

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

SEED, T = 5, 8
VALID = (8, 3, 8, 0, 5, 8, 1, 8)
E = 4
MODEL = (
    *FP32,
    *FIRST_STEP_AT_PEAK,
    "model.n_layers=4",
    "model.moe.first_dense=2",
    f"model.moe.num_experts={E}",
    "model.moe.top_k=2",
    "model.moe.shared_experts=1",
    "model.moe.aux_loss_weight=0.1",
    "model.moe.z_loss_weight=0.01",
    f"train.global_batch_size={len(VALID)}",
)
ONE_DEVICE = ("mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipeline=1", "optimizer.zero_stage=0")
LAYOUT = (
    "mesh.data=2",
    "mesh.fsdp=1",
    "mesh.tensor=2",
    "mesh.pipeline=2",
    "pipeline.microbatches=2",
    "optimizer.zero_stage=1",
    "model.moe.expert_axes=[data]",
)


def _packed(plan):
    """The host batch with two documents per row (segment ids 1 and 2, split mid-row), so the dense blocks'
    attention must stay within each document."""
    batch = host_batch(VALID, T, SEED)
    batch["segment_ids"] = np.where(np.arange(T)[None, :] < T // 2, 1, 2).astype(np.int32).repeat(len(VALID), 0)
    return {k: jax.device_put(v, plan.batch_sharding) for k, v in batch.items()}


@pytest.mark.slow
def test_first_dense_blocks_on_a_pipeline_equal_one_device(devices8):
    ref_plan = make_plan([*MODEL, *ONE_DEVICE], jax.devices()[:1])
    state = init_state(ref_plan, SEED)
    host_state = to_host(state)
    assert set(host_state["params"]) >= {"first_dense_0", "first_dense_1", "blocks", "embed"}
    ref = one_adam_step(ref_plan, state, _packed(ref_plan), moe_sums=True)

    plan = make_plan([*MODEL, *LAYOUT], devices8)
    state = jax.device_put(host_state, plan.state_shardings)
    params = state["params"]
    w_up, dense_up = params["blocks"]["moe"]["mlp"]["w_up"], params["first_dense_0"]["mlp"]["w_up"]
    assert w_up.shape[:2] == (2, E) and shard_shape(w_up)[:2] == (1, E // 2)  # a unit per stage, experts over data
    assert shard_shape(dense_up) == (dense_up.shape[0], dense_up.shape[1] // 2)  # hidden width over tensor
    out = one_adam_step(plan, state, _packed(plan), moe_sums=True)

    m, ref_m = out["metrics"], ref["metrics"]
    assert m["tokens"] == ref_m["tokens"] == sum(VALID)
    for name in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"):
        assert_scalar_close(m[name], ref_m[name], FP32_RTOL, name)
    np.testing.assert_array_equal(out["moe_sums"]["load"], ref["moe_sums"]["load"])
    assert np.abs(ref["grads"]["first_dense_1"]["mlp"]["w_down"]).max() > 0
    assert_tree_close(out["grads"], ref["grads"], FP32_RTOL)
    assert_adam_step_close(out, ref, out["params0"], FP32_RTOL, **adam_step_args(plan, m))


def test_first_dense_must_leave_moe_blocks_and_whole_units(devices8):
    """The stack is model.n_layers - first_dense blocks: it must hold an MoE block and split into the stages."""
    with pytest.raises(ConfigError, match=r"model\.moe\.first_dense=4 leaves no MoE block"):
        make_plan([*MODEL, *ONE_DEVICE, "model.moe.first_dense=4"], jax.devices()[:1])
    with pytest.raises(
        ConfigError, match=r"model\.n_layers - model\.moe\.first_dense = 4 - 1 = 3 must be divisible by"
    ):
        make_plan([*MODEL, *LAYOUT, "model.moe.first_dense=1"], devices8)
