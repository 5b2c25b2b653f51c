"""Activation checkpointing policies (`model.remat`) change what the backward keeps, never the gradients."""

import jax
import pytest
from step_helpers import (
    FP32,
    FP32_RTOL,
    assert_tree_close,
    compile_fast,
    device_batch,
    host_batch,
    make_plan,
    quick_compile,
    to_host,
)

from jaxpar.training.state import init_state
from jaxpar.training.step import make_grad_fn

POLICIES = ("none", "dots", "names", "full")


@pytest.mark.slow  # compiles a step per remat policy (about 11 s on 2 cores)
@pytest.mark.timeout(300)
def test_remat_policies_same_gradients_less_memory():
    batch = host_batch([8, 5, 8, 2], 8, seed=0)
    grads, temp = {}, {}
    for policy in POLICIES:
        plan = make_plan(
            [
                *FP32,
                "mesh.data=1",
                "mesh.fsdp=2",
                "mesh.pipeline=2",
                "pipeline.microbatches=2",
                "model.n_layers=4",
                "train.global_batch_size=4",
                f"model.remat={policy}",
            ],
            jax.devices()[:4],
        )
        with quick_compile():
            state = init_state(plan, 0)
        b = device_batch(plan, batch)
        compiled = compile_fast(jax.jit(make_grad_fn(plan)), state["params"], b)
        temp[policy] = compiled.memory_analysis().temp_size_in_bytes
        grads[policy] = to_host(compiled(state["params"], b))
    for policy in POLICIES[1:]:
        assert_tree_close(grads[policy], grads["none"], rtol=FP32_RTOL)  # recomputed: same sums, other fusion
    # The policies really differ: recomputing the whole block keeps less than saving every matmul output.
    assert temp["full"] < temp["none"], temp


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sp", [pytest.param(False, marks=pytest.mark.slow), True])  # without SP: -m slow
def test_remat_policies_same_gradients_under_tensor_parallelism(sp):
    """The policies keep tensor collectives' outputs (`jaxpar.model.stack`): what the backward reads from them
    instead of re-running the collectives gives the gradients of `none`, with and without sequence parallelism,
    on data=2 x tensor=4."""
    batch = host_batch([8, 5, 8, 2], 8, seed=1)
    grads, params = {}, None
    for policy in POLICIES:
        plan = make_plan(
            [
                *FP32,
                "mesh.data=2",
                "mesh.fsdp=1",
                "mesh.tensor=4",
                "model.n_kv_heads=4",
                "train.global_batch_size=4",
                f"tensor.sequence_parallel={str(sp).lower()}",
                f"model.remat={policy}",
            ],
            jax.devices()[:8],
        )
        if params is None:  # the policy changes neither the parameters nor their shardings
            with quick_compile():
                params = init_state(plan, 0)["params"]
        b = device_batch(plan, batch)
        compiled = compile_fast(jax.jit(make_grad_fn(plan)), params, b)
        grads[policy] = to_host(compiled(params, b))
    for policy in POLICIES[1:]:
        assert_tree_close(grads[policy], grads["none"], rtol=FP32_RTOL)
