"""Attention with the sequence split over a mesh axis (context parallelism), inside shard_map: the load-balanced
causal layout of the sequence, attention with the keys and values all-gathered over the axis, and ring attention.

Shape letters: B batch, T the whole sequence, R = T/c one device's slice of it, H query heads, G key/value heads (G
divides H), K head width; c the axis size. Every token carries its global position (int32 [B, R]), and with packed
documents its segment id (int32 [B, R]): query t sees key s when pos_s <= pos_t and both have the same segment id,
whatever order the slices hold their tokens in.

Load balance (`balanced_order`): with a causal mask a contiguous split gives device c - 1 the most work (its
queries see the whole sequence) and device 0 the least. Cut the sequence into 2c chunks and give device i chunks i
and 2c - 1 - i: every device then holds one early and one late chunk and does the same work (the Llama 3 report,
Dubey et al. 2024, section 3.3.2; torchtitan's load-balanced ring).

All-gather K/V (`gathered_kv_attention`, the Llama 3 scheme): all-gather K and V (G heads only) and their positions
and segment ids over the axis, then each device attends its R queries to all T keys. Its backward reduce-scatters
dK and dV (the transpose of the all-gather). Memory: the gathered K/V, 2 B T G K elements per layer.

Ring (`ring_attention`, Liu et al. 2023, arXiv 2310.01889): c steps; in each the device attends its queries to the
K/V block it holds and passes the block on around the ring (`ppermute` to the next device, issued before the
block's compute so that a GPU can overlap them). The partial results combine by online softmax (Milakov and
Gimelshein 2018; FlashAttention's rescaling) in fp32: a running max m and sum l per query, the output rescaled by
exp(m_old - m_new) whenever the max grows. Each block is four sub-blocks, the device's two query chunks against the
block's two key chunks; a sub-block none of whose queries may see any of its keys (all in the causal future, or
all in other documents) skips its compute in a `lax.cond` (name scope `RING_SCOPE`). With the load-balanced layout
and one document per row every device computes 2c + 1 of its 4c sub-blocks: the same work everywhere, near the
causal minimum (`jaxpar.analysis.bench.context_balance` reads it per device from the compiled program). The
backward (a custom VJP) is a second ring pass: the blocks go around again with their dK and dV sums, from the
forward's log-sum-exp per query.

The model's entry point, which also picks the all-gather path's kernel, is `jaxpar.model.context_attention`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config.choices import CONTEXT_STRATEGIES
from jaxpar.config.mesh_axes import CONTEXT

AXIS = CONTEXT
SEQ_DIM = 1  # batch arrays are [B, T], activations [B, T, ...]


def balanced_order(seq_len: int, c: int) -> np.ndarray:
    """int64 [T]: the original position of each position of the load-balanced layout (module docstring): device
    i's slice, positions i*T/c .. (i+1)*T/c - 1 of the layout, is chunk i then chunk 2c - 1 - i of T/(2c) tokens.

    Raises:
      ValueError: T not divisible by 2c.
    """
    if c < 1 or seq_len % (2 * c):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into 2 x {c} equal chunks")
    n = seq_len // (2 * c)
    chunks = [chunk for i in range(c) for chunk in (i, 2 * c - 1 - i)]
    return np.concatenate([np.arange(k * n, (k + 1) * n) for chunk in chunks for k in [chunk]])


def visible_block(q_pos, k_pos, q_seg, k_seg) -> jax.Array:
    """bool [B, Rq, Rk]: query t sees key s (causal by global position, and the same segment unless the segment
    ids are None)."""
    mask = k_pos[:, None, :] <= q_pos[:, :, None]
    if q_seg is not None:
        mask = mask & (k_seg[:, None, :] == q_seg[:, :, None])
    return mask


def gathered_kv_attention(
    q_BRHK: jax.Array,
    k_BRGK: jax.Array,
    v_BRGK: jax.Array,
    positions_BR: jax.Array,
    segment_ids_BR: jax.Array | None,
    axis: str,
) -> jax.Array:
    """Causal attention of this device's queries to the whole sequence, K and V all-gathered over `axis`
    (module docstring). Inside shard_map; returns [B, R, H, K] in q's dtype."""
    k_all = jax.lax.all_gather(k_BRGK, axis, axis=1, tiled=True)
    v_all = jax.lax.all_gather(v_BRGK, axis, axis=1, tiled=True)
    k_pos = jax.lax.all_gather(positions_BR, axis, axis=1, tiled=True)
    k_seg = None if segment_ids_BR is None else jax.lax.all_gather(segment_ids_BR, axis, axis=1, tiled=True)
    mask = visible_block(positions_BR, k_pos, segment_ids_BR, k_seg)[:, None]
    return jax.nn.dot_product_attention(q_BRHK, k_all, v_all, mask=mask, implementation="xla")


def ring_attention(
    q_BRHK: jax.Array,
    k_BRGK: jax.Array,
    v_BRGK: jax.Array,
    positions_BR: jax.Array,
    segment_ids_BR: jax.Array | None,
    axis: str,
    axis_size: int,
) -> jax.Array:
    """Causal attention of this device's queries to the whole sequence, the K/V blocks passed around the ring of
    `axis` (`axis_size` devices) and combined by online softmax in fp32 (module docstring). Inside shard_map;
    returns [B, R, H, K] in q's dtype. Its backward is a second ring pass (`_ring_bwd`)."""
    segments = segment_ids_BR if segment_ids_BR is not None else jnp.zeros_like(positions_BR)
    return _ring(q_BRHK, k_BRGK, v_BRGK, positions_BR, segments, axis, axis_size)


RING_SHIFT_SCOPE = "ring_shift"  # the name scope of the ring's K/V block permutes (the dK/dV sums': ring_shift_grads)


def ring_shift(arrays: tuple, axis: str, axis_size: int, scope: str = RING_SHIFT_SCOPE) -> tuple:
    """Each device's `arrays` (a tuple of [B, R, ...] arrays) to the next device of the ring (ppermute i -> i + 1
    mod c), under name scope `scope`. The arrays of one dtype travel packed as one array (one permute per dtype:
    K and V together, positions and segment ids together): separate permutes of one step would each wait for a
    turn of the transfer, and a GPU's scheduler left some of them without compute to hide under."""
    pairs = [(i, (i + 1) % axis_size) for i in range(axis_size)]
    groups: dict = {}
    for i, x in enumerate(arrays):
        groups.setdefault(x.dtype, []).append(i)
    out: list = [None] * len(arrays)
    with jax.named_scope(scope):
        for members in groups.values():
            parts = [arrays[i].reshape(*arrays[i].shape[:2], -1) for i in members]
            widths = np.cumsum([p.shape[-1] for p in parts])[:-1]
            moved = jax.lax.ppermute(jnp.concatenate(parts, axis=-1), axis, pairs)
            for i, part in zip(members, jnp.split(moved, widths, axis=-1)):
                out[i] = part.reshape(arrays[i].shape)
    return tuple(out)


def grouped_heads(x_BRHK: jax.Array, g: int) -> jax.Array:
    """[B, R, H, K] -> fp32 [B, R, G, H/G, K]: query heads grouped by the key/value head they share."""
    b, r, h, kw = x_BRHK.shape
    return x_BRHK.astype(jnp.float32).reshape(b, r, g, h // g, kw)


RING_SCOPE = "ring_block"  # the name scope of the ring's block conds: ring_block/f{step}q{a}k{b} (backward: b...)


def chunk_halves(x: jax.Array, n: int) -> list[jax.Array]:
    """A device's slice [B, R, ...] as its two chunks [B, n, ...] (the load-balanced layout's early and late)."""
    return [x[:, :n], x[:, n:]]


def _ring_forward(q_BRHK, k_BRGK, v_BRGK, positions_BR, segments_BR, axis, axis_size):
    """(output [B, R, H, K] in q's dtype, log-sum-exp fp32 [B, R, G, H/G] of every query's scores: the softmax
    statistics the backward needs). Each step's block is four sub-blocks, this device's two query chunks against
    the block's two key chunks, each computed in a cond only when one of its queries sees one of its keys: with the
    load-balanced layout and one document per row that is 2 of 4 in every step but the first (3 of 4), on every
    device alike."""
    b, r, h, kw = q_BRHK.shape
    n, g = r // 2, k_BRGK.shape[2]
    q = chunk_halves(grouped_heads(q_BRHK, g) * (1.0 / np.sqrt(kw)), n)
    q_pos, q_seg = chunk_halves(positions_BR, n), chunk_halves(segments_BR, n)

    def sub_block(acc, a, k, v, k_pos, k_seg):
        o, m, total = acc  # [B, n, G, H/G, K], and the running max and sum [B, n, G, H/G]
        mask = visible_block(q_pos[a], k_pos, q_seg[a], k_seg)

        def compute():
            scores = jnp.einsum("bsgrk,btgk->bsgrt", q[a], k.astype(jnp.float32))
            keep = mask[:, :, None, None, :]
            m_new = jnp.maximum(m, jnp.max(jnp.where(keep, scores, -jnp.inf), axis=-1))
            # exp of -inf where masked, not a masked exp: exp(scores - m_new) may overflow where no key of the row
            # is visible, and its gradient (times a zero cotangent) would be NaN
            p = jnp.exp(jnp.where(keep, scores - m_new[..., None], -jnp.inf))
            rescale = jnp.exp(m - m_new)
            total_new = total * rescale + jnp.sum(p, axis=-1)
            o_new = o * rescale[..., None] + jnp.einsum("bsgrt,btgk->bsgrk", p, v.astype(jnp.float32))
            return o_new, m_new, total_new

        return jax.lax.cond(jnp.any(mask), compute, lambda: (o, m, total))

    # -1e30, not -inf: exp(m_old - m_new) stays finite before a row's first visible key
    acc = [
        (jnp.zeros(qa.shape, jnp.float32), jnp.full(qa.shape[:-1], -1e30, jnp.float32), jnp.zeros(qa.shape[:-1]))
        for qa in q
    ]
    kv = (k_BRGK, v_BRGK, positions_BR, segments_BR)
    for step in range(axis_size):
        # the next block's permute first: it does not depend on this block's compute
        passed = ring_shift(kv, axis, axis_size) if step < axis_size - 1 else kv
        keys = [chunk_halves(x, n) for x in kv]
        for a in range(2):
            for kb in range(2):
                with jax.named_scope(f"{RING_SCOPE}/f{step}q{a}k{kb}"):
                    acc[a] = sub_block(acc[a], a, *(x[kb] for x in keys))
        kv = passed
    outs, lses = [], []
    for o, m, total in acc:
        total = jnp.maximum(total, 1e-30)
        outs.append(o / total[..., None])
        lses.append(m + jnp.log(total))
    out = jnp.concatenate(outs, axis=1).reshape(b, r, h, kw).astype(q_BRHK.dtype)
    return out, jnp.concatenate(lses, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ring(q_BRHK, k_BRGK, v_BRGK, positions_BR, segments_BR, axis, axis_size):
    return _ring_forward(q_BRHK, k_BRGK, v_BRGK, positions_BR, segments_BR, axis, axis_size)[0]


def _ring_fwd(q_BRHK, k_BRGK, v_BRGK, positions_BR, segments_BR, axis, axis_size):
    out, lse = _ring_forward(q_BRHK, k_BRGK, v_BRGK, positions_BR, segments_BR, axis, axis_size)
    return out, (q_BRHK, k_BRGK, v_BRGK, positions_BR, segments_BR, out, lse)


def _ring_bwd(axis, axis_size, residuals, d_out_BRHK):
    """The second ring pass (FlashAttention-2's backward, Dao 2023, algorithm 2, sub-block by sub-block): the K/V
    blocks go around the ring again, each with the fp32 sums of its dK and dV, which every device adds its queries'
    share to before passing them on; one more permute brings each block's sums home. Keeps this device's own
    q, k, v, output and log-sum-exp, and two blocks at a time: no step's scores or probabilities. The same sub-blocks
    as the forward are skipped."""
    q_BRHK, k_BRGK, v_BRGK, positions_BR, segments_BR, out_BRHK, lse = residuals
    b, r, h, kw = q_BRHK.shape
    n, g = r // 2, k_BRGK.shape[2]
    scale = 1.0 / np.sqrt(kw)
    q = chunk_halves(grouped_heads(q_BRHK, g) * scale, n)
    d_out = grouped_heads(d_out_BRHK, g)
    delta = chunk_halves(jnp.sum(d_out * grouped_heads(out_BRHK, g), axis=-1), n)  # D_i = dO_i . O_i, [B, n, G, H/G]
    d_out, lse = chunk_halves(d_out, n), chunk_halves(lse, n)
    q_pos, q_seg = chunk_halves(positions_BR, n), chunk_halves(segments_BR, n)
    kv = (k_BRGK, v_BRGK, positions_BR, segments_BR)
    dq = [jnp.zeros(qa.shape, jnp.float32) for qa in q]
    dkv = (jnp.zeros(k_BRGK.shape, jnp.float32), jnp.zeros(v_BRGK.shape, jnp.float32))
    for step in range(axis_size):
        passed = ring_shift(kv, axis, axis_size) if step < axis_size - 1 else kv
        keys = [chunk_halves(x, n) for x in kv]
        dk, dv = (chunk_halves(x, n) for x in dkv)
        for a in range(2):
            for kb in range(2):
                k, v, k_pos, k_seg = (x[kb] for x in keys)
                mask = visible_block(q_pos[a], k_pos, q_seg[a], k_seg)

                def compute(dq_a, dk_b, dv_b, a=a, k=k, v=v, mask=mask):
                    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
                    scores = jnp.einsum("bsgrk,btgk->bsgrt", q[a], k32)
                    p = jnp.exp(jnp.where(mask[:, :, None, None, :], scores - lse[a][..., None], -jnp.inf))
                    dv_b = dv_b + jnp.einsum("bsgrt,bsgrk->btgk", p, d_out[a])
                    d_scores = p * (jnp.einsum("bsgrk,btgk->bsgrt", d_out[a], v32) - delta[a][..., None])
                    dq_a = dq_a + jnp.einsum("bsgrt,btgk->bsgrk", d_scores, k32) * scale
                    dk_b = dk_b + jnp.einsum("bsgrt,bsgrk->btgk", d_scores, q[a])
                    return dq_a, dk_b, dv_b

                with jax.named_scope(f"{RING_SCOPE}/b{step}q{a}k{kb}"):
                    dq[a], dk[kb], dv[kb] = jax.lax.cond(jnp.any(mask), compute, lambda *x: x, dq[a], dk[kb], dv[kb])
        # each block's sums travel with it: after c shifts they are home
        sums = (jnp.concatenate(dk, axis=1), jnp.concatenate(dv, axis=1))
        dkv = ring_shift(sums, axis, axis_size, f"{RING_SHIFT_SCOPE}_grads")
        kv = passed
    dk, dv = dkv
    return (
        jnp.concatenate(dq, axis=1).reshape(b, r, h, kw).astype(q_BRHK.dtype),
        dk.astype(k_BRGK.dtype),
        dv.astype(v_BRGK.dtype),
        None,
        None,
    )


_ring.defvjp(_ring_fwd, _ring_bwd)


@jax.custom_vjp
def _sum_over_context(x):
    # all-reduce over context: the whole sequence's sum of per-slice partial sums
    return jax.lax.psum(x, AXIS)


def _sum_fwd(x):
    return _sum_over_context(x), None


def _sum_bwd(_, g):
    # Each rank uses the sum in a loss term of its own (weighted by its own tokens), so a partial's gradient is
    # the sum of every rank's cotangent: all-reduce (not the identity of a term every rank computes alike).
    return (jax.lax.psum(g, AXIS),)


_sum_over_context.defvjp(_sum_fwd, _sum_bwd)


def _slice_table(seq_len: int, c: int) -> np.ndarray:
    """int32 [c, T/c]: row i is the original positions device i holds in the load-balanced layout."""
    return balanced_order(seq_len, c).reshape(c, seq_len // c).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """The context-parallel setting handed to every layer (through `jaxpar.parallel.tensor.TensorParallel.context`).

    Attributes:
      size: c, the `context` mesh axis size; 1 means no context parallelism (no collectives at all).
      strategy: `all_gather` or `ring` (`context.strategy`; module docstring).
    """

    size: int = 1
    strategy: str = "all_gather"

    def __post_init__(self):
        if self.strategy not in CONTEXT_STRATEGIES:
            raise ValueError(f"context strategy {self.strategy!r}; expected one of {CONTEXT_STRATEGIES}")

    @property
    def active(self) -> bool:
        return self.size > 1

    def positions(self, local_len: int) -> jax.Array:
        """int32 [R]: the original (global) positions of this device's R = `local_len` tokens in the load-balanced
        layout (`balanced_order`); arange(R) when inactive."""
        if not self.active:
            return jnp.arange(local_len, dtype=jnp.int32)
        table = jnp.asarray(_slice_table(local_len * self.size, self.size))
        return table[jax.lax.axis_index(AXIS)]

    def sequence_sum(self, x: jax.Array) -> jax.Array:
        """This device's partial sum over its slice of each sequence (e.g. [B, E] router statistics) -> the
        whole sequence's sum (all-reduce over `context`; backward all-reduce too: every rank's loss term uses
        it). Identity when inactive."""
        return _sum_over_context(x) if self.active else x

    def gather_sequence(self, x_BR: jax.Array) -> jax.Array:
        """[B, R, ...] slices in natural order (device i holding positions i*R .. (i+1)*R - 1, as the step's
        batch arrives) -> [B, T, ...] the whole sequence on every device (all-gather over `context`)."""
        return jax.lax.all_gather(x_BR, AXIS, axis=SEQ_DIM, tiled=True) if self.active else x_BR

    def local_slice(self, x_BT: jax.Array) -> jax.Array:
        """[B, T, ...] whole sequences in natural order -> [B, R, ...]: this device's slice of the load-balanced
        layout (chunks i and 2c - 1 - i)."""
        if not self.active:
            return x_BT
        return jnp.take(x_BT, self.positions(x_BT.shape[SEQ_DIM] // self.size), axis=SEQ_DIM)


NO_CONTEXT_PARALLEL = ContextParallel()
