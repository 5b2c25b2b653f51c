"""Pipeline schedules inside one SPMD program over the `pipeline` mesh axis (inside shard_map): a stage's parts and
what every schedule shares, GPipe, the pipelined forward, and interleaving's layer placement.

Shape letters: b rows of one microbatch on a device, T' the activations' sequence length (T, or T/t under sequence
parallelism); p stages, v virtual stages per device, m microbatches. Indices (not sizes): s a stage, i a
microbatch, c a model chunk (0 .. pv - 1), j a chunk's slot on its device.

Every stage runs the same program in lockstep clock ticks; `ppermute` moves activations to the next stage and
gradients to the previous one. A stage is split into three parts (`StageParts`): the embedding, run only by the
first stage, the stage's blocks, run by every stage, and the head and loss, run only by the last stage. "Only"
means only: the edge parts sit in `jax.lax.cond` branches on the stage index (`jax.lax.axis_index("pipeline")`),
so the other stages skip them rather than computing and discarding them. A branch may hold collectives over
`tensor`, `fsdp` and `data` (every member of such a group is the same stage and takes the same branch), never
over `pipeline`.

1F1B and interleaved 1F1B, whose backward runs in the same ticks as the forward: `jaxpar.parallel.pipeline_1f1b`.

GPipe (Huang et al. 2019): the forward of all microbatches over m + p - 1 ticks (`forward_loss`), then the
backward by automatic differentiation of that loop, which keeps every microbatch's residuals: memory grows
with m. `forward_loss` alone is the pipelined evaluation.

Loss terms inside the stages (`StageParts.blocks_loss`; e.g. a mixture-of-experts block's auxiliary losses,
`jaxpar.training.moe_loss`): the loss is then sum_i (head_i + sum_s aux_{s,i}) x loss_scale, aux_{s,i} the term
of stage s's blocks on microbatch i. Each stage adds its own terms to its loss in the microbatch's forward tick,
and its backward seeds the blocks' vjp with (d_h, loss_scale): d aux_{s,i} / d(stage weights) joins the weight
gradient and d aux_{s,i} / d(stage input) the gradient sent to the previous stage, where it adds to the head's.
Their non-differentiated statistics are summed per stage and chunk. Without it the schedules run exactly the
blocks' forward and backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpar.config.mesh_axes import PIPELINE

AXIS = PIPELINE


@dataclasses.dataclass(frozen=True)
class StageParts:
    """The three parts of a pipeline stage.

    `edge` is the parameters outside the layer stack (embedding, final norm, head), the same tree on every
    stage; `layers` this stage's share of the stacked layers; `mb` one microbatch (a dict of [b, ...] arrays).

    Attributes:
      embed: (edge, mb) -> activations [b, T', D] in the activation dtype; run on the first stage only.
      blocks: (layers, x [b, T', D], mb) -> [b, T', D]; run on every stage. With `blocks_loss`:
        (layers, x, mb) -> (h [b, T', D], loss, stats), see there.
      head: (edge, h [b, T', D], mb) -> the microbatch's summed loss, fp32 scalar; run on the last stage only.
      edge_gathered: whether embed or head gather edge parameters with collectives that depend on the weights
        alone (fsdp all-gathers); `forward_loss` then keeps those in tick order at the cost of one add over the
        edge parameters per tick.
      blocks_loss: whether the blocks add their own terms to the loss (e.g. the mixture-of-experts auxiliary
        losses, `jaxpar.training.moe_loss`). Then `blocks` also returns `loss`, an fp32 scalar summed over the
        microbatch's rows like the head's loss: the schedules multiply it by `loss_scale`, add it to the
        stage's loss and differentiate it through the stage's own layers and input (the backward's cotangent
        is (d_h, loss_scale)); and `stats`, a pytree of fp32 arrays (not differentiated) that the schedules
        sum over the stage's valid microbatches, one sum per model chunk (leaves [v, ...], chunk order as
        the layers). False: the schedules run exactly the blocks' forward and backward, nothing more.
      head_vocab: for the vocabulary-parallel head (`pipeline.vocab_parallel`; 1F1B): (edge, h [b, T', D], mb)
        -> this stage's summed loss over its 1/p of the vocabulary, fp32, the softmax normaliser all-reduced over
        `pipeline` inside; run by every stage on the last stage's output. None: the head runs on the last stage.
      order_collectives: whether the schedules fix one order of their collectives by data dependencies
        (`ordered_after`; `needs_collective_order` of the mesh's platform). False on GPUs, which issue
        collectives in schedule order: there the forward permute of a tick is free to run under the tick's
        backward.
    """

    embed: Callable
    blocks: Callable
    head: Callable
    edge_gathered: bool = True
    blocks_loss: bool = False
    order_collectives: bool = True
    head_vocab: Callable | None = None

    def after(self, tree, deps):
        """`ordered_after(tree, deps)` where the platform needs one collective order (`order_collectives`),
        else `tree` itself."""
        return ordered_after(tree, deps) if self.order_collectives else tree


def needs_collective_order(platform: str) -> bool:
    """Whether a pipeline schedule on devices of `platform` ("cpu", "gpu", "tpu") must order its collectives
    by data dependencies (`ordered_after`).

    XLA:CPU runs a device's program as a dataflow graph and starts independent collectives in whatever order
    their operands become ready, which differs between devices and deadlocks (module docstring of
    `jaxpar.analysis.hlo.collective_order`). GPUs and TPUs issue each device's collectives in the order of the
    compiled schedule, the same on every device, so the dependencies would only serialise the permutes behind
    the compute that XLA's latency-hiding scheduler could run under them.
    """
    return platform == "cpu"


def blocks_forward(parts: StageParts, w, x, mb):
    """The blocks' forward: (h, loss or None, stats or {})."""
    if parts.blocks_loss:
        return parts.blocks(w, x, mb)
    return parts.blocks(w, x, mb), None, {}


def blocks_vjp(parts: StageParts, w, x, mb):
    """The blocks' forward and backward function: (h, loss or None, stats or {}, vjp_fn); vjp_fn takes
    `blocks_cotangent`'s output."""
    if not parts.blocks_loss:
        h, vjp_fn = jax.vjp(lambda w_, y: parts.blocks(w_, y, mb), w, x)
        return h, None, {}, vjp_fn

    def split(w_, y):
        h, loss, stats = parts.blocks(w_, y, mb)
        return (h, loss.astype(jnp.float32)), stats

    (h, loss), vjp_fn, stats = jax.vjp(split, w, x, has_aux=True)
    return h, loss, stats, vjp_fn


def blocks_cotangent(parts: StageParts, d_h: jax.Array, d_loss: jax.Array):
    """The blocks' output cotangent for `blocks_vjp`'s function: d_h [b, T', D], and with `blocks_loss` the
    loss's (its scale, 0 for a masked slot), fp32."""
    return (d_h, d_loss.astype(jnp.float32)) if parts.blocks_loss else d_h


def zero_stats(parts: StageParts, w, x, mb, v: int):
    """Per-chunk accumulators of the blocks' stats: zeros, each leaf [v, ...] fp32 ({} without
    `blocks_loss`). Traces the blocks abstractly (no device work)."""
    if not parts.blocks_loss:
        return {}
    shapes = jax.eval_shape(lambda: parts.blocks(w, x, mb)[2])
    return jax.tree.map(lambda a: jnp.zeros((v, *a.shape), jnp.float32), shapes)


def add_stats(acc, stats, j, valid):
    """`acc` (`zero_stats`' accumulators) with one microbatch's blocks' `stats` added into chunk j's row, zero
    for a masked (out-of-range) slot (`valid` False)."""

    def one(a, x):
        x = jnp.where(valid, x.astype(jnp.float32), 0.0)
        return jax.lax.dynamic_update_index_in_dim(a, a[j] + x, j, 0)

    return jax.tree.map(one, acc, stats)


def chunk_rows_in_model_order(rows: jax.Array, p: int, placement: tuple[int, ...] | None = None) -> jax.Array:
    """Per-chunk rows of one stage, [v, n, ...] in chunk order (row j: this device's j-th chunk, model chunk
    j*p + s of stage s on the interleaved ring, or as `placement` puts them, `chunk_routes`; e.g. one row per
    layer of the chunk), placed at their model positions in a zero array [p*v*n, ...]: the sum over `pipeline`
    (psum) of the stages' results is every layer's rows in model order. Inside the shard_map."""
    s = jax.lax.axis_index(AXIS)
    v, n = rows.shape[:2]
    placement = tuple(c % p for c in range(p * v)) if placement is None else tuple(placement)
    model_chunk = [[c for c in range(p * v) if placement[c] == d] for d in range(p)]  # [p][v]: chunk of (s, j)
    table = jnp.asarray(model_chunk, jnp.int32)
    out = jnp.zeros((p * v * n, *rows.shape[2:]), rows.dtype)
    for j in range(v):
        out = jax.lax.dynamic_update_slice_in_dim(out, rows[j], table[s, j] * n, axis=0)
    return out


def microbatch(mbs: dict, i: jax.Array, m: int) -> dict:
    """Microbatch i of `mbs` (leaves [m, b, ...]) as leaves [b, ...]; i is clipped to 0 .. m - 1 (a tick whose
    microbatch is out of range computes on a valid one and masks the result)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, jnp.clip(i, 0, m - 1), keepdims=False), mbs)


def shift(x: jax.Array, p: int, forward: bool, ring: bool = False) -> jax.Array:
    """`x` permuted over `pipeline` (`ppermute`): activations to stage s+1 (`forward`) or gradients to stage s-1
    (backward). Without `ring` the stage with no sender receives zeros; with it the last stage sends to the first
    (forward; the first to the last backward): interleaved 1F1B's chunk (p-1) + jp feeds chunk (j+1)p on device
    0."""
    n = p if ring else p - 1
    pairs = [(i, (i + 1) % p) for i in range(n)] if forward else [((i + 1) % p, i) for i in range(n)]
    return jax.lax.ppermute(x, AXIS, pairs)


def ordered_after(tree, deps):
    """`tree` unchanged in value, but computed from `deps` too: whatever uses the result starts after every
    array in `deps` is ready.

    Why: in a 1F1B tick the forward of one microbatch and the backward of another are independent, and so are
    the two permutes, so nothing in the data flow orders their collectives; the compiler's schedule does, and
    XLA:CPU only keeps the order in which collectives *start*. A collective scheduled after a loop of
    collectives that it does not depend on can start while the loop runs, so devices issue them in different
    orders; each in-process collective blocks a thread of one pool shared by all devices, and the step
    deadlocks (seen on 16 simulated devices). A data dependency fixes one order on every device and backend
    (`jaxpar.analysis.hlo.collective_order` checks a compiled program for such pairs). `jax.lax.optimization_barrier`
    does not: XLA:CPU compiles it to nothing.

    Cost: one element read from each array in `deps` and one add per leaf of `tree`. The added term is exactly
    0 (and 0 for a non-finite element too, so a NaN does not spread into `tree`).
    """

    def first(a):
        return jnp.ravel(a)[0].astype(jnp.float32)

    probe = sum(first(a) for a in jax.tree.leaves(deps))
    zero = jnp.where(jnp.isfinite(probe), probe * 0.0, 0.0)
    return jax.tree.map(lambda x: x + zero.astype(x.dtype), tree)


def add32(acc, g):
    """`acc` + `g` leaf by leaf, `g` cast to fp32 first (the schedules' fp32 gradient sums)."""
    return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, g)


def chunk_routes(
    p: int, v: int, placement: tuple[int, ...] | None = None
) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """{(b, j): [(source device, destination device)]}: model chunk c (c = 0 .. pv - 1, L/(pv) layers each) sits
    on device c // v at local position b = c mod v in model order, and goes to device `placement[c]` (default
    c mod p, the interleaved ring), slot j = its rank among the chunks placed on that device (c // p on the
    ring). For a fixed (b, j) the sources differ and so do the destinations: one `ppermute` each."""
    placement = tuple(c % p for c in range(p * v)) if placement is None else tuple(placement)
    routes: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for c in range(p * v):
        j = sum(1 for k in range(c) if placement[k] == placement[c])
        routes.setdefault((c % v, j), []).append((c // v, placement[c]))
    return routes


def to_chunk_order(layers, p: int, v: int, placement: tuple[int, ...] | None = None):
    """This device's layer stack in model order (leaves [L/p, ...]: layers s*L/p .. (s+1)*L/p - 1) -> in chunk
    order (model chunks s, p + s, .., (v-1)p + s of L/(pv) layers each; with a `placement` (`chunk_routes`) the
    chunks placed on the device, in model order), as `jaxpar.parallel.pipeline_1f1b.one_f_one_b` with v virtual
    stages takes it; identity for v = 1. Inside the shard_map.

    Cost: every layer leaf crosses the pipeline axis once, as v^2 `ppermute`s of one chunk each (a chunk that
    stays on its device is a permute to itself), run one after the other (`ordered_after`: a fixed collective order).
    Storing the parameters in model order keeps checkpoints independent of v and p; this is the price.
    """
    return _route(layers, p, v, inverse=False, placement=placement)


def from_chunk_order(grads, p: int, v: int, placement: tuple[int, ...] | None = None):
    """The inverse of `to_chunk_order` (for the gradients)."""
    return _route(grads, p, v, inverse=True, placement=placement)


def _route(tree, p: int, v: int, inverse: bool, placement: tuple[int, ...] | None = None):
    if v == 1:
        return tree
    routes = chunk_routes(p, v, placement)
    leaves, treedef = jax.tree.flatten(tree)
    out: list[jax.Array] = []
    prev: list[jax.Array] = []  # the last permute, which the next one is ordered after
    for a in leaves:
        parts = a.reshape(v, a.shape[0] // v, *a.shape[1:])
        result: list = [None] * v
        for (b, j), pairs in sorted(routes.items()):
            src, dst = (j, b) if inverse else (b, j)
            piece = ordered_after(parts[src], prev) if prev else parts[src]
            moved = jax.lax.ppermute(piece, AXIS, [(d, s) for s, d in pairs] if inverse else pairs)
            prev = [moved]
            result[dst] = moved if result[dst] is None else result[dst] + moved
        out.append(jnp.concatenate(result, axis=0))
    return jax.tree.unflatten(treedef, out)


def forward_loss(
    parts: StageParts,
    layers: dict,
    edge: dict,
    mbs: dict,
    *,
    p: int,
    m: int,
    act_shape: tuple[int, ...],
    act_dtype,
    loss_scale: jax.Array | float = 1.0,
) -> tuple[jax.Array, dict]:
    """The forward of all m microbatches through the pipeline in m + p - 1 ticks: (this stage's summed loss
    times `loss_scale`, fp32 scalar: the head's on the last stage plus, with `parts.blocks_loss`, the stage's
    blocks' terms; the blocks' stats summed over the microbatches, leaves [1, ...], {} without
    `parts.blocks_loss`). GPipe's forward, and the pipelined evaluation. Same arguments as
    `jaxpar.parallel.pipeline_1f1b.one_f_one_b`."""
    s = jax.lax.axis_index(AXIS)
    is_first, is_last = s == 0, s == p - 1

    def tick(carry, k, head: bool, layers):
        recv, loss_acc, stats_acc = carry
        # The edge parts' collectives (inside their conds) in tick order (`ordered_after`, also under autodiff): this
        # tick's embedding after the previous tick's permute, its head after its blocks, the permute after the
        # head. With `parts.edge_gathered` the edge parameters carry the dependency too (one add over them per
        # tick), so that no part of a cond (e.g. autodiff's weight-only half of the embedding: the fsdp gather
        # of the table) is loop-invariant and hoisted out of the tick order. (A predicate made to depend on the
        # activations would do it for free, but then no HLO reader can tell which stage takes which branch.)
        mb = parts.after(microbatch(mbs, k - s, m), recv)
        edge_e = parts.after(edge, recv) if parts.edge_gathered else edge
        x = jax.lax.cond(is_first, lambda: parts.embed(edge_e, mb).astype(act_dtype), lambda: recv)
        # Warm-up ticks (p - 1, few enough that XLA may unroll them) also order the blocks' weight-only work
        # after the embedding: autodiff splits it out of the layer scan, and the weight gathers over fsdp in it
        # would otherwise be free to start before or after the embedding's cond. (In the head ticks' loop
        # that work is loop-invariant and XLA hoists it out, once per step.)
        h, b_loss, b_stats = blocks_forward(parts, layers if head else parts.after(layers, x), x, mb)
        if parts.blocks_loss:  # stage s runs microbatch k - s: valid for 0 <= k - s < m
            valid = (k >= s) & (k - s < m)
            loss_acc = loss_acc + jnp.where(valid, b_loss * loss_scale, 0.0)
            stats_acc = add_stats(stats_acc, b_stats, 0, valid)
        if head:  # the last stage's microbatch k - (p - 1) is valid in exactly these ticks
            edge_h = parts.after(edge, h) if parts.edge_gathered else edge
            loss = jax.lax.cond(
                is_last,
                lambda: parts.head(edge_h, h, mb).astype(jnp.float32) * loss_scale,
                lambda: jnp.zeros((), jnp.float32),
            )
            loss_acc = loss_acc + loss
            h = parts.after(h, loss)
        return (shift(h, p, forward=True), loss_acc, stats_acc), None

    zeros_act = jnp.zeros(act_shape, act_dtype)
    stats0 = zero_stats(parts, layers, zeros_act, microbatch(mbs, jnp.int32(0), m), 1)
    carry = (zeros_act, jnp.zeros((), jnp.float32), stats0)
    # Two static loops: ticks before the last stage's first microbatch (no head anywhere), then the m ticks
    # in which the last stage runs the head.
    if p > 1:
        carry, _ = jax.lax.scan(lambda c, k: tick(c, k, False, layers), carry, jnp.arange(0, p - 1))
    # The head ticks' weight-only work (the fsdp gathers of the stage's layers), which XLA hoists out of their
    # loop, after the warm-up ticks, whose embedding cond it would otherwise not depend on.
    head_layers = parts.after(layers, carry[0]) if p > 1 else layers
    carry, _ = jax.lax.scan(lambda c, k: tick(c, k, True, head_layers), carry, jnp.arange(p - 1, m + p - 1))
    return carry[1], carry[2]


def gpipe(
    parts: StageParts,
    layers: dict,
    edge: dict,
    mbs: dict,
    *,
    p: int,
    m: int,
    act_shape: tuple[int, ...],
    act_dtype,
    loss_scale: jax.Array,
    recompute: bool = False,
    virtual_stages: int = 1,
) -> tuple[tuple[dict, dict], jax.Array, dict]:
    """Runs GPipe: forward of all m microbatches in m + p - 1 ticks (`forward_loss`), backward by autodiff of
    that loop. Same arguments and results as `jaxpar.parallel.pipeline_1f1b.one_f_one_b`; `recompute` is not
    read (autodiff keeps every tick's residuals).

    Raises:
      ValueError: `virtual_stages` > 1 (interleaving is a 1F1B schedule here; the config refuses it first).
    """
    del recompute
    if virtual_stages != 1:
        raise ValueError(f"GPipe runs one stage per device, not virtual_stages={virtual_stages}")
    (loss, stats), grads = jax.value_and_grad(
        lambda lay, e: forward_loss(
            parts, lay, e, mbs, p=p, m=m, act_shape=act_shape, act_dtype=act_dtype, loss_scale=loss_scale
        ),
        argnums=(0, 1),
        has_aux=True,
    )(layers, edge)
    return jax.tree.map(lambda g: g.astype(jnp.float32), grads), loss, stats
