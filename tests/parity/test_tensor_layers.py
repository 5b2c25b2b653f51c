"""Each tensor-parallel building block on t = 2 and 4 ranks equals the unsharded block (fp32, 1e-5 relative).

Blocks: `column_parallel` and `row_parallel` (with and without bias), `Attention` (multi-head and grouped-query),
`SwiGLU`, `Embed` (vocab-parallel lookup and the tied-logits `attend`), `LMHead`, and the vocab-parallel
`TensorParallel.cross_entropy_sum`; each with and without sequence parallelism. Compared: the output and the
gradients of sum(output * cotangent) with a fixed random cotangent, with respect to the input and every weight.

The sharded side runs in a `jax.shard_map` over a 1-D `tensor` mesh of t CPU devices: inputs [B, T, D] are split
over T with sequence parallelism and replicated without; weights are split as their logical axes say (`heads`,
`mlp`, `vocab` over `tensor`, like `jaxpar.parallel.sharding.PARAM_RULES`). Gradients are taken inside the shard_map, as
`jaxpar.training.step.make_grad_fn` takes them: that is the convention the custom VJPs in `jaxpar.parallel.tensor`
implement (Megatron's f and g). Differentiating the shard_map from outside instead, with `check_vma=False`,
would add shard_map's own transpose collectives (a psum of every replicated input's cotangent, a division of
every replicated output's by t) on top of them.

Every replicated result (an output, or a gradient of a replicated argument) comes back once per rank, so each
rank's copy is checked. Under sequence parallelism a weight replicated over `tensor` (the row-parallel bias)
receives on each rank the gradient of its sequence slice only; the train step sums those over `tensor`
(`jaxpar.training.grad_reduction.reduce_replicated`), and so does the check here.

Shape letters: B batch, T sequence, D model width, F hidden width, H query heads, G key/value heads,
K head width, V vocabulary, t tensor size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from step_helpers import FP32_RTOL, assert_tree_close, compile_fast

from jaxpar.model.layers import Attention, Embed, LMHead, SwiGLU
from jaxpar.parallel.tensor import NO_TENSOR_PARALLEL, TensorParallel, column_parallel, row_parallel

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

RTOL = FP32_RTOL  # fp32, one module on reordered sums: no worse conditioned than a whole model
B, T, D, F, V = 2, 8, 16, 32, 16
HEAD_DIM = 4
TENSOR_LOGICAL = ("heads", "mlp", "vocab")  # logical axes split over `tensor` (jaxpar.parallel.sharding.PARAM_RULES)
SEQ = P(None, "tensor", None)  # [B, T, D] split over T on tensor (sequence parallelism)
OUT_FEATURES = P(None, None, "tensor")  # [B, T, F/t] or logits [B, T, V/t]
SIZES_SP = [pytest.param(t, sp, id=f"t{t}-{'sp' if sp else 'nosp'}") for t in (2, 4) for sp in (False, True)]


def _on_tensor(spec: P) -> bool:
    return "tensor" in tuple(spec)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _act_spec(sp: bool) -> P:
    """The spec of a block's input and output [B, T, D]."""
    return SEQ if sp else P()


def _local_shape(shape: tuple[int, ...], spec: P, t: int) -> tuple[int, ...]:
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    return tuple(n // t if e == "tensor" else n for n, e in zip(shape, entries))


def _normal(seed: int, *shape: int, std: float = 1.0) -> jax.Array:
    return jnp.asarray(std * np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _per_rank(specs, tree):
    """(values, out_specs): a replicated value gets a new leading axis split over tensor, so that every rank's
    copy comes back out of the shard_map instead of only one."""
    vals = jax.tree.map(lambda s, x: x if _on_tensor(s) else x[None], specs, tree, is_leaf=_is_spec)
    outs = jax.tree.map(lambda s: s if _on_tensor(s) else P("tensor", *s), specs, is_leaf=_is_spec)
    return vals, outs


def run_sharded(fn: Callable, args: Sequence, specs: Sequence, out_spec: P, ct, t: int, sp: bool, n_diff: int):
    """Runs `fn(tp, *args)` on t ranks; returns (out, grads, local_shapes).

    Inside the shard_map each rank differentiates sum(local out * local cotangent) with respect to its local
    `args[:n_diff]` (sharded args: this rank's shard; replicated args: the whole array). Replicated results come
    back stacked per rank ([t, ...]); `local_shapes` lists the shapes of the args' leaves as the body saw them
    (recorded at trace time).
    """
    tp = TensorParallel(size=t, sequence_parallel=sp)
    mesh = jax.make_mesh((t,), ("tensor",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:t])
    seen = []
    diff_specs = tuple(specs[:n_diff])

    def body(ct_local, *local):
        seen.append([x.shape for x in jax.tree.leaves(local)])

        def scalar(*diff):
            out = fn(tp, *diff, *local[n_diff:])
            return jnp.sum(out * ct_local), out

        grads, out = jax.grad(scalar, argnums=tuple(range(n_diff)), has_aux=True)(*local[:n_diff])
        return _per_rank(out_spec, out)[0], _per_rank(diff_specs, grads)[0]

    _, out_specs = _per_rank(out_spec, ct)
    _, grad_specs = _per_rank(diff_specs, tuple(args[:n_diff]))
    sharded = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(out_spec, *specs), out_specs=(out_specs, grad_specs), check_vma=False)
    )
    out, grads = compile_fast(sharded, ct, *args)(ct, *args)
    assert len(seen) == 1
    return out, grads, seen[0]


def reference(fn: Callable, args: Sequence, ct, n_diff: int):
    """The unsharded block on one device (size-1 `TensorParallel`: no collective): (out, grads)."""

    def scalar(*diff):
        out = fn(NO_TENSOR_PARALLEL, *diff, *args[n_diff:])
        return jnp.sum(out * ct), out

    ref = jax.jit(jax.grad(scalar, argnums=tuple(range(n_diff)), has_aux=True))
    grads, out = compile_fast(ref, *args[:n_diff])(*args[:n_diff])
    return out, grads


def check_block(
    fn: Callable, args: Sequence, specs: Sequence, out_spec: P, t: int, sp: bool, n_diff: int, seed: int = 99
):
    """Sharded against unsharded: the output and the gradients of every differentiable argument; the args
    with a `tensor` dimension really are split (the body saw 1/t of that dimension). Returns the sharded
    output (global) for further checks."""
    ct = _ct(fn, args, seed)
    ref_out, ref_grads = reference(fn, args, ct, n_diff)
    out, grads, local_shapes = run_sharded(fn, args, specs, out_spec, ct, t, sp, n_diff)

    split = 0
    for (path, x), spec, local in zip(
        jax.tree_util.tree_flatten_with_path(tuple(args))[0],
        jax.tree.leaves(tuple(specs), is_leaf=_is_spec),
        local_shapes,
        strict=True,
    ):
        name = jax.tree_util.keystr(path)
        assert local == _local_shape(x.shape, spec, t), f"{name}: local {local} for global {x.shape}, {spec}"
        if _on_tensor(spec):
            assert local != x.shape, name
            split += 1
    assert split > 0, "nothing was split over tensor: the comparison would test no parallelism"

    # Outputs: a split one compares as a whole; a replicated one rank by rank.
    if _on_tensor(out_spec):
        assert_tree_close(out, ref_out, RTOL)
    else:
        assert out.shape == (t, *ref_out.shape)
        for rank in range(t):
            assert_tree_close(out[rank], ref_out, RTOL)
    for spec, g, ref_g in zip(specs[:n_diff], grads, ref_grads, strict=True):
        for (_path, gx), s, rx in zip(
            jax.tree_util.tree_flatten_with_path(g)[0],
            jax.tree.leaves(spec, is_leaf=_is_spec),
            jax.tree.leaves(ref_g),
            strict=True,
        ):
            if _on_tensor(s):
                assert_tree_close(gx, rx, RTOL)
            elif sp:  # a tensor-replicated weight under sequence parallelism: per-rank partials, summed
                assert gx.shape == (t, *rx.shape)
                assert_tree_close(np.sum(np.asarray(gx, np.float64), axis=0), rx, RTOL)
            else:  # replicated input or weight: every rank holds the whole gradient
                assert gx.shape == (t, *rx.shape)
                for rank in range(t):
                    assert_tree_close(gx[rank], rx, RTOL)
    return out


def _ct(fn: Callable, args: Sequence, seed: int) -> jax.Array:
    """A fixed random cotangent shaped like the block's output."""
    out = jax.eval_shape(lambda *a: fn(NO_TENSOR_PARALLEL, *a), *args)
    return _normal(seed, *out.shape)


# --- modules: NNX state as a pure dict, split as its logical axes say, bound back inside the body ---


def module_parts(make: Callable[[], nnx.Module], std: float, seed: int):
    """(graphdef, abstract state, params as a pure dict, params' PartitionSpecs) of the module `make` builds.

    The module is built abstractly and its weights drawn with numpy (normal, `std`): eager `jax.random` would
    compile a sampler per weight shape, which costs more than the test.
    """
    graphdef, template = nnx.split(nnx.eval_shape(make))
    shapes = nnx.to_pure_dict(template)
    leaves, treedef = jax.tree.flatten(shapes)
    params = jax.tree.unflatten(treedef, [_normal(seed + i, *x.shape, std=std) for i, x in enumerate(leaves)])
    specs = jax.tree.map(
        lambda v: P(*("tensor" if a in TENSOR_LOGICAL else None for a in v.get_metadata()["logical_axes"])),
        template,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return graphdef, template, params, nnx.to_pure_dict(specs)


def bind(graphdef, template, params: dict) -> nnx.Module:
    """The module holding `params` (whole or this rank's shards), as `jaxpar.model.ModelDef.bind` does."""
    state = jax.tree.map(lambda v: v, template, is_leaf=lambda x: isinstance(x, nnx.Variable))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


# --- column- and row-parallel linears ---


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("t,sp", SIZES_SP)
def test_column_parallel(t, sp, bias):
    x_BTD, w_DF, b_F = _normal(1, B, T, D), _normal(2, D, F, std=0.3), _normal(3, F)
    args, specs = (x_BTD, w_DF), (_act_spec(sp), P(None, "tensor"))
    if bias:
        args, specs = args + (b_F,), specs + (P("tensor"),)

    def fn(tp, x, w, b=None):
        return column_parallel(x, w, b, tp)

    out = check_block(fn, args, specs, OUT_FEATURES, t, sp, n_diff=len(args))
    np.testing.assert_allclose(out, x_BTD @ w_DF + (b_F if bias else 0), rtol=RTOL, atol=RTOL)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("t,sp", SIZES_SP)
def test_row_parallel(t, sp, bias):
    h_BTF, w_FD, b_D = _normal(4, B, T, F), _normal(5, F, D, std=0.3), _normal(6, D)
    args, specs = (h_BTF, w_FD), (OUT_FEATURES, P("tensor", None))
    if bias:
        args, specs = args + (b_D,), specs + (P(),)

    def fn(tp, h, w, b=None):
        return row_parallel(h, w, b, tp)

    out = check_block(fn, args, specs, _act_spec(sp), t, sp, n_diff=len(args))
    if not sp:
        out = out[0]  # rank 0's copy; check_block compared every rank's
    if bias:
        # The bias is added once, after the reduction. Added on every rank before the psum (or the
        # reduce-scatter), it would come out as h @ w + t * b.
        expected = h_BTF @ w_FD + b_D
        np.testing.assert_allclose(out, expected, rtol=RTOL, atol=RTOL)
        per_rank = h_BTF @ w_FD + t * b_D
        assert np.max(np.abs(out - per_rank)) > 0.5 * np.max(np.abs(b_D))


# --- transformer modules ---


@pytest.mark.parametrize(
    "t,sp,n_kv_heads",
    [
        pytest.param(t, sp, g, id=f"t{t}-{'sp' if sp else 'nosp'}-G{g}")
        for t, g in ((2, 4), (2, 2), (4, 4))
        for sp in (False, True)
    ],
)
def test_attention(t, sp, n_kv_heads):
    # std 0.3: scores of order 1, so the softmax is far from uniform and the causal mask matters.
    graphdef, template, params, pspecs = module_parts(
        lambda: Attention(
            D, n_heads=4, n_kv_heads=n_kv_heads, head_dim=HEAD_DIM, rope_theta=10_000.0, std=0.3, rngs=nnx.Rngs(0)
        ),
        std=0.3,
        seed=70,
    )
    assert pspecs["wq"] == P(None, "tensor", None) and pspecs["wo"] == P("tensor", None, None)

    def fn(tp, params, x):
        return bind(graphdef, template, params)(x, tp)

    check_block(fn, (params, _normal(8, B, T, D)), (pspecs, _act_spec(sp)), _act_spec(sp), t, sp, n_diff=2)


@pytest.mark.parametrize("t,sp", SIZES_SP)
def test_swiglu(t, sp):
    graphdef, template, params, pspecs = module_parts(lambda: SwiGLU(D, F, std=0.3, rngs=nnx.Rngs(0)), 0.3, 90)
    assert pspecs["w_gate"] == P(None, "tensor") and pspecs["w_down"] == P("tensor", None)

    def fn(tp, params, x):
        return bind(graphdef, template, params)(x, tp)

    check_block(fn, (params, _normal(10, B, T, D)), (pspecs, _act_spec(sp)), _act_spec(sp), t, sp, n_diff=2)


@pytest.mark.parametrize("t,sp", SIZES_SP)
def test_embed_lookup(t, sp):
    graphdef, template, params, pspecs = module_parts(lambda: Embed(V, D, std=1.0, rngs=nnx.Rngs(0)), 1.0, 110)
    assert pspecs["table"] == P("tensor", None)
    # [2B, T] ids: every vocabulary id twice, shuffled, so every rank's rows are looked up and some rows'
    # gradients accumulate over two positions.
    tokens_BT = jnp.asarray(
        np.random.default_rng(12).permutation(np.arange(2 * B * T) % V).reshape(2 * B, T), jnp.int32
    )
    assert len(np.unique(tokens_BT)) == V and tokens_BT.size == 2 * V

    def fn(tp, params, tokens):
        return bind(graphdef, template, params)(tokens, jnp.float32, tp)

    # The token ids are replicated, not differentiated; the output [2B, T/t or T, D] is split like an activation.
    check_block(fn, (params, tokens_BT), (pspecs, P()), _act_spec(sp), t, sp, n_diff=1)


@pytest.mark.parametrize("t,sp", SIZES_SP)
def test_embed_attend(t, sp):
    graphdef, template, params, pspecs = module_parts(lambda: Embed(V, D, std=0.3, rngs=nnx.Rngs(0)), 0.3, 130)

    def fn(tp, params, x):
        return bind(graphdef, template, params).attend(x, tp)

    check_block(fn, (params, _normal(14, B, T, D)), (pspecs, _act_spec(sp)), OUT_FEATURES, t, sp, n_diff=2)


@pytest.mark.parametrize("t,sp", SIZES_SP)
def test_lm_head(t, sp):
    graphdef, template, params, pspecs = module_parts(lambda: LMHead(D, V, std=0.3, rngs=nnx.Rngs(0)), 0.3, 150)
    assert pspecs["kernel"] == P(None, "tensor")

    def fn(tp, params, x):
        return bind(graphdef, template, params)(x, tp)

    check_block(fn, (params, _normal(16, B, T, D)), (pspecs, _act_spec(sp)), OUT_FEATURES, t, sp, n_diff=2)


# --- vocab-parallel cross-entropy ---


@pytest.mark.parametrize("t", [2, 4])
def test_cross_entropy_sum(t):
    """The loss is a replicated scalar; sequence parallelism does not enter (the logits cover the whole T)."""
    # std 3: peaked softmaxes, so the global max differs from each shard's and the pmax shift matters.
    logits_BTV = _normal(17, B, T, V, std=3.0)
    # Targets spread evenly over the vocabulary (ids 0, 1, ..., V - 1 in a shuffled order), so every shard holds some.
    targets_BT = jnp.asarray(
        np.random.default_rng(18).permutation(np.arange(B * T) * V // (B * T)).reshape(B, T), jnp.int32
    )

    mask_BT = jnp.asarray(np.random.default_rng(19).random((B, T)) < 0.7, jnp.float32)
    masked_targets = np.asarray(targets_BT)[np.asarray(mask_BT) == 0]
    assert 0 < masked_targets.size < B * T
    shard_of = np.asarray(targets_BT) // (V // t)
    assert set(shard_of[np.asarray(mask_BT) == 1].tolist()) == set(range(t))  # valid targets in every shard

    def fn(tp, logits, targets, mask):
        return tp.cross_entropy_sum(logits, targets, mask)

    args = (logits_BTV, targets_BT, mask_BT)
    loss = check_block(fn, args, (OUT_FEATURES, P(), P()), P(), t, False, n_diff=1)

    # Independently of TensorParallel: the masked mean of -log softmax[target], here as a sum.
    logp = jax.nn.log_softmax(np.asarray(logits_BTV, np.float64), axis=-1)
    nll = -np.take_along_axis(np.asarray(logp), np.asarray(targets_BT)[..., None], axis=-1)[..., 0]
    expected = float(np.sum(nll * np.asarray(mask_BT)))
    for rank in range(t):
        np.testing.assert_allclose(float(loss[rank]), expected, rtol=RTOL)
