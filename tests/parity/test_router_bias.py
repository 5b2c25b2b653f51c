"""DeepSeek-V3's auxiliary-loss-free load balancing in the train step (`jaxpar.training.router_bias`): two steps
of a tiny sigmoid-gated MoE move every block's bias by gamma * sign(mean load - load) of each step's global load
(checked against numpy from the loads the step's MoE sums report), and on a mesh with data, fsdp and pipeline
parallelism and experts over data x fsdp the biases after two steps are bitwise the single device's; under
`-m slow`, the biases survive a checkpoint save and restore and stay fp32 in the 16p layout's parameter copy.

Model: tiny (step_helpers.TINY) with 4 blocks as U = 2 MoE units (model.moe.every=2), E = 4 experts, top-2,
sigmoid gating with routed_scale 2.5, the sequence-wise balance loss (aux_loss_weight 0.1) and no z-loss;
gamma = 0.01. fp32 everywhere. The loads are whole assignment counts and the rule takes their signs, so the bias is
compared exactly; the mesh's loss and MoE metrics at step_helpers.FP32_RTOL, as tests/parity/test_moe_pipeline.py
compares them (different reduction orders).
"""

import jax
import numpy as np
import pytest
from step_helpers import (
    FIRST_STEP_AT_PEAK,
    FP32,
    FP32_RTOL,
    assert_scalar_close,
    compile_fast,
    device_batch,
    host_batch,
    make_plan,
    shard_shape,
    to_host,
)

from jaxpar.checkpoint.store import Checkpointer
from jaxpar.training.state import abstract_state, init_state
from jaxpar.training.step import _grad_fn_with_moe, make_train_step

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

SEED = 5
T = 8
VALID = (8, 3, 8, 0, 5, 8, 1, 8, 8, 7, 2, 8, 8, 4, 8, 6)
G = len(VALID)
E, K, U = 4, 2, 2
GAMMA = 0.01
MOE = (
    f"model.moe.num_experts={E}",
    f"model.moe.top_k={K}",
    "model.moe.every=2",
    "model.n_layers=4",
    "model.moe.gating=sigmoid",
    "model.moe.routed_scale=2.5",
    "model.moe.aux_loss_weight=0.1",
    "model.moe.z_loss_weight=0",
    f"model.moe.bias_update_rate={GAMMA}",
)
MESH = (
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.pipeline=2",
    "optimizer.zero_stage=1",
    "pipeline.microbatches=2",
    "model.moe.expert_axes=[data,fsdp]",
)
METRICS = ("loss", "moe_aux_loss", "moe_load_max_mean", "moe_router_bias_spread")


def _overrides(mesh=()) -> list[str]:
    return [*FP32, *FIRST_STEP_AT_PEAK, *MOE, f"train.global_batch_size={G}", *mesh]


def _bias(tree) -> np.ndarray:
    return np.asarray(tree["blocks"]["moe"]["mlp"]["router_bias"])  # [U, E]


def _batches(plan):
    return [device_batch(plan, host_batch(VALID, T, SEED + i)) for i in range(2)]


@pytest.fixture(scope="module")
def reference():
    """One device: the biases before and after each of two steps, each step's global load [U, E] (from the
    step's MoE sums on the state it starts from), its metrics, the initial and final states on the host."""
    plan = make_plan(_overrides(("mesh.data=1", "mesh.fsdp=1")), jax.devices()[:1])
    state = init_state(plan, SEED)
    init = to_host(state)
    batches = _batches(plan)
    grad_fn = compile_fast(jax.jit(_grad_fn_with_moe(plan)), state["params"], batches[0])
    step = compile_fast(make_train_step(plan), state, batches[0])
    biases, loads, metrics = [_bias(state["params"])], [], []
    for batch in batches:
        loads.append(np.asarray(grad_fn(state["params"], batch)[3]["load"]))
        state, m = step(state, batch)
        biases.append(_bias(state["params"]))
        metrics.append(to_host(m))
    return {"plan": plan, "init": init, "biases": biases, "loads": loads, "metrics": metrics, "state": state}


def test_bias_follows_the_load_of_each_step(reference):
    """b_{n+1} = b_n + gamma * sign(mean load_n - load_n) per MoE block, from zeros; an overloaded expert's bias
    falls by gamma and an underloaded one's rises; the second step routes with the moved bias."""
    biases, loads = reference["biases"], reference["loads"]
    assert biases[0].shape == (U, E) and not biases[0].any()
    for n, load in enumerate(loads):
        assert load.shape == (U, E) and (load.sum(-1) == K * G * T).all()  # every token routes, padding too
        want = (biases[n].astype(np.float64) + GAMMA * np.sign(load.mean(-1, keepdims=True) - load)).astype(np.float32)
        np.testing.assert_array_equal(biases[n + 1], want)
    first = biases[1] - biases[0]
    over, under = loads[0] > loads[0].mean(-1, keepdims=True), loads[0] < loads[0].mean(-1, keepdims=True)
    assert over.any() and under.any()
    np.testing.assert_allclose(first[over], -GAMMA, rtol=1e-6)
    np.testing.assert_allclose(first[under], GAMMA, rtol=1e-6)
    assert (loads[1] != loads[0]).any()  # another batch and another bias: another load
    spread = (biases[2].max(-1) - biases[2].min(-1)).mean()
    np.testing.assert_allclose(reference["metrics"][1]["moe_router_bias_spread"], spread, rtol=1e-6)


def test_mesh_bias_equals_single_device(reference, devices8):
    """data=2 x fsdp=2 x pipeline=2 with the experts over data x fsdp: after two steps every MoE block's bias is
    bitwise the single device's (the global load: every data rank, microbatch and stage), and it sits with its
    block on its pipeline stage, the same on every data rank."""
    plan = make_plan(_overrides(MESH), devices8)
    state = jax.device_put(reference["init"], plan.state_shardings)
    bias = state["params"]["blocks"]["moe"]["mlp"]["router_bias"]
    assert shard_shape(bias) == (U // 2, E)  # one MoE unit per stage, replicated over data and fsdp
    w_up = state["params"]["blocks"]["moe"]["mlp"]["w_up"]
    assert shard_shape(w_up)[:2] == (U // 2, E // 4)  # experts split over data x fsdp
    batches = _batches(plan)
    assert shard_shape(batches[0]["inputs"]) == (G // 4, T)
    step = compile_fast(make_train_step(plan), state, batches[0])
    for n, batch in enumerate(batches):
        state, m = step(state, batch)
        for name in METRICS:
            assert_scalar_close(m[name], reference["metrics"][n][name], FP32_RTOL, name)
        np.testing.assert_array_equal(_bias(state["params"]), reference["biases"][n + 1])
    for shard in state["params"]["blocks"]["moe"]["mlp"]["router_bias"].addressable_shards:
        stage = shard.index[0]
        np.testing.assert_array_equal(np.asarray(shard.data), reference["biases"][2][stage])


@pytest.mark.slow
def test_bias_survives_checkpoint(reference, tmp_path):
    """The biases are parameters: saved and restored with the train state (`jaxpar.checkpoint.store`), bitwise."""
    plan, state = reference["plan"], reference["state"]
    assert np.abs(_bias(state["params"])).max() > 0
    ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=1, async_save=False)
    ckpt.save(2, state, data_state={}, config={})
    restored, _, _ = ckpt.restore(2, abstract_state(plan))
    ckpt.close()
    np.testing.assert_array_equal(_bias(restored["params"]), reference["biases"][2])
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow
def test_bias_stays_fp32_in_the_16p_parameter_copy():
    """Under the 16p layout the forward's bfloat16 parameter copy keeps the biases fp32 (a bf16 bias would round
    away gamma-sized steps) and equal to the master copy's, before and after a step."""
    plan = make_plan(
        [
            *FIRST_STEP_AT_PEAK,
            *MOE,
            "precision.layout=16p",
            "mesh.data=1",
            "mesh.fsdp=1",
            f"train.global_batch_size={G}",
        ],
        jax.devices()[:1],
    )
    state = init_state(plan, SEED)
    assert state["params"]["blocks"]["moe"]["mlp"]["router"].dtype == jax.numpy.bfloat16  # the layout casts
    batch = _batches(plan)[0]
    step = compile_fast(make_train_step(plan), state, batch)
    state, _ = step(state, batch)
    for copy in ("params", "master"):
        assert state[copy]["blocks"]["moe"]["mlp"]["router_bias"].dtype == np.float32
    np.testing.assert_array_equal(_bias(state["params"]), _bias(state["master"]))
    assert set(np.unique(np.abs(_bias(state["params"])))) == {np.float32(GAMMA)}  # every expert off the mean
