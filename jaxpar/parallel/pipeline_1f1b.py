"""1F1B and interleaved 1F1B inside one SPMD program over the `pipeline` mesh axis (inside shard_map), on the stage
parts and tick helpers of `jaxpar.parallel.pipeline`.

Shape letters: b rows of one microbatch on a device, T' the activations' sequence length (T, or T/t under sequence
parallelism); p stages, v virtual stages per device, m microbatches. Indices (not sizes): s a stage, i a
microbatch, c a model chunk (0 .. pv - 1), j a chunk's slot on its device, `tick` a clock tick.

1F1B (PipeDream-Flush; Narayanan et al. 2021, arXiv 2104.04473, section 2.2) in lockstep: at clock tick `tick`, stage
s runs the forward of microbatch tick - s and the backward of microbatch tick - (2p - 2 - s); the last stage runs each
backward in the tick of its forward, seeded by the head's gradient taken right there (`jax.value_and_grad` of
head and loss with respect to the edge parameters and the stage output). Three static loops -- warm-up (forward
only, p - 1 ticks), steady (forward and backward, m ticks), cool-down (backward only, p - 1 ticks) -- give
m + 2p - 2 ticks, of which the warm-up and cool-down ticks do half the work: (m + p - 1) ticks' worth of
forward + backward of the blocks, the 1F1B bubble (p - 1)/(m + p - 1), and m heads (steady ticks only). Weight
gradients are running sums.

What the backward of a microbatch needs from its forward, `recompute`:
  * True: its stage input [b, T', D], from which the backward rebuilds the blocks' forward (`jax.vjp`): one
    more forward, 4/3 of the blocks' FLOPs. Stash bytes per stage = (2p - 1) x b x T' x D x activation bytes.
  * False: the blocks' residuals from the forward tick (the leaves of the pytree `jax.vjp` returns, minus the
    stage's own weights, which stay put), unflattened with the static tree structure in the backward tick: no
    FLOPs repeated. Stash bytes per stage = (2p - 1) x the residual bytes of one stage-microbatch (what
    `model.remat` keeps for L/p layers of b rows, plus the stage input; with weights gathered over fsdp the
    gathered layer weights are residuals too). `residual_bytes` gives the figure.
A stage input waits 2p - 2 - 2s ticks for its backward, so both stashes are rings of 2p - 1 slots indexed by
microbatch mod 2p - 1, whatever m: memory per stage is flat in m.

Interleaved 1F1B (`virtual_stages` = v > 1; Narayanan et al. 2021, section 2.2.2): the layers split into pv
chunks, chunk c on device c mod p, so a microbatch passes every device v times, one chunk per tick, and the
permutes become rings (device p - 1's chunk feeds device 0's next one). `jaxpar.parallel.schedule` gives the
ticks (m*v + v*p + p - 2, of which v*p - 1 warm-up and v*p - 1 cool-down), which chunk of which microbatch a
device runs in each, and the bubble (p - 1)/(v*m + p - 1); the embedding and head conds select on the chunk as
well as the stage. The stash is a ring of 2pv - 1 slots indexed by forward tick. The parameters stay in model
order (a device holds L/p consecutive layers, as at v = 1); `jaxpar.parallel.pipeline.to_chunk_order` permutes
them into chunk order once per step and `from_chunk_order` the gradients back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar.parallel import schedule
from jaxpar.parallel.jax_private import convert_constvars_jaxpr, dce_jaxpr, eval_jaxpr
from jaxpar.parallel.pipeline import (
    AXIS,
    StageParts,
    add32,
    add_stats,
    blocks_cotangent,
    blocks_forward,
    blocks_vjp,
    microbatch,
    ordered_after,
    shift,
    zero_stats,
)


def one_f_one_b(
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
    recompute: bool,
    virtual_stages: int = 1,
) -> tuple[tuple[dict, dict], jax.Array, dict]:
    """Runs the 1F1B schedule, interleaved over `virtual_stages` model chunks per device when that is > 1;
    returns ((fp32 gradient sums of `layers`, of `edge`), this stage's summed scaled loss, fp32 scalar: the
    head's on the last stage plus, with `parts.blocks_loss`, the stage's blocks' terms; the blocks' stats summed
    over the microbatches, leaves [v, ...] in chunk order, {} without `parts.blocks_loss`).

    Args:
      parts: the stage's parts (`StageParts`).
      layers: this device's local layer parameters, each leaf [L/p, ...]. With v = `virtual_stages` > 1 in chunk
        order (`to_chunk_order`): rows j*L/(pv) .. (j+1)*L/(pv) - 1 are model chunk j*p + s. The gradients come
        back in the same order.
      edge: the local parameters outside the layer stack.
      mbs: microbatches, each leaf [m, b, ...].
      p, m: stages and microbatches (with v > 1, m a multiple of p: `jaxpar.parallel.schedule.check`).
      act_shape, act_dtype: shape [b, T', D] and dtype of the activations passed between stages.
      loss_scale: multiplies each microbatch's loss (1 / global token count), fp32 scalar.
      recompute: rebuild each chunk forward in the backward from the stashed input (True) or keep its
        residuals (False); module docstring.
      virtual_stages: v, model chunks per device (interleaved 1F1B; `jaxpar.parallel.schedule` has the ticks).

    Raises:
      ValueError: from `jaxpar.parallel.schedule.check` (m not a multiple of p with v > 1).
    """
    schedule.check(p, virtual_stages, m)
    run = _Lockstep(parts, layers, edge, mbs, p, m, virtual_stages, act_shape, act_dtype, loss_scale, recompute)
    carry = run.initial_carry()
    # Three static loops: forward only (warm-up), forward and backward, backward only (cool-down).
    v = virtual_stages
    warm, last_forward = schedule.warmup_ticks(p, v), schedule.forward_tick(m - 1, p * v - 1, p, v)
    phases = (
        (0, warm, True, False),
        (warm, last_forward + 1, True, True),
        (last_forward + 1, schedule.ticks(p, v, m), False, True),
    )
    for start, stop, fwd, bwd in phases:
        if stop > start:
            body = functools.partial(run.tick, do_forward=fwd, do_backward=bwd)
            carry, _ = jax.lax.scan(body, carry, jnp.arange(start, stop))
    _, _, _, g_layers, g_edge, loss, stats = carry
    if v > 1:
        g_layers = jax.tree.map(lambda g, a: g.reshape(a.shape), g_layers, layers)
    return (g_layers, g_edge), loss, stats


class _Lockstep:
    """One stage's run of `one_f_one_b` (inside the shard_map): the static context of its clock ticks and the
    parts of one tick. A tick's carry is (received activation [b, T', D], the input gradient that the next
    tick sends [b, T', D], the stash rings, the layers' and the edge's fp32 gradient sums, the loss sum, the
    blocks' stats sums).

    In a forward tick stage s runs microbatch i's chunk j (`jaxpar.parallel.schedule.forward_at`), in a backward
    tick microbatch i_b's chunk j_b (`backward_at`); the stash holds, per forward tick, what that backward needs
    (the chunk input with `recompute`, else the blocks' microbatch-dependent residuals, `Residuals`). The methods'
    `k` is the tick."""

    def __init__(self, parts, layers, edge, mbs, p, m, v, act_shape, act_dtype, loss_scale, recompute):
        self.parts, self.layers, self.edge, self.mbs = parts, layers, edge, mbs
        self.p, self.m, self.v, self.act_dtype = p, m, v, act_dtype
        self.loss_scale, self.recompute = loss_scale, recompute
        self.s = jax.lax.axis_index(AXIS)
        self.is_first, self.is_last = self.s == 0, self.s == p - 1
        self.depth = schedule.stash_slots(p, v)
        self.zeros_act = jnp.zeros(act_shape, act_dtype)
        self.chunks = layers if v == 1 else jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), layers)
        self.mb0 = microbatch(mbs, jnp.int32(0), m)
        if recompute:
            self.template, self.stash_shapes = None, [jax.ShapeDtypeStruct(act_shape, act_dtype)]
        else:
            self.template = Residuals(parts, self.chunk(jnp.int32(0)), self.zeros_act, self.mb0)
            self.stash_shapes = self.template.stash_avals

    def chunk(self, j):
        """The layers of virtual stage j (all of the stage's layers when v = 1: no slicing at all)."""
        if self.v == 1:
            return self.layers
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, j, keepdims=False), self.chunks)

    def initial_carry(self) -> tuple:
        """The carry before tick 0: nothing received, empty stash rings, zero sums."""
        zeros32 = lambda tree: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)  # noqa: E731
        return (
            self.zeros_act,
            self.zeros_act,
            [jnp.zeros((self.depth, *r.shape), r.dtype) for r in self.stash_shapes],
            zeros32(self.chunks),
            zeros32(self.edge),
            jnp.zeros((), jnp.float32),
            zero_stats(self.parts, self.chunk(jnp.int32(0)), self.zeros_act, self.mb0, self.v),
        )

    def tick(self, carry, k, do_forward: bool, do_backward: bool):
        """One clock tick: with `do_backward`, the permute of the previous tick's input gradient to the previous
        stage; with `do_forward`, this stage's forward and the permute of its output to the next stage; with
        `do_backward`, its backward, whose input gradient the next tick sends.

        Each permute has compute to hide under on a GPU (XLA's latency-hiding scheduler starts it when its
        operand is ready and waits for it where its result is needed): the backward permute at the top of the
        tick is needed by the backward and runs under the forward; the forward permute is needed by the next
        tick and runs under the backward. One permute is in flight at a time, in that order, on every platform
        (`ordered_after`: the forward permute's operand waits for the backward permute). The sums of the
        backward's weight gradient wait for the forward permute: the work after the backward's blocks is then
        no place to finish it, and the GPU scheduler, which starts a collective no earlier than its cost model
        needs to hide it, starts it right after the forward; the same dependency keeps XLA's
        collective-permute-motion pass from moving the permute to the next tick's top, where the forward would
        wait for it. Where the platform needs one collective order (`StageParts.order_collectives`, XLA:CPU) the
        forward's and the backward's own collectives keep that order too: backward permute, forward, forward
        permute, backward. (The first backward tick's permute sends zeros: no stage has an input gradient yet.)"""
        recv_f, pending_b, stash, g_layers, g_edge, loss_acc, stats_acc = carry
        recv_b = shift(pending_b, self.p, forward=False, ring=self.v > 1) if do_backward else None
        fwd = None
        if do_forward:
            x_in = recv_f if recv_b is None else self.parts.after(recv_f, recv_b)
            fwd, stash, loss_acc, stats_acc = self.forward(x_in, stash, loss_acc, stats_acc, k)
            send_f = fwd["h"] if recv_b is None else ordered_after(fwd["h"], recv_b)
            recv_f = shift(send_f, self.p, forward=True, ring=self.v > 1)
        if do_backward:
            if fwd is not None:
                recv_b, head_in = self.parts.after((recv_b, fwd["h"]), recv_f)
                fwd = {**fwd, "h": head_in}
            pending_b, g_layers, g_edge, loss_acc = self.backward(
                recv_b, stash, g_layers, g_edge, loss_acc, k, fwd, recv_f if fwd is not None else None
            )
        return (recv_f, pending_b, stash, g_layers, g_edge, loss_acc, stats_acc), None

    def forward(self, recv_f, stash, loss_acc, stats_acc, k):
        """Tick k's forward of one chunk-microbatch: ({"h": the chunk's output, "mb", "last": whether the chunk
        is the model's last}, the stash with what its backward needs in slot k mod depth, the sums with the
        blocks' own loss terms and stats)."""
        parts, v = self.parts, self.v
        i, j_f, valid_f = schedule.forward_at(k, self.s, self.p, v, self.m)
        mb = microbatch(self.mbs, i, self.m)
        # The embedding runs for model chunk 0 only, the head for the last chunk only (chunk j*p + s).
        first_f = self.is_first if v == 1 else self.is_first & (j_f == 0)
        last_f = self.is_last if v == 1 else self.is_last & (j_f == v - 1)
        x = self.stage_input(recv_f, mb, first_f)
        w = self.chunk(j_f)
        if v > 1 and parts.edge_gathered:
            # A chunk of one layer runs outside any layer loop, so its weights' fsdp gathers would not depend
            # on the embedding's cond (and its gathers) before them: order them after it.
            w = parts.after(w, x)
        if self.recompute:
            h, b_loss, b_stats = blocks_forward(parts, w, x, mb)
            keep = [x]
        else:
            h, b_loss, b_stats, vjp_fn = blocks_vjp(parts, w, x, mb)
            keep = self.template.stash(vjp_fn, w)
        if parts.blocks_loss:  # the blocks' own loss terms and stats, counted in their forward tick
            loss_acc = loss_acc + jnp.where(valid_f, b_loss * self.loss_scale, 0.0)
            stats_acc = add_stats(stats_acc, b_stats, j_f, valid_f)
        # Slots by forward tick: the live ones are the 2pv - 2 ticks before this one (a chunk input waits at
        # most 2pv - 2 ticks), so this tick's slot holds nothing live and the write needs no validity mask,
        # also for a microbatch outside 0 .. m - 1.
        slot = jnp.mod(k, self.depth)
        stash = [jax.lax.dynamic_update_index_in_dim(r, x_, slot, 0) for r, x_ in zip(stash, keep)]
        return {"h": h, "mb": mb, "last": last_f}, stash, loss_acc, stats_acc

    def backward(self, recv_b, stash, g_layers, g_edge, loss_acc, k, fwd: dict | None, sums_after=None):
        """Tick k's backward of one chunk-microbatch, seeded by the received gradient or, for the model's last
        chunk, by the head's gradient of this tick's forward `fwd` (None in a backward-only tick): (the gradient
        to send to the previous stage, the updated gradient sums, the loss sum with the head's loss). The chunk's
        weight gradient is added to the sums after `sums_after` is ready (`ordered_after`), where given."""
        p, v, scale = self.p, self.v, self.loss_scale
        i_b, j_b, valid = schedule.backward_at(k, self.s, p, v, self.m)
        mb_b = microbatch(self.mbs, i_b, self.m)
        d_h = recv_b
        if fwd is not None:
            # The last chunk's backward is this tick's forward (always valid in the steady ticks): its head
            # seeds the backward. d_h then depends on the forward on every stage, so the backward's
            # collectives start after the forward's.
            # (the vocabulary-parallel head runs the last stage's microbatch on every stage: valid in every
            # steady tick, whatever this stage's backward)
            head_scale = scale if self.parts.head_vocab is not None else jnp.where(valid, scale, 0.0)
            loss, d_head, g_edge = self.head_grad(fwd["h"], fwd["mb"], head_scale, g_edge, fwd["last"], k)
            loss_acc = loss_acc + loss
            d_h = jnp.where(fwd["last"], d_head, recv_b)
        d_h = jnp.where(valid, d_h, jnp.zeros_like(d_h))
        # The forward of chunk c = j_b*p + s of this microbatch ran 2(pv - 1 - c) ticks ago.
        slot_b = jnp.mod(k - 2 * (p * v - 1 - (j_b * p + self.s)), self.depth)
        kept = [jax.lax.dynamic_index_in_dim(r, slot_b, keepdims=False) for r in stash]
        w_b = self.chunk(j_b)
        if v > 1 and self.parts.edge_gathered:
            w_b = self.parts.after(w_b, d_h)  # as in the forward: the backward's regathers after the head's cond
        if self.recompute:
            x_b, mb_b = self.parts.after((kept[0], mb_b), d_h)  # the recomputed forward's collectives too
            vjp_fn = blocks_vjp(self.parts, w_b, x_b, mb_b)[3]
        else:
            vjp_fn = self.template.rebuild(kept, w_b, d_h)
        d_layers, d_x = vjp_fn(blocks_cotangent(self.parts, d_h, jnp.where(valid, scale, 0.0)))
        if sums_after is not None:
            d_layers = ordered_after(d_layers, sums_after)
        g_layers = self.add_chunk(g_layers, d_layers, j_b)
        first_b = self.is_first if v == 1 else self.is_first & (j_b == 0)
        g_edge = self.embed_grad(d_x, self.parts.after(mb_b, (d_x, d_layers)), g_edge, first_b)
        return d_x, g_layers, g_edge, loss_acc

    def stage_input(self, x_in, mb, first):
        """The chunk's input: the embedding of `mb` on the model's first chunk, else the received activation."""
        return jax.lax.cond(first, lambda: self.parts.embed(self.edge, mb).astype(self.act_dtype), lambda: x_in)

    def head_grad(self, h, mb, scale, g_edge, last, k):
        """On the last chunk: the head's loss and its gradient with respect to the edge parameters and h.

        With the vocabulary-parallel head (`StageParts.head_vocab`, v = 1) every stage runs it in every tick
        that has a head: the last stage's output h is all-reduced over `pipeline` (the others add zeros), each
        stage takes the loss and gradients of its vocabulary slice (the normaliser all-reduced inside), and the
        input gradients of the slices are all-reduced: their sum is the head's gradient with respect to h. The
        edge gradients are each stage's slice's, summed over `pipeline` after the step's loop as the edge's
        always are; the loss counts on the last stage only. Every stage reads the last stage's microbatch,
        k - (p - 1) in tick k, for the targets."""
        if self.parts.head_vocab is not None:
            mb = microbatch(self.mbs, k - (self.p - 1), self.m)
            h_all = jax.lax.psum(jnp.where(last, h, jnp.zeros_like(h)), AXIS)
            # no cond holds the head here: where one collective order is needed, its weights' fsdp gathers
            # (weight-only, which XLA would hoist out of the tick loop) wait for this tick's all-reduce
            edge = self.parts.after(self.edge, h_all) if self.parts.edge_gathered else self.edge
            loss, (d_edge, d_h) = jax.value_and_grad(
                lambda e, y: self.parts.head_vocab(e, y, mb).astype(jnp.float32) * scale, argnums=(0, 1)
            )(edge, h_all)
            # the blocks' backward, which d_h seeds, after the head weights' gradient collectives (fsdp
            # reduce-scatters), which no cond holds here (`StageParts.after`: where one order is needed)
            d_h = self.parts.after(jax.lax.psum(d_h, AXIS), d_edge).astype(self.act_dtype)
            return jnp.where(last, loss, 0.0), d_h, add32(g_edge, d_edge)

        def run():
            loss, (d_edge, d_h) = jax.value_and_grad(
                lambda e, y: self.parts.head(e, y, mb).astype(jnp.float32) * scale, argnums=(0, 1)
            )(self.edge, h)
            return loss, d_h.astype(self.act_dtype), add32(g_edge, d_edge)

        return jax.lax.cond(last, run, lambda: (jnp.zeros((), jnp.float32), jnp.zeros_like(h), g_edge))

    def embed_grad(self, d_x, mb, g_edge, first):
        """On the first chunk: the embedding's gradient from the blocks' input gradient, added to `g_edge`."""

        def run():
            _, vjp_fn = jax.vjp(lambda e: self.parts.embed(e, mb).astype(self.act_dtype), self.edge)
            return add32(g_edge, vjp_fn(d_x)[0])

        return jax.lax.cond(first, run, lambda: g_edge)

    def add_chunk(self, g_layers, d_layers, j):
        """`d_layers` (chunk j's weight gradient) added into its rows of the gradient sums."""
        if self.v == 1:
            return add32(g_layers, d_layers)

        def one(acc, d):
            return jax.lax.dynamic_update_index_in_dim(acc, acc[j] + d.astype(jnp.float32), j, 0)

        return jax.tree.map(one, g_layers, d_layers)


class Residuals:
    """What the backward of the blocks needs from their forward (`jax.vjp`'s returned pytree), split by where it
    comes from, for `one_f_one_b(recompute=False)`.

    The pytree's leaves are the stage's weights themselves (primal inputs, found by identity), static Python
    leaves, and arrays. An array computed from the weights alone (e.g. one layer's slice of the stacked
    weights, which the layer scan stores per layer, or a weight gathered over fsdp) is the same for every
    microbatch: it is rebuilt from the weights in the backward tick, not stashed (stashing it would keep 2p - 1
    copies of the stage's weights). Every other array depends on the microbatch and is stashed. Which is which
    comes from one trace of the forward at construction (`jax.make_jaxpr`, then dead-code elimination per
    output: an output whose dependencies include no stage input or microbatch array is weight-only); the tree
    structure is static, the same for every trace of the same function at the same shapes (`stash` checks).

    The trace is cut with jax's private `convert_constvars_jaxpr` and `dce_jaxpr` and the weight-only part rerun
    with `eval_jaxpr`, all three through `jaxpar.parallel.jax_private` (why each, and its public replacement).
    """

    def __init__(self, parts: StageParts, layers, x, mb):
        self.parts = parts
        box = {}

        def arrays(lay, xx, mbb):
            vjp_fn = blocks_vjp(parts, lay, xx, mbb)[3]
            box["treedef"], box["kinds"] = jax.tree.structure(vjp_fn), self._kinds(vjp_fn, lay)
            return [leaf for leaf, kind in zip(jax.tree.leaves(vjp_fn), box["kinds"]) if kind[0] == "array"]

        closed = jax.make_jaxpr(arrays)(layers, x, mb)
        self.treedef, self.kinds = box["treedef"], box["kinds"]
        n_consts, n_weights = len(closed.consts), len(jax.tree.leaves(layers))
        jaxpr = convert_constvars_jaxpr(closed.jaxpr)  # consts first, then weights, x, mb
        n_out = len(jaxpr.outvars)
        varying = slice(n_consts + n_weights, None)
        self.from_weights = [
            not any(dce_jaxpr(jaxpr, [k == i for k in range(n_out)])[1][varying]) for i in range(n_out)
        ]
        self._weights_jaxpr, used = dce_jaxpr(jaxpr, self.from_weights)
        self._consts = [c for c, u in zip(closed.consts, used[:n_consts]) if u]
        self._used_weights = used[n_consts : n_consts + n_weights]
        self.stash_avals = [
            jax.ShapeDtypeStruct(a.shape, a.dtype) for a, w in zip(closed.out_avals, self.from_weights) if not w
        ]

    @staticmethod
    def _kinds(vjp_fn, layers) -> tuple:
        weights = {id(w): n for n, w in enumerate(jax.tree.leaves(layers))}
        return tuple(
            ("weight", weights[id(leaf)])
            if id(leaf) in weights
            else ("array",)
            if isinstance(leaf, jax.Array)
            else ("static", leaf)
            for leaf in jax.tree.leaves(vjp_fn)
        )

    def stash(self, vjp_fn, layers) -> list[jax.Array]:
        """The microbatch-dependent arrays of `vjp_fn` (a trace of the same function at the same shapes)."""
        kinds = self._kinds(vjp_fn, layers)
        # (The tree structures hold each trace's own jaxpr, so they never compare equal: compare the leaves.)
        if [k[0] for k in kinds] != [k[0] for k in self.kinds]:
            raise AssertionError("the blocks' residuals differ between two traces of the same stage function")
        arrays = [leaf for leaf, kind in zip(jax.tree.leaves(vjp_fn), kinds) if kind[0] == "array"]
        return [a for a, w in zip(arrays, self.from_weights) if not w]

    def rebuild(self, stashed: list[jax.Array], layers, after):
        """The vjp function from the stashed arrays and the weights; the weight-only arrays are recomputed from
        `layers` made to depend on `after` (so their collectives, e.g. fsdp gathers, start after it)."""
        weights = jax.tree.leaves(layers)
        used = self.parts.after([w for w, u in zip(weights, self._used_weights) if u], after)
        from_weights = iter(eval_jaxpr(self._weights_jaxpr, (), *self._consts, *used))
        from_stash = iter(stashed)
        arrays = iter([next(from_weights) if w else next(from_stash) for w in self.from_weights])
        leaves = [weights[k[1]] if k[0] == "weight" else next(arrays) if k[0] == "array" else k[1] for k in self.kinds]
        return jax.tree.unflatten(self.treedef, leaves)


def residual_bytes(parts: StageParts, layers, x, mb) -> int:
    """Bytes of the blocks' residuals of one stage-microbatch that `one_f_one_b(recompute=False)` stashes (the
    weight-only ones excluded, `Residuals`); (2p - 1) times this is the stash. Call inside the shard_map
    (abstract values are enough: it traces, no device work)."""
    return int(sum(a.size * jnp.dtype(a.dtype).itemsize for a in Residuals(parts, layers, x, mb).stash_avals))
