"""Ring attention on a fused kernel (`context.strategy: ring` where `model.attention` resolves to cudnn): the ring of
`jaxpar.parallel.context.ring_attention`, each sub-block a kernel call of `jaxpar.model.attention_kernels`
instead of XLA einsums, so that no block's scores are in memory.

Shape letters: B batch, R = T/c a device's slice, n = R/2 a chunk, H query heads, G key/value heads, K head width,
c the context size.

In step s device i holds device (i - s) mod c's K/V block; its two query chunks and the block's two key chunks are
four sub-blocks. The chunks of the load-balanced layout never overlap, so a sub-block is one of:
  * the diagonal (step 0, a query chunk against its own keys): a causal call, the chunk's documents as the packed
    segments of queries and keys alike;
  * keys wholly in the queries' past: a call without a causal mask; with packed documents only the query chunk's
    first run can continue the key chunk's last run (a document is one run of ids), so the call sees those two
    runs (the keys moved to the front, both cut by their lengths) and nothing when the ids differ;
  * keys wholly in the future: skipped.
The early query chunk never sees the late key chunk of any block (left out); the late query chunk sees all of the
early key chunk of every other block (always run without documents); the rest run in a `lax.cond` on whether any
query sees any key (the ring's skip). The
partial results merge by their log-sum-exps in fp32 (lse = logaddexp(lse_a, lse_b), o = exp(lse_a - lse) o_a +
exp(lse_b - lse) o_b: the online softmax of FlashAttention, Milakov and Gimelshein 2018). The backward (custom VJP)
is the second ring pass: the blocks go around again with their fp32 dK and dV sums, each computed sub-block's
kernel backward run with the final output and log-sum-exp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar.model.attention import packed_segments, run_lengths
from jaxpar.model.attention_kernels import Call, Kernel, within_lengths
from jaxpar.parallel.context import AXIS, RING_SCOPE, RING_SHIFT_SCOPE, chunk_halves, ring_shift, visible_block


def ring_kernel_attention(
    q_BRHK: jax.Array,
    k_BRGK: jax.Array,
    v_BRGK: jax.Array,
    positions_BR: jax.Array,
    segment_ids_BR: jax.Array | None,
    axis_size: int,
    kernel: Kernel,
    max_segments: int,
) -> jax.Array:
    """Causal attention of this device's queries to the whole sequence around the ring of `context`, each
    sub-block a `kernel` call (module docstring). Inside shard_map; returns [B, R, H, K] in q's dtype (NaN in a row
    whose chunk holds more than `max_segments` documents)."""
    documents = segment_ids_BR is not None
    segments = segment_ids_BR if documents else jnp.zeros_like(positions_BR)
    return _ring(q_BRHK, k_BRGK, v_BRGK, positions_BR, segments, axis_size, kernel, max_segments, documents)


def _calls(q_pos, q_seg, k_pos, k_seg, diagonal: bool, documents: bool, max_segments: int):
    """(call, causal, key shift int32 [B] (the keys rolled left by it before the call), any visible, overflow [B])
    of one sub-block (module docstring)."""
    b = q_pos.shape[0]
    visible = jnp.any(visible_block(q_pos, k_pos, q_seg, k_seg))
    zero = jnp.zeros((b,), jnp.int32)
    if diagonal:
        if not documents:
            return Call(), True, zero, visible, jnp.zeros((b,), bool)
        offsets, lengths, overflow = packed_segments(q_seg, max_segments)
        return Call(offsets=offsets, lengths=lengths), True, zero, visible, overflow
    if not documents:
        return Call(), False, zero, visible, jnp.zeros((b,), bool)
    first, last_start = run_lengths(q_seg)[0], run_lengths(k_seg)[1]
    match = q_seg[:, 0] == k_seg[:, -1]
    n = k_seg.shape[1]
    call = Call(q_lengths=jnp.where(match, first, 0), kv_lengths=jnp.where(match, n - last_start, 0))
    return call, False, last_start, visible, jnp.zeros((b,), bool)


def _roll(x_BnGK: jax.Array, shift: jax.Array) -> jax.Array:
    """Each row's keys rolled left by its `shift` (int32 [B])."""
    return jax.vmap(lambda x, s: jnp.roll(x, -s, axis=0))(x_BnGK, shift)


def _unroll(x_BnGK: jax.Array, shift: jax.Array) -> jax.Array:
    return jax.vmap(lambda x, s: jnp.roll(x, s, axis=0))(x_BnGK, shift)


def _rows_seen(call: Call, n: int) -> jax.Array:
    """bool [B, n, 1]: the queries a call's lengths let see some key (all of them without lengths)."""
    if call.q_lengths is None or call.kv_lengths is None:  # the calls set both or neither
        return jnp.ones((1, n, 1), bool)
    return within_lengths(call.q_lengths, n)[..., 0] & (call.kv_lengths > 0)[:, None, None]


def _keys_seen(call: Call, n: int) -> jax.Array:
    if call.q_lengths is None or call.kv_lengths is None:
        return jnp.ones((1, n, 1, 1), bool)
    return within_lengths(call.kv_lengths, n) & (call.q_lengths > 0)[:, None, None, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _ring(q, k, v, positions, segments, axis_size, kernel, max_segments, documents):
    return _ring_fwd(q, k, v, positions, segments, axis_size, kernel, max_segments, documents)[0]


def _sub_blocks(step: int, documents: bool):
    """(a, b, run) of a step's sub-blocks, run "diagonal" (step 0, a query chunk against its own keys), "always" or
    "cond" (when one of its queries sees one of its keys). In the load-balanced layout query chunk 0 of device i
    (chunk i of 2c) never sees key chunk 1 of any block (chunk 2c - 1 - j >= c > i): left out. Query chunk 1 (chunk
    2c - 1 - i) sees all of key chunk 0 (chunk j < c) of every other block: always run without documents."""
    for a, b in ((0, 0), (1, 0), (1, 1)):
        if step == 0:
            yield a, b, "diagonal" if a == b else ("cond" if documents else "always")
        else:
            yield a, b, "always" if (a, b) == (1, 0) and not documents else "cond"


def _ring_fwd(q, k, v, positions, segments, axis_size, kernel, max_segments, documents):
    b, r, h, kw = q.shape
    n = r // 2
    qs, q_pos, q_seg = chunk_halves(q, n), chunk_halves(positions, n), chunk_halves(segments, n)
    acc = [(jnp.zeros(qa.shape, jnp.float32), jnp.full((b, n, h), -jnp.inf, jnp.float32)) for qa in qs]
    overflow = jnp.zeros((b,), bool)
    kv = (k, v, positions, segments)
    for step in range(axis_size):
        passed = ring_shift(kv, AXIS, axis_size) if step < axis_size - 1 else kv
        keys = [chunk_halves(x, n) for x in kv]
        for a, kb, run in _sub_blocks(step, documents):
            kk, vv, k_pos, k_seg = (x[kb] for x in keys)
            diagonal = run == "diagonal"
            call, causal, shift, visible, over = _calls(
                q_pos[a], q_seg[a], k_pos, k_seg, diagonal, documents, max_segments
            )
            overflow = overflow | over

            def block(kk=kk, vv=vv, call=call, causal=causal, shift=shift, a=a):
                o, lse = kernel.forward(qs[a], _roll(kk, shift), _roll(vv, shift), call, causal)
                seen = _rows_seen(call, n)
                return jnp.where(seen[..., None], o.astype(jnp.float32), 0.0), jnp.where(seen, lse, -jnp.inf)

            def skip():
                return jnp.zeros(qs[0].shape, jnp.float32), jnp.full((b, n, h), -jnp.inf, jnp.float32)

            with jax.named_scope(f"{RING_SCOPE}/f{step}q{a}k{kb}"):
                o_blk, lse_blk = jax.lax.cond(visible, block, skip) if run == "cond" else block()
            o_acc, lse_acc = acc[a]
            lse = jnp.logaddexp(lse_acc, lse_blk)
            # exp(-inf - -inf) is NaN where neither part has seen a key yet: the weights are 0 there
            w_acc = jnp.where(jnp.isfinite(lse_acc), jnp.exp(lse_acc - lse), 0.0)[..., None]
            w_blk = jnp.where(jnp.isfinite(lse_blk), jnp.exp(lse_blk - lse), 0.0)[..., None]
            acc[a] = (w_acc * o_acc + w_blk * o_blk, lse)
        kv = passed
    out = jnp.concatenate([o for o, _ in acc], axis=1)
    out = jnp.where(overflow[:, None, None, None], jnp.nan, out).astype(q.dtype)
    lse = jnp.concatenate([lse for _, lse in acc], axis=1)
    return out, (q, k, v, positions, segments, out, lse)


def _ring_bwd(axis_size, kernel, max_segments, documents, residuals, d_out):
    q, k, v, positions, segments, out, lse = residuals
    n = q.shape[1] // 2
    qs, q_pos, q_seg = chunk_halves(q, n), chunk_halves(positions, n), chunk_halves(segments, n)
    outs, lses, d_outs = chunk_halves(out, n), chunk_halves(lse, n), chunk_halves(d_out, n)
    dq = [jnp.zeros(qa.shape, jnp.float32) for qa in qs]
    dkv = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    kv = (k, v, positions, segments)
    for step in range(axis_size):
        passed = ring_shift(kv, AXIS, axis_size) if step < axis_size - 1 else kv
        keys = [chunk_halves(x, n) for x in kv]
        dk, dv = (chunk_halves(x, n) for x in dkv)
        for a, kb, run in _sub_blocks(step, documents):
            kk, vv, k_pos, k_seg = (x[kb] for x in keys)
            diagonal = run == "diagonal"
            call, causal, shift, visible, _ = _calls(
                q_pos[a], q_seg[a], k_pos, k_seg, diagonal, documents, max_segments
            )

            def block(dq_a, dk_b, dv_b, kk=kk, vv=vv, call=call, causal=causal, shift=shift, a=a):
                g = kernel.backward(
                    qs[a], _roll(kk, shift), _roll(vv, shift), outs[a], lses[a], d_outs[a], call, causal
                )
                seen_q, seen_k = _rows_seen(call, n)[..., None], _keys_seen(call, n)
                dq_a = dq_a + jnp.where(seen_q, g[0].astype(jnp.float32), 0.0)
                dk_b = dk_b + _unroll(jnp.where(seen_k, g[1].astype(jnp.float32), 0.0), shift)
                dv_b = dv_b + _unroll(jnp.where(seen_k, g[2].astype(jnp.float32), 0.0), shift)
                return dq_a, dk_b, dv_b

            with jax.named_scope(f"{RING_SCOPE}/b{step}q{a}k{kb}"):
                args = (dq[a], dk[kb], dv[kb])
                if run == "cond":
                    dq[a], dk[kb], dv[kb] = jax.lax.cond(visible, block, lambda *x: x, *args)
                else:
                    dq[a], dk[kb], dv[kb] = block(*args)
        sums = (jnp.concatenate(dk, axis=1), jnp.concatenate(dv, axis=1))
        dkv = ring_shift(sums, AXIS, axis_size, f"{RING_SHIFT_SCOPE}_grads")
        kv = passed
    d_k, d_v = dkv
    return jnp.concatenate(dq, axis=1).astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)
