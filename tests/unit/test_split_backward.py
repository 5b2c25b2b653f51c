"""The split backward (`jaxpar.parallel.split_backward`): B (input gradient) then W (weight gradients) from B's
boundary equals the unsplit backward of a stage's blocks, per layer kind, inside the step's shard_map; and the
boundary's size per microbatch (what W's deferral keeps alive) follows the stated formula.

Layer kinds, each a whole tiny model's layer stack (model.n_layers=2) as one stage, in fp32:
  * dense with its weights gathered over fsdp=2 (each layer's weights all-gathered before use, their gradients
    reduce-scattered: the reduce-scatter lands in W);
  * tensor-parallel over tensor=2, with and without sequence parallelism (column / row parallel projections
    with their psum or all-gather / reduce-scatter in the input gradient's path);
  * mixture of experts (every=1, E=4, top-2, a shared expert) with its auxiliary losses in the blocks
    (`StageParts.blocks_loss`: the cotangent is (d_h, loss scale)), experts over fsdp=2.

Bound: the split runs the same equations on the same values in two groups; XLA may fuse the groups differently,
so the gradients agree bitwise or within fp32 reordering. Asserted: |split - unsplit| <= 2^-20 max|unsplit| per
leaf (a few ulp of the leaf's largest element), and the split really ran in two parts (W's boundary is not
empty and B's input gradient does not depend on W).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from step_helpers import FP32, device_batch, host_batch, make_plan

from jaxpar.parallel.pipeline import blocks_cotangent, blocks_vjp
from jaxpar.parallel.pipeline_zb import split_stage_backward
from jaxpar.parallel.split_backward import SplitBackward, boundary_bytes
from jaxpar.training.forward import split_stack
from jaxpar.training.pipelined import stage_parts
from jaxpar.training.state import abstract_state, init_state

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

T = 8
REL = 2.0**-20
MOE = (
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.every=1",
    "model.moe.shared_experts=1",
    "model.moe.aux_loss_weight=0.1",
    "model.moe.z_loss_weight=0.01",
)
CASES = {
    "dense-fsdp": ("mesh.data=1", "mesh.fsdp=2"),
    "tensor": ("mesh.data=1", "mesh.fsdp=1", "mesh.tensor=2", "tensor.sequence_parallel=false"),
    "tensor-sp": ("mesh.data=1", "mesh.fsdp=1", "mesh.tensor=2", "tensor.sequence_parallel=true"),
    "moe": ("mesh.data=1", "mesh.fsdp=2", "model.moe.expert_axes=[fsdp]", *MOE),
}


def _split_vs_unsplit(overrides):
    """(max |split - unsplit| / max |unsplit| per gradient leaf, input gradient included; boundary bytes) of the
    plan's layer stack as one stage, computed inside the step's shard_map on each device."""
    plan = make_plan([*FP32, "model.n_layers=2", f"data.seq_len={T}", *overrides], jax.devices()[:2])
    state = init_state(plan, seed=1)
    batch = device_batch(plan, host_batch([T] * 4, T, seed=2))
    out = {}

    def body(params, mb):
        parts = stage_parts(plan, params, plan.loss_fn)
        layers, edge = split_stack(params)
        x = parts.embed(edge, mb).astype(jnp.float32)
        ct_h = jnp.sin(x * 3.0)  # any cotangent that differs per element
        ct = blocks_cotangent(parts, ct_h, jnp.float32(0.5))

        def backward(w, x_, ct_):
            d_w, d_x = blocks_vjp(parts, w, x_, mb)[3](ct_)
            return d_x, d_w

        split = SplitBackward(backward, layers, x, ct)
        out["bytes"] = boundary_bytes(split)
        d_x, bound = split.b(layers, x, ct)
        d_w = split.w(bound)
        ref_x, ref_w = backward(layers, x, ct)
        errs = [
            jnp.max(jnp.abs(a - r)) / jnp.maximum(jnp.max(jnp.abs(r)), 1e-30)
            for a, r in zip(jax.tree.leaves((d_x, d_w)), jax.tree.leaves((ref_x, ref_w)))
        ]
        return jax.lax.pmax(jnp.stack(errs), tuple(plan.mesh.axis_names))

    run = jax.jit(
        jax.shard_map(
            body,
            mesh=plan.mesh,
            in_specs=(plan.specs["params"], plan.batch_sharding.spec),
            out_specs=P(),
            check_vma=False,
        )
    )
    return np.asarray(run(state["params"], batch)), out["bytes"], plan


@pytest.mark.parametrize("case", sorted(CASES))
def test_b_then_w_equals_backward(case):
    errs, n_bytes, plan = _split_vs_unsplit(CASES[case])
    assert n_bytes > 0  # W reads a boundary: the two passes really are two
    assert errs.max() <= REL, (case, errs)
    if case.startswith("tensor"):
        assert plan.mesh_shape["tensor"] == 2 and plan.tensor_parallel.sequence_parallel == (case == "tensor-sp")
    else:
        assert plan.mesh_shape["fsdp"] == 2


BOUNDARY_LAYOUTS = {  # name: (devices on tensor, overrides)
    "tensor1": (1, ("mesh.tensor=1",)),
    "tensor2": (2, ("mesh.tensor=2", "tensor.sequence_parallel=false")),
    "tensor2-sp": (2, ("mesh.tensor=2", "tensor.sequence_parallel=true")),
}


def _traced_boundary_bytes(overrides, t: int, seq: int, b: int = 2, dtype=jnp.float32) -> tuple[int, object]:
    """(bytes of the boundary of the plan's 2-layer stack as the schedule splits it, from the stash of residuals
    and from the chunk input with pipeline.recompute, which must agree; the plan), traced inside the step's
    shard_map (no compile)."""
    plan = make_plan(
        [*FP32, "mesh.data=1", "mesh.fsdp=1", "model.n_layers=2", f"data.seq_len={seq}", *overrides], jax.devices()[:t]
    )
    sizes = []

    def body(params, mb):
        parts = stage_parts(plan, params, plan.loss_fn)
        layers, _ = split_stack(params)
        rows = seq // t if plan.tensor_parallel.sequence_parallel else seq
        x = jnp.zeros((b, rows, plan.cfg.model.d_model), dtype)
        sizes.extend(boundary_bytes(split_stage_backward(parts, layers, x, mb, r)[1]) for r in (False, True))
        return jnp.zeros(())

    batch = device_batch(plan, host_batch([seq] * b, seq, seed=0))
    run = jax.shard_map(
        body,
        mesh=plan.mesh,
        in_specs=(plan.specs["params"], plan.batch_sharding.spec),
        out_specs=P(),
        check_vma=False,
    )
    jax.eval_shape(run, abstract_state(plan)["params"], batch)
    assert sizes[0] == sizes[1], sizes
    return sizes[0], plan


@pytest.mark.parametrize("remat", ["none", "dots", "full"])
def test_boundary_formula(remat):
    """The boundary of a dense stack of 2 layers (D 64, F 192, 4 heads, 2 KV heads, 2 sequences of 8 and of 32
    tokens: the attention probabilities grow as s^2) against the planner's per-layer formula
    (`jaxpar.analysis.planner.plan._boundary_bytes`), at tensor 1 and 2, with and without sequence parallelism:
    equal to the byte."""
    from jaxpar.analysis.planner.dims import dims
    from jaxpar.analysis.planner.plan import _boundary_bytes

    shape = ("model.d_model=64", "model.d_ff=192", "model.n_heads=4", "model.n_kv_heads=2", f"model.remat={remat}")
    for (name, (t, layout)), seq in itertools.product(BOUNDARY_LAYOUTS.items(), (8, 32)):
        traced, plan = _traced_boundary_bytes([*shape, "train.global_batch_size=2", *layout], t, seq)
        d = dims(plan.cfg, "cpu")
        assert (d.b, d.s) == (2, seq) and d.sp == name.endswith("sp")
        assert traced == 2 * _boundary_bytes(plan.cfg, d), (name, seq, traced)


def test_fp8_quantisation_of_a_gathered_input_is_redone_in_w(monkeypatch):
    """Under sequence parallelism FP8 quantises the all-gathered block input (s rows) where W needs it: W redoes the
    gather and the quantisation from the s/t-row bf16 slice and the scale (`_REDO_WITH_SCALARS`) rather than keep
    the s FP8 rows, t/2 times the slice's bytes. Measured at tensor 4, bf16, remat full: FP8's boundary 96,408 bytes
    against bf16's 114,688, and 137,312 without the rule (ZB-V's llama_70b at 16 layers: 13.0 GB of temporaries
    with FP8 against bf16's 10.0 GB before it, 9.4 GB after)."""
    import jaxpar.parallel.split_backward as split_backward

    shape = ("model.d_model=64", "model.d_ff=192", "model.n_heads=4", "model.n_kv_heads=4", "train.global_batch_size=2")
    layout = ("precision.compute_dtype=bfloat16", "mesh.tensor=4", "tensor.sequence_parallel=true")

    def boundary(fp8: bool) -> int:
        overrides = [*shape, *layout, "model.remat=full", f"precision.fp8.enabled={str(fp8).lower()}"]
        return _traced_boundary_bytes(overrides, 4, 32, dtype=jnp.bfloat16)[0]

    bf16, fp8 = boundary(False), boundary(True)
    assert fp8 < bf16, (fp8, bf16)
    monkeypatch.setattr(split_backward, "_REDO_WITH_SCALARS", frozenset())
    assert boundary(True) > bf16


def test_skipped_rows_split_like_the_layers():
    """A layer scan whose rows sit in a `lax.cond` (the padding skip of an uneven pipeline split,
    `jaxpar.model.stack.active_rows`) splits through the cond: W computes the weight gradients from the same
    boundary as the scan without the cond (per row, the layer branch's; the skipped branch adds nothing), and the
    skipped row's gradients are zero. Pure jax on one device; both sides run the same equations, so bitwise."""

    def layer(x, w):
        return jnp.tanh(x @ w["a"]) @ w["b"] + x

    body = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)

    def skipping(ws, x, mask):
        def row(x, xs):
            w, keep = xs
            return jax.lax.cond(keep > 0, body, lambda x, w: x, x, w), None

        return jax.lax.scan(row, x, (ws, mask))[0]

    def plain(ws, x):
        return jax.lax.scan(lambda x, w: (body(x, w), None), x, ws)[0]

    keys = jax.random.split(jax.random.key(0), 3)
    ws = {"a": jax.random.normal(keys[0], (3, 4, 5)), "b": jax.random.normal(keys[1], (3, 5, 4))}
    x = jax.random.normal(keys[2], (2, 4))
    d = jnp.ones((2, 4))

    def split_of(fn):
        _, vjp_fn = jax.vjp(fn, ws, x)
        return SplitBackward(lambda d_: vjp_fn(d_)[::-1], d), lambda d_: vjp_fn(d_)[::-1]

    split, backward = split_of(lambda w, y: skipping(w, y, jnp.array([1.0, 0.0, 1.0])))
    d_x, bound = split.b(d)
    d_w = split.w(bound)
    want_x, want_w = backward(d)
    np.testing.assert_array_equal(d_x, want_x)
    for k in ("a", "b"):
        np.testing.assert_array_equal(d_w[k], want_w[k])
        assert np.all(np.asarray(d_w[k][1]) == 0) and np.any(np.asarray(d_w[k][0]) != 0)
    assert all(a.shape[1:] != (4, 5) and a.shape[1:] != (5, 4) for a in split.boundary_avals), "W must compute"
    unsplit_cond, _ = split_of(plain)
    assert boundary_bytes(split) == boundary_bytes(unsplit_cond) > 0
