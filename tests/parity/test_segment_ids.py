"""A batch of packed documents (`segment_ids`): the train step keeps attention within each document on every kind
of layout. Gradients and loss of `make_grad_fn` with segment ids on one device, against data x fsdp x tensor with
sequence parallelism (ZeRO-3, attention on the gathered sequence) and pipeline 1F1B x data x fsdp (the segment ids
travel with each microbatch through the stages), at `step_helpers.FP32_RTOL` (the fp32 whole-model parity
tolerance: only the order of sums differs). The segment ids must matter: the reference differs from the same batch
without them far beyond the tolerance. Positions restarting at each document come with the data pipeline's packer.
"""

import jax
import numpy as np
import pytest
from step_helpers import (
    FP32,
    FP32_RTOL,
    assert_scalar_close,
    assert_tree_close,
    host_batch,
    planner,
    to_host,
)

from jaxpar.training.state import init_state
from jaxpar.training.step import make_grad_fn

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

SEED = 3
T = 8
VALID = (8, 8, 5, 8, 8, 8, 3, 8)
# Documents per row: lengths 3+5, 8, 2+2+4, 1+7, ...: every row but the second packs several.
SEGMENTS = np.array(
    [
        [1, 1, 1, 2, 2, 2, 2, 2],
        [1, 1, 1, 1, 1, 1, 1, 1],
        [1, 1, 2, 2, 3, 3, 3, 3],
        [1, 2, 2, 2, 2, 2, 2, 2],
        [4, 4, 4, 4, 7, 7, 7, 7],
        [1, 1, 1, 1, 1, 1, 2, 2],
        [1, 2, 3, 4, 5, 6, 7, 8],
        [5, 5, 6, 6, 6, 6, 6, 6],
    ],
    np.int32,
)


_plan = planner(*FP32, f"train.global_batch_size={len(VALID)}", "mesh.data=1", "mesh.fsdp=1")


def _grads(plan, host_params, segments: bool = True):
    params = jax.device_put(host_params, plan.state_shardings["params"])
    batch = host_batch(VALID, T, SEED)
    if segments:
        batch["segment_ids"] = SEGMENTS
    batch = {k: jax.device_put(v, plan.batch_sharding) for k, v in batch.items()}
    grads, loss, _ = jax.jit(make_grad_fn(plan))(params, batch)
    return to_host(grads), float(loss)


@pytest.fixture(scope="module")
def reference() -> dict:
    plan = _plan([], 1)
    host_params = to_host(init_state(plan, SEED)["params"])
    grads, loss = _grads(plan, host_params)
    plain_grads, plain_loss = _grads(plan, host_params, segments=False)
    return {"params": host_params, "grads": grads, "loss": loss, "plain": (plain_grads, plain_loss)}


def test_segment_ids_change_the_loss_and_gradients(reference):
    plain_grads, plain_loss = reference["plain"]
    assert abs(reference["loss"] - plain_loss) > 100 * FP32_RTOL * abs(plain_loss)
    wq = reference["grads"]["blocks"]["attn"]["wq"]
    diff = np.linalg.norm(wq - plain_grads["blocks"]["attn"]["wq"]) / np.linalg.norm(wq)
    assert diff > 100 * FP32_RTOL


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            "tensor.sequence_parallel=true",
            "optimizer.zero_stage=3",
        ],
        ["mesh.pipeline=2", "mesh.data=2", "mesh.fsdp=2", "pipeline.microbatches=2", "pipeline.schedule=1f1b"],
    ],
    ids=["data2-fsdp2-tensor2-sp", "pipeline2-1f1b-data2-fsdp2"],
)
def test_packed_documents_on_a_layout_equal_one_device(reference, overrides, devices8):
    plan = _plan(overrides, 8)
    assert plan.mesh.size == 8 and max(plan.mesh_shape.values()) == 2  # really split three ways
    grads, loss = _grads(plan, reference["params"])
    assert_scalar_close(loss, reference["loss"], FP32_RTOL, "loss")
    assert_tree_close(grads, reference["grads"], FP32_RTOL)
