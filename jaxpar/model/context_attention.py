"""Attention under context parallelism (`mesh.context` > 1) as the model runs it: the strategy and the kernel.

Shape letters: B batch, T the whole sequence, R = T/c this device's slice, n = T/(2c) one chunk of the load-balanced
layout (`jaxpar.parallel.context.balanced_order`: device i holds chunks i and 2c - 1 - i), H query heads, G key/value
heads, K head width, c the context size.

`context_attention` picks the path: `ring` with XLA's attention (`jaxpar.parallel.context.ring_attention`, einsums)
or on cuDNN's fused kernel (`jaxpar.model.context_ring`), `all_gather` with XLA's attention (`gathered_kv_attention`:
one call with an explicit [R, T] mask), or `all_gather` with cuDNN's fused kernel (`gathered_chunk_attention`,
below).

A fused kernel takes no mask array: it masks by a causal diagonal that starts at the first query and the first key
(cuDNN's is top-left aligned: query r sees key m <= r), and by segments given as offsets and lengths. A query chunk
j of the load-balanced layout starts at position j*n and sees the keys [0, (j + 1)*n): its diagonal does not start
at its first key. So each chunk is two kernel calls on the whole sequence's keys in natural order:
  * the diagonal block: the chunk's n queries against keys [j*n, (j + 1)*n), causal (the square block, where
    top-left is the diagonal), packed documents as the chunk's own runs of segment ids (the same offsets for queries
    and keys: `jaxpar.model.attention.packed_segments`);
  * the prefix: the same queries against keys [0, (2c - 1)*n), no causal mask (every key before the chunk is in its
    past), the keys past j*n cut by the segment's length: without documents one segment per row, queries [0, n)
    and keys [0, j*n); with documents only the chunk's first run can continue a document of the prefix (a document is
    one run of ids), so one segment: queries [0, first run's length), keys [start of the prefix's last run, j*n),
    and none when the ids differ or j = 0.
Their outputs combine by their log-sum-exps, which the kernel returns (lse = logaddexp(lse_d, lse_p), o = exp(lse_d
- lse) o_d + exp(lse_p - lse) o_p, in fp32): the same softmax over all the chunk's keys. The backward (a custom VJP)
runs the kernel's backward of each call with the combined output and log-sum-exp, which is the gradient of the
whole softmax restricted to that call's keys (FlashAttention-2's backward, Dao 2023, algorithm 2, reads only O,
the log-sum-exp and dO per query). The keys' gradients add over the calls, go back to the gathered order and
reduce-scatter over `context` (the all-gather's transpose).

The kernels and their interface are `jaxpar.model.attention_kernels`; `XLA_KERNEL` there computes the same with
explicit softmax, which the CPU tests run this path on.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.model.attention import packed_segments, run_lengths, segment_positions
from jaxpar.model.attention_kernels import CUDNN_KERNEL, Call, Kernel, within_lengths
from jaxpar.model.context_ring import ring_kernel_attention
from jaxpar.parallel.context import AXIS, ContextParallel, balanced_order, gathered_kv_attention, ring_attention


def context_attention(
    q_BRHK: jax.Array,
    k_BRGK: jax.Array,
    v_BRGK: jax.Array,
    segment_ids_BR: jax.Array | None,
    cp: ContextParallel,
    implementation: str,
    max_segments: int,
) -> jax.Array:
    """Causal attention of this device's R queries to the whole sequence (inside shard_map), by `cp.strategy` and,
    for all_gather, the resolved `implementation` (xla or cudnn). Returns [B, R, H, K] in q's dtype.

    With cudnn a chunk holding more than `max_segments` documents gets a NaN output (as
    `jaxpar.model.attention.dot_product_attention`), which the step's non-finite check reports."""
    b, r = q_BRHK.shape[:2]
    positions_BR = jnp.broadcast_to(cp.positions(r), (b, r))
    if cp.strategy == "ring" and implementation == "cudnn":
        return ring_kernel_attention(
            q_BRHK, k_BRGK, v_BRGK, positions_BR, segment_ids_BR, cp.size, CUDNN_KERNEL, max_segments
        )
    if cp.strategy == "ring":
        return ring_attention(q_BRHK, k_BRGK, v_BRGK, positions_BR, segment_ids_BR, AXIS, cp.size)
    if implementation == "cudnn":
        return gathered_chunk_attention(q_BRHK, k_BRGK, v_BRGK, segment_ids_BR, cp, CUDNN_KERNEL, max_segments)
    return gathered_kv_attention(q_BRHK, k_BRGK, v_BRGK, positions_BR, segment_ids_BR, AXIS)


def gathered_chunk_attention(
    q_BRHK: jax.Array,
    k_BRGK: jax.Array,
    v_BRGK: jax.Array,
    segment_ids_BR: jax.Array | None,
    cp: ContextParallel,
    kernel: Kernel,
    max_segments: int,
) -> jax.Array:
    """All-gather context attention with a fused kernel, two calls per query chunk (module docstring). Inside
    shard_map; returns [B, R, H, K] in q's dtype."""
    b, r = q_BRHK.shape[:2]
    c, n = cp.size, r // 2
    t = r * c
    natural = np.argsort(balanced_order(t, c))  # gathered (layout) order -> natural order

    def gather(x):
        return jnp.take(jax.lax.all_gather(x, AXIS, axis=1, tiled=True), natural, axis=1)

    k_all, v_all = gather(k_BRGK), gather(v_BRGK)
    seg_all = None if segment_ids_BR is None else gather(segment_ids_BR)
    i = jax.lax.axis_index(AXIS)
    halves = []
    for half, chunk in ((0, i), (1, 2 * c - 1 - i)):
        q_chunk = q_BRHK[:, half * n : (half + 1) * n]
        halves.append(_chunk(q_chunk, k_all, v_all, seg_all, chunk, kernel, max_segments))
    return jnp.concatenate(halves, axis=1)


def _chunk(q_BnHK, k_all, v_all, seg_all, chunk, kernel: Kernel, max_segments: int) -> jax.Array:
    """Query chunk `chunk` (traced int: which of the 2c chunks) against the whole sequence's keys in natural order:
    the diagonal block and the prefix (module docstring)."""
    b, n = q_BnHK.shape[:2]
    start = chunk * n
    k_diag = jax.lax.dynamic_slice_in_dim(k_all, start, n, axis=1)
    v_diag = jax.lax.dynamic_slice_in_dim(v_all, start, n, axis=1)
    prefix = k_all.shape[1] - n  # the longest prefix (the last chunk's); shorter ones are cut by their length
    rows = jnp.ones((b,), jnp.int32)
    if seg_all is None:
        diag = Call()
        pre = Call(q_lengths=rows * n, kv_lengths=rows * start)
        k_pre, v_pre = k_all[:, :prefix], v_all[:, :prefix]
        overflow = jnp.zeros((b,), bool)
    else:
        seg_q = jax.lax.dynamic_slice_in_dim(seg_all, start, n, axis=1)
        offsets, lengths, overflow = packed_segments(seg_q, max_segments)
        diag = Call(offsets=offsets, lengths=lengths)
        # Only the chunk's first run can continue a document of the prefix: the prefix's last run, [run_start,
        # start). Its keys are moved to the front (per row), so that the call's lengths cut them from the right.
        before = jnp.maximum(start - 1, 0)
        last_id = jax.lax.dynamic_index_in_dim(seg_all, before, axis=1, keepdims=False)
        run_start = before - jax.lax.dynamic_index_in_dim(segment_positions(seg_all), before, 1, keepdims=False)
        continues = (start > 0) & (last_id == seg_q[:, 0])
        first_run = run_lengths(seg_q)[0]
        pre = Call(q_lengths=jnp.where(continues, first_run, 0), kv_lengths=jnp.where(continues, start - run_start, 0))

        def front(x_TGK, shift):
            return jax.lax.dynamic_slice_in_dim(jnp.roll(x_TGK, -shift, axis=0), 0, prefix, axis=0)

        k_pre, v_pre = (jax.vmap(front)(x, run_start) for x in (k_all, v_all))
    out = _two_calls(q_BnHK, k_diag, v_diag, k_pre, v_pre, diag, pre, kernel)
    return jnp.where(overflow[:, None, None, None], jnp.nan, out).astype(q_BnHK.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _two_calls(q, k_d, v_d, k_p, v_p, diag: Call, pre: Call, kernel: Kernel):
    return _two_calls_fwd(q, k_d, v_d, k_p, v_p, diag, pre, kernel)[0]


def _two_calls_fwd(q, k_d, v_d, k_p, v_p, diag, pre, kernel):
    o_d, lse_d = kernel.forward(q, k_d, v_d, diag, True)
    o_p, lse_p = kernel.forward(q, k_p, v_p, pre, False)
    # queries that see some prefix key; the kernel's lse and output elsewhere are not read
    seen = within_lengths(pre.q_lengths, q.shape[1])[..., 0] & (pre.kv_lengths > 0)[:, None, None]  # [B, n, 1]
    lse_p = jnp.where(seen, lse_p, -jnp.inf)
    lse = jnp.logaddexp(lse_d, lse_p)
    w_d, w_p = jnp.exp(lse_d - lse)[..., None], jnp.exp(lse_p - lse)[..., None]
    o_p32 = jnp.where(seen[..., None], o_p.astype(jnp.float32), 0.0)
    out = (w_d * o_d.astype(jnp.float32) + w_p * o_p32).astype(q.dtype)
    return out, (q, k_d, v_d, k_p, v_p, diag, pre, out, lse)


def _two_calls_bwd(kernel, residuals, d_out):
    q, k_d, v_d, k_p, v_p, diag, pre, out, lse = residuals
    dq_d, dk_d, dv_d = kernel.backward(q, k_d, v_d, out, lse, d_out, diag, True)
    dq_p, dk_p, dv_p = kernel.backward(q, k_p, v_p, out, lse, d_out, pre, False)
    # what the prefix call's masked rows hold is not defined: select (a multiply would carry a NaN through)
    seen_q = within_lengths(pre.q_lengths, q.shape[1]) & (pre.kv_lengths > 0)[:, None, None, None]
    seen_k = within_lengths(pre.kv_lengths, k_p.shape[1]) & (pre.q_lengths > 0)[:, None, None, None]
    dq = dq_d.astype(jnp.float32) + jnp.where(seen_q, dq_p.astype(jnp.float32), 0.0)
    dk_p = jnp.where(seen_k, dk_p, jnp.zeros_like(dk_p))
    dv_p = jnp.where(seen_k, dv_p, jnp.zeros_like(dv_p))
    zero_calls = (jax.tree.map(lambda _: None, diag), jax.tree.map(lambda _: None, pre))
    return (dq.astype(q.dtype), dk_d, dv_d, dk_p, dv_p, *zero_calls)


_two_calls.defvjp(_two_calls_fwd, _two_calls_bwd)
