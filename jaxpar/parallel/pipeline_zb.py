"""Zero-bubble pipeline schedules (ZB-H1, ZB-V) inside one SPMD program over the `pipeline` mesh axis (inside
shard_map): a static table run slot by slot, every device its own op.

Shape letters: b rows of one microbatch on a device, T' the activations' sequence length, D the model width; p
stages, v model chunks per device, m microbatches; i a microbatch, j a chunk's position on its device.

The schedule is a table built in Python at trace time (`jaxpar.parallel.zero_bubble`), lowered to per-slot
instructions with ring-buffer indices (`jaxpar.parallel.slot_program`). The step runs the slots as one
`jax.lax.scan`; in each slot every device reads its own row of the instructions (by `axis_index`) and runs one
branch of a `jax.lax.switch`:

  * F: chunk j's forward of microbatch i, from the embedding (model chunk 0) or a received activation; it
    stashes what its backward needs (the chunk input with `pipeline.recompute`, else the residuals, as 1F1B's
    `jaxpar.parallel.pipeline_1f1b.Residuals`). On the model's last chunk it also runs the head and loss and
    their gradient, which seeds the chunk's B.
  * B: the input gradient (`jaxpar.parallel.split_backward.SplitBackward.b`) from the stash and the received
    (or seeded) output gradient; it keeps B's boundary for W; on model chunk 0 the embedding's gradient.
  * W: the chunk's weight gradients from the kept boundary (`SplitBackward.w`), added to the fp32 sums.
  * idle.

Only the taken branch runs on a device: an idle slot costs nothing but the wait, unlike the lockstep ticks of
`jaxpar.parallel.pipeline_1f1b`, where every device runs every tick's work (masked where invalid). A branch's
collectives (fsdp gathers, tensor psums) are over axes whose members share the stage, so they take the same
branch. After the branch, two ring `ppermute`s over `pipeline` (to s + 1 and to s - 1, one after the other) carry
this slot's output, and each device files what it received into its rings as the instructions say.

Memory per device: the rings' slots (`slot_program`), each sized by the most values live at once in the table:
stash (what F keeps for B), W (B's boundary kept for W, `split_backward.boundary_bytes` each), received
activations and gradients and head seeds ([b, T', D] each). Flat in m. The stash and W rings enter the switch
read-only: a branch returns the rows it writes (zeros where it writes none), and they are written after the
switch (`_put`). A ring passed through the switch would be held twice, as its operand and its result (XLA on CPU
and GPU alike: Llama 1B's shape at p = 4 peaked 1.78x the plan on the GPU compiler). The rings then cost their
slots plus one row each, the switch's result. The layers' fp32 gradient sums pass through the switch (the W
branch adds into them in place; outside it every slot would read and write a chunk's sums) and are held twice.
The edge's gradient sums stay outside the switch: the head (after F of the last chunk) and the embedding's
gradient (after B of chunk 0) run in conds of their own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.parallel import slot_program as slot_program_lib
from jaxpar.parallel import zero_bubble
from jaxpar.parallel.pipeline import (
    AXIS,
    StageParts,
    add32,
    add_stats,
    blocks_cotangent,
    blocks_forward,
    blocks_vjp,
    microbatch,
    zero_stats,
)
from jaxpar.parallel.pipeline_1f1b import Residuals
from jaxpar.parallel.slot_program import B, F
from jaxpar.parallel.split_backward import SplitBackward

# The instruction fields the slot reads (all of `slot_program.FIELDS` but "send": every slot sends both ways).
_FIELDS = tuple(f for f in slot_program_lib.FIELDS if f != "send")


def zero_bubble_pipeline(
    parts: StageParts,
    layers: dict,
    edge: dict,
    mbs: dict,
    *,
    schedule: str,
    p: int,
    m: int,
    act_shape: tuple[int, ...],
    act_dtype,
    loss_scale: jax.Array,
    recompute: bool,
    virtual_stages: int = 1,
) -> tuple[tuple[dict, dict], jax.Array, dict]:
    """Runs `schedule` ("zb-h1" or "zb-v", or "1f1b" for its split-backward table); same arguments and results
    as `jaxpar.parallel.pipeline_1f1b.one_f_one_b`: ((fp32 gradient sums of `layers` in chunk order, of `edge`),
    this stage's summed scaled loss, the blocks' stats summed per chunk, leaves [v, ...]).

    `layers` are in the schedule's chunk order (`jaxpar.parallel.pipeline.to_chunk_order` with the table's
    placement): rows j*L/(pv) .. (j+1)*L/(pv) - 1 are this device's j-th chunk.

    Raises:
      ValueError: from `jaxpar.parallel.zero_bubble.check_sizes` (m or v not allowed by the schedule).
    """
    table = zero_bubble.build(schedule, p, m, virtual_stages)
    program = slot_program_lib.program(table)
    run = _Slots(parts, layers, edge, mbs, program, virtual_stages, m, act_shape, act_dtype, loss_scale, recompute)
    carry, _ = jax.lax.scan(run.slot, run.initial_carry(), jnp.arange(program.kind.shape[0]))
    g_layers, g_edge, loss, stats = carry[-4:]
    g_layers = jax.tree.map(lambda g, a: g.reshape(a.shape), g_layers, layers)
    return (g_layers, g_edge), loss, stats


def split_stage_backward(parts: StageParts, w, x, mb, recompute: bool) -> tuple[Residuals | None, SplitBackward]:
    """(the stash template, None with `recompute`; the split of a chunk's backward from its stash), as the
    schedule runs it: B from the stash (the chunk input, whose forward B recomputes, or the residuals) and the
    output cotangent (`jaxpar.parallel.pipeline.blocks_cotangent`), W from B's boundary. `w` one chunk's layers,
    x [b, T', D], mb one microbatch: example values of the shapes the schedule passes (inside the shard_map)."""
    template = None if recompute else Residuals(parts, w, x, mb)

    def backward(kept, w_, mb_, ct):
        if template is None:
            vjp_fn = blocks_vjp(parts, w_, kept[0], mb_)[3]
        else:
            vjp_fn = template.rebuild(kept, w_, jax.tree.leaves(ct)[0])
        d_w, d_x = vjp_fn(ct)
        return d_x, d_w

    kept = [x] if template is None else [jnp.zeros(a.shape, a.dtype) for a in template.stash_avals]
    ct = blocks_cotangent(parts, x, jnp.zeros((), jnp.float32))
    return template, SplitBackward(backward, kept, w, mb, ct)


def _instructions(program) -> tuple[jnp.ndarray, dict[str, int]]:
    """The program's fields stacked into one int32 array [slots, p, fields] (-1: nothing to read or write),
    and the rings' sizes."""
    sizes = {ring: int(getattr(program, f"{ring}_slots")) for ring in slot_program_lib.RINGS}
    cols = [np.asarray(getattr(program, name), np.int32) for name in _FIELDS]
    return jnp.asarray(np.stack(cols, axis=-1)), sizes


def _put(ring: jax.Array, x: jax.Array, k: jax.Array, write: jax.Array | None = None) -> jax.Array:
    """`ring` with `x` in slot k when `write` (default: k >= 0), else unchanged: the slot is rewritten with its
    own value, so no ring needs a scratch slot for the ops that write nothing."""
    write = k >= 0 if write is None else write
    k = jnp.maximum(k, 0)
    old = jax.lax.dynamic_index_in_dim(ring, k, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(ring, jnp.where(write, x, old), k, 0)


class _Slots:
    """One stage's run of `zero_bubble_pipeline` (inside the shard_map): the static context and one slot's work.
    The carry is (activation ring, gradient ring, stash rings, seed ring, W rings, the layers' fp32 gradient
    sums [v, ...], the edge's, the loss sum, the blocks' stats sums)."""

    def __init__(self, parts, layers, edge, mbs, program, v, m, act_shape, act_dtype, loss_scale, recompute):
        self.parts, self.edge, self.mbs, self.m, self.v = parts, edge, mbs, m, v
        self.act_dtype, self.loss_scale, self.recompute = act_dtype, loss_scale, recompute
        self.p = program.kind.shape[1]
        self.code, self.sizes = _instructions(program)
        self.s = jax.lax.axis_index(AXIS)
        self.zeros_act = jnp.zeros(act_shape, act_dtype)
        self.chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), layers)
        self.mb0 = microbatch(mbs, jnp.int32(0), m)
        w0 = self.chunk(jnp.int32(0))
        self.template, self.split = split_stage_backward(parts, w0, self.zeros_act, self.mb0, recompute)
        self.stash_shapes = (
            [jax.ShapeDtypeStruct(act_shape, act_dtype)] if self.template is None else self.template.stash_avals
        )
        self.w_shapes = self.split.boundary_avals

    def chunk(self, j):
        """The layers of this device's chunk j."""
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, j, keepdims=False), self.chunks)

    def initial_carry(self) -> tuple:
        zeros32 = lambda tree: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)  # noqa: E731
        ring = lambda n, shape, dtype: jnp.zeros((self.sizes[n], *shape), dtype)  # noqa: E731
        return (
            ring("act", self.zeros_act.shape, self.act_dtype),
            ring("grad", self.zeros_act.shape, self.act_dtype),
            [ring("stash", a.shape, a.dtype) for a in self.stash_shapes],
            ring("seed", self.zeros_act.shape, self.act_dtype),
            [ring("w", a.shape, a.dtype) for a in self.w_shapes],
            zeros32(self.chunks),
            zeros32(self.edge),
            jnp.zeros((), jnp.float32),
            zero_stats(self.parts, self.chunk(jnp.int32(0)), self.zeros_act, self.mb0, self.v),
        )

    def slot(self, carry, t):
        """Slot t: this device's op (a `jax.lax.switch` branch), the head (after F of the model's last chunk) or
        the embedding's gradient (after B of chunk 0) in conds outside the switch, so that the switch never
        carries the edge's gradient sums; then the two permutes and the ring writes."""
        act, grad, stash, seed, wring, g_layers, g_edge, loss, stats = carry
        op = dict(zip(_FIELDS, self.code[t, self.s]))
        take = lambda ring, k: jax.lax.dynamic_index_in_dim(ring, jnp.maximum(k, 0), keepdims=False)  # noqa: E731
        mb = microbatch(self.mbs, op["microbatch"], self.m)
        inputs = (
            take(act, op["act_read"]),
            jnp.where(op["is_last"] > 0, take(seed, op["seed_read"]), take(grad, op["grad_read"])),
        )
        # The stash and W rings enter the switch read-only; the branch returns the rows it writes (zeros where it
        # writes none) and they are written after it (a slot without a write rewrites a row with its own value):
        # a ring passed through a switch (or a cond) is held twice, as its operand and its result.
        branches = [
            lambda ins, acc: (self.zeros_act, acc, self.no_rows(self.stash_shapes), self.no_rows(self.w_shapes)),
            lambda ins, acc: self.forward(op, mb, ins, acc),
            lambda ins, acc: self.backward(op, mb, ins, acc, stash),
            lambda ins, acc: self.weights(op, ins, acc, wring),
        ]
        send, (g_layers, loss, stats), stash_rows, w_rows = jax.lax.switch(
            op["kind"], branches, inputs, (g_layers, loss, stats)
        )
        stash = [_put(r, x, op["stash_write"], op["kind"] == F) for r, x in zip(stash, stash_rows)]
        wring = [_put(r, x, op["w_write"], op["kind"] == B) for r, x in zip(wring, w_rows)]
        value, d_head, g_edge = self.head((op["kind"] == F) & (op["is_last"] > 0), send, mb, g_edge)
        g_edge = self.embed_grad((op["kind"] == B) & (op["is_first"] > 0), send, mb, g_edge)
        loss = loss + value
        seed = _put(seed, d_head, op["seed_write"])
        # A chunk whose next (previous) chunk sits on the same device hands its output over locally.
        act = _put(act, send, op["local_act_write"])
        grad = _put(grad, send, op["local_grad_write"])
        # The two permutes, after the edge conds and one after the other (a fixed collective order: `ordered_after`).
        p = self.p
        send = self.parts.after(send, (value, g_edge))
        from_below = jax.lax.ppermute(send, AXIS, [(k, (k + 1) % p) for k in range(p)])
        from_above = jax.lax.ppermute(self.parts.after(send, from_below), AXIS, [(k, (k - 1) % p) for k in range(p)])
        for got, kind, k in (
            (from_below, op["recv_up_kind"], op["recv_up_slot"]),
            (from_above, op["recv_down_kind"], op["recv_down_slot"]),
        ):
            act = _put(act, got, k, kind == 1)
            grad = _put(grad, got, k, kind == 2)
        return (act, grad, stash, seed, wring, g_layers, g_edge, loss, stats), None

    @staticmethod
    def no_rows(shapes) -> list[jax.Array]:
        """Zero rows for the rings of `shapes`: what a branch that writes none of them returns."""
        return [jnp.zeros(a.shape, a.dtype) for a in shapes]

    def forward(self, op, mb, ins, acc):
        """F of (microbatch, chunk) `op`: (its output, the sums, the stash rows: what its backward needs, no W
        rows). The head runs after the switch (`head`)."""
        g_layers, loss, stats = acc
        recv, _ = ins
        j = op["chunk_local"]
        x = jax.lax.cond(
            op["is_first"] > 0, lambda: self.parts.embed(self.edge, mb).astype(self.act_dtype), lambda: recv
        )
        w = self.chunk(j)
        if self.parts.edge_gathered:
            # The chunk's weight gathers (over fsdp) depend on the weights alone: order them after the embedding's
            # cond and its gathers, one collective order on every device (`ordered_after`).
            w = self.parts.after(w, x)
        if self.template is None:  # pipeline.recompute
            h, b_loss, b_stats = blocks_forward(self.parts, w, x, mb)
            keep = [x]
        else:
            h, b_loss, b_stats, vjp_fn = blocks_vjp(self.parts, w, x, mb)
            keep = self.template.stash(vjp_fn, w)
        if self.parts.blocks_loss:
            loss = loss + b_loss * self.loss_scale
            stats = add_stats(stats, b_stats, j, True)
        return h, (g_layers, loss, stats), keep, self.no_rows(self.w_shapes)

    def head(self, run, h, mb, g_edge):
        """After F of the model's last chunk (`run`): the head's scaled loss, its gradient with respect to h (the
        seed of the chunk's B) and the edge's gradient added to `g_edge`; else (0, zeros, g_edge)."""
        edge = self.parts.after(self.edge, h) if self.parts.edge_gathered else self.edge

        def head():
            value, (d_edge, d_h) = jax.value_and_grad(
                lambda e, y: self.parts.head(e, y, mb).astype(jnp.float32) * self.loss_scale, argnums=(0, 1)
            )(edge, h)
            return value, d_h.astype(self.act_dtype), add32(g_edge, d_edge)

        return jax.lax.cond(run, head, lambda: (jnp.zeros((), jnp.float32), jnp.zeros_like(h), g_edge))

    def embed_grad(self, run, d_x, mb, g_edge):
        """After B of chunk 0 (`run`): the embedding's gradient from the blocks' input gradient d_x, added."""

        def grad():
            mb_ = self.parts.after(mb, d_x)
            _, vjp_fn = jax.vjp(lambda e: self.parts.embed(e, mb_).astype(self.act_dtype), self.edge)
            return add32(g_edge, vjp_fn(d_x)[0])

        return jax.lax.cond(run, grad, lambda: g_edge)

    def backward(self, op, mb, ins, acc, stash):
        """B of `op`: (the input gradient, sent on, from the stash ring's row; the sums; no stash rows; B's
        boundary as the W rows)."""
        _, d_h = ins
        kept = [jax.lax.dynamic_index_in_dim(r, op["stash_read"], keepdims=False) for r in stash]
        ct = blocks_cotangent(self.parts, d_h, jnp.asarray(self.loss_scale, jnp.float32))
        d_x, bound = self.split.b(kept, self.chunk(op["chunk_local"]), mb, ct)
        return d_x, acc, self.no_rows(self.stash_shapes), bound

    def weights(self, op, ins, acc, wring):
        """W of `op`: the chunk's weight gradients from B's boundary (the W ring's row), added to chunk j's rows
        of the sums, which pass through the switch (held twice, as its operand and result: adding outside it
        would read and write a chunk's fp32 sums in every slot)."""
        g_layers, loss, stats = acc
        d_w = self.split.w([jax.lax.dynamic_index_in_dim(r, op["w_read"], keepdims=False) for r in wring])
        j = op["chunk_local"]

        def one(a, d):
            return jax.lax.dynamic_update_index_in_dim(a, a[j] + d.astype(jnp.float32), j, 0)

        sums = (jax.tree.map(one, g_layers, d_w), loss, stats)
        return self.zeros_act, sums, self.no_rows(self.stash_shapes), self.no_rows(self.w_shapes)
