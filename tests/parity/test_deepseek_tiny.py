"""A tiny DeepSeek-V3-shaped model (arXiv 2412.19437, section 2): one train step on data x fsdp x tensor x pipeline
with expert parallelism equals the single-device step.

Model: step_helpers.TINY (d_model 64, 4 heads, T 8, fp32) with DeepSeek-V3's parts at small widths:
  * Multi-head Latent Attention (`jaxpar.model.mla`): query latent 32, key/value latent 16, per-head widths 16
    (no rotary) + 8 (rotary, one key shared by the heads), values 16;
  * 2 dense first blocks (`model.moe.first_dense`) and 2 MoE blocks: 4 routed experts, top-2, 1 shared expert,
    sigmoid gating with top-k normalisation, routed scale 2.5, 2 expert groups of which a token uses 1, the
    balancing bias (moved by 0.01 per step, so the step's bias update is compared too), the sequence-wise balance
    loss, dropless routing.
Layout: pipeline 2 x data 2 x fsdp 2 x tensor 2 (sequence parallelism) = 16 simulated devices, in a subprocess
(the device count is fixed when jax starts), ZeRO-1, the experts over data. A second case runs 3 MoE blocks over
the 2 stages (pipeline.balance_stages: an uneven split, the stack stored as 4 rows, the last a zero row that no
stage runs; `jaxpar.parallel.layer_split`), as DeepSeek-V3's 58 MoE blocks run over 16 stages.

Compared at step_helpers.FP32_RTOL (1e-5: the layouts sum the same fp32 terms in another order): the loss and
its auxiliary loss, the gradient norm, every gradient, Adam's moments and the updated parameters (the balancing
biases' update included); the expert loads exactly (counts). The layouts differ (asserted in the child): MLA's
up-projections split over heads on `tensor`, whole experts over `data`, the MoE stack's rows over `pipeline`.
"""

import os
import pickle
import subprocess
import sys

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
    to_host,
)

from jaxpar.model.interface import STACK_ATTRIBUTE
from jaxpar.training.state import init_state

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED, T = 5, 8
VALID = (8, 3, 8, 0, 5, 8, 1, 8)
E = 4
MODEL = (
    *FP32,
    *FIRST_STEP_AT_PEAK,
    "model.n_kv_heads=4",
    "model.q_lora_rank=32",
    "model.kv_lora_rank=16",
    "model.qk_nope_head_dim=16",
    "model.qk_rope_head_dim=8",
    "model.v_head_dim=16",
    "model.moe.first_dense=2",
    f"model.moe.num_experts={E}",
    "model.moe.top_k=2",
    "model.moe.d_expert=32",
    "model.moe.shared_experts=1",
    "model.moe.routing=dropless",
    "model.moe.gating=sigmoid",
    "model.moe.routed_scale=2.5",
    "model.moe.expert_groups=2",
    "model.moe.group_top_k=1",
    "model.moe.bias_update_rate=0.01",
    "model.moe.aux_loss_weight=0.01",
    "model.moe.z_loss_weight=0",
    f"train.global_batch_size={len(VALID)}",
)
# name: (the model's depth, the layout's split)
CASES = {"even": ("model.n_layers=4", ()), "uneven": ("model.n_layers=5", ("pipeline.balance_stages=true",))}
ONE_DEVICE = ("mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipeline=1", "optimizer.zero_stage=0")
MESH_16 = (
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.tensor=2",
    "mesh.pipeline=2",
    "tensor.sequence_parallel=true",
    "pipeline.microbatches=2",
    "optimizer.zero_stage=1",
    "model.moe.expert_axes=[data]",
)

_CHILD = r"""
import pickle, sys
sys.path.insert(0, sys.argv[1])
import jax
from step_helpers import device_batch, host_batch, make_plan, one_adam_step, quick_compile, shard_shape
from jaxpar.training.pipelined import stage_layout
from jaxpar.training.state import init_state

args = pickle.load(open(sys.argv[2], "rb"))
assert jax.device_count() == 16, jax.device_count()
out = {}
with quick_compile():
    for name, (overrides, state) in args["cases"].items():
        plan = make_plan(overrides, jax.devices())
        state = init_state(plan, params=state["params"])  # step 0 as the reference's; the stack stored as planned
        p = state["params"]
        attention, experts = p["blocks"]["moe"]["attn"]["wkv_b"], p["blocks"]["moe"]["mlp"]["w_up"]
        layout = stage_layout(plan)
        step = one_adam_step(plan, state, device_batch(plan, host_batch(args["valid"], args["T"], args["seed"])), True)
        out[name] = {k: step[k] for k in ("grads", "grad_loss", "params", "mu", "nu", "metrics", "moe_sums", "params0")}
        out[name]["layout"] = {
            "mesh": dict(plan.mesh.shape), "sequence_parallel": plan.tensor_parallel.sequence_parallel,
            "wkv_b": (attention.shape, shard_shape(attention)), "w_up": (experts.shape, shard_shape(experts)),
            "stack_rows": plan.stack_rows, "counts": None if layout is None else layout.counts,
        }
pickle.dump(out, open(sys.argv[3], "wb"))
"""


def _stack_rows(tree, rows: int):
    """`tree` with every layer stack leaf cut to its first `rows` rows (the stored stack's zero rows dropped)."""

    def cut(path, a):
        stacked = any(getattr(k, "key", None) == STACK_ATTRIBUTE for k in path)
        return a[:rows] if stacked and np.ndim(a) else a

    return jax.tree_util.tree_map_with_path(cut, tree)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_deepseek_v3_on_16_devices_equals_one_device(tmp_path):
    refs, cases = {}, {}
    for name, (depth, split) in CASES.items():
        plan = make_plan([*MODEL, depth, *ONE_DEVICE], jax.devices()[:1])
        state = init_state(plan, SEED)
        host_state = to_host(state)
        batch = host_batch(VALID, T, SEED)
        refs[name] = one_adam_step(plan, state, {k: jax.device_put(v) for k, v in batch.items()}, moe_sums=True)
        cases[name] = ([*MODEL, depth, *split, *MESH_16], host_state)
    assert {"first_dense_0", "first_dense_1"} <= set(refs["even"]["params0"])
    assert "wkv_b" in refs["even"]["params0"]["blocks"]["moe"]["attn"]  # MLA, not the usual attention
    inputs, outputs = tmp_path / "in.pkl", tmp_path / "out.pkl"
    with open(inputs, "wb") as f:
        pickle.dump({"cases": cases, "valid": VALID, "T": T, "seed": SEED}, f)
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="16", JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, TESTS_DIR, str(inputs), str(outputs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with open(outputs, "rb") as f:
        got = pickle.load(f)
    for name, ref in refs.items():
        out, layout = got[name], got[name]["layout"]
        assert layout["mesh"] == {"data": 2, "pipeline": 2, "fsdp": 2, "context": 1, "tensor": 2}
        assert layout["sequence_parallel"]
        (rows, z, heads, width), shard = layout["wkv_b"]
        assert shard == (rows // 2, z // 2, heads // 2, width)  # stage rows, latent over fsdp, heads over tensor
        (rows, experts, *_), shard = layout["w_up"]
        assert shard[:2] == (rows // 2, experts // 2)  # whole experts over data
        depth = 2 if name == "even" else 3
        assert layout["stack_rows"] == (2 if name == "even" else 4)
        assert layout["counts"] == (None if name == "even" else (1, 2))  # the dense blocks' stage runs fewer
        if layout["stack_rows"] > depth:  # the stored zero rows stay zero: parameters and both moments
            for key in ("params", "mu", "nu"):
                for a in jax.tree.leaves(out[key][STACK_ATTRIBUTE]):
                    assert not np.any(a[depth:]), key
            out = {**out, **{k: _stack_rows(out[k], depth) for k in ("grads", "params", "mu", "nu", "params0")}}
        m, ref_m = out["metrics"], ref["metrics"]
        assert m["tokens"] == ref_m["tokens"] == sum(VALID)
        for metric in ("loss", "grad_norm", "moe_aux_loss"):
            assert_scalar_close(m[metric], ref_m[metric], FP32_RTOL, f"{name} {metric}")
        np.testing.assert_array_equal(out["moe_sums"]["load"], ref["moe_sums"]["load"])
        bias = ref["params"][STACK_ATTRIBUTE]["moe"]["mlp"]["router_bias"]
        assert np.abs(bias).max() > 0  # the balancing bias moved in the step
        np.testing.assert_array_equal(out["params"][STACK_ATTRIBUTE]["moe"]["mlp"]["router_bias"], bias)
        # the bias is the balancing rule's, compared above (no gradient, no moments); the rest is trained
        out, ref = _without_bias(out), _without_bias(ref)
        assert_tree_close(out["grads"], ref["grads"], FP32_RTOL)
        one = make_plan([*MODEL, CASES[name][0], *ONE_DEVICE], jax.devices()[:1])  # adam_step_args' settings
        args = adam_step_args(one, m)
        assert_adam_step_close(out, ref, out["params0"], FP32_RTOL, **{**args, "decayed": _drop_bias(args["decayed"])})


def _drop_bias(tree: dict) -> dict:
    """A parameter-shaped tree without the MoE blocks' balancing bias."""
    stack = dict(tree[STACK_ATTRIBUTE])
    stack["moe"] = {**stack["moe"], "mlp": {k: v for k, v in stack["moe"]["mlp"].items() if k != "router_bias"}}
    return {**tree, STACK_ATTRIBUTE: stack}


def _without_bias(step: dict) -> dict:
    """`step` with the balancing bias left out of its gradients, moments and parameters before and after."""
    return {**step, **{k: _drop_bias(step[k]) for k in ("grads", "params", "params0", "mu", "nu")}}
