"""Fused attention kernels behind one interface, for attention computed in pieces (context parallelism): each call
returns its output and the log-sum-exp of every query's scores, and its backward takes the statistics of a larger
softmax the call is part of (FlashAttention-2's backward, Dao 2023, algorithm 2, reads only the output, the
log-sum-exp and the output gradient per query).

Shape letters: B batch, Nq queries and Nk keys of a call, H query heads, G key/value heads (G divides H), K head
width.

`CUDNN_KERNEL` is cuDNN's fused flash kernel through jax's cuDNN module (`jaxpar.parallel.jax_private.
cudnn_attention_parts`); its causal mask is the top-left diagonal of the call, counted from each segment's first
position. `XLA_KERNEL` computes the same with explicit softmax in fp32: the CPU tests run the pieces with it, and the
GPU acceptance run compares cuDNN's with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.parallel import jax_private
from jaxpar.parallel.context import grouped_heads


class Call(NamedTuple):
    """Which keys a kernel call's queries see, besides its causal flag (given apart: the diagonal block's calls are
    causal, the prefix's not). Either one packed segment layout for queries and keys alike (`offsets` int32
    [B, max_segments + 1], `lengths` [B, max_segments], -1 after the last: `jaxpar.model.attention.
    packed_segments`), or per-row lengths (`q_lengths`, `kv_lengths` int32 [B]: queries and keys past them see and
    are seen by nothing), or neither (all of them). Causal: query r sees key m <= r, counted from the segment's first
    position when packed."""

    q_lengths: jax.Array | None = None
    kv_lengths: jax.Array | None = None
    offsets: jax.Array | None = None
    lengths: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A fused attention kernel with segments (module docstring).

    forward(q [B, Nq, H, K], k, v [B, Nk, G, K], call, causal) -> (out [B, Nq, H, K] in q's dtype, lse fp32
      [B, Nq, H]: log sum exp of each query's scaled scores over its visible keys (`Call`); undefined where it sees
      none, which the caller masks).
    backward(q, k, v, out, lse, d_out, call, causal) -> (dq, dk, dv) in the inputs' dtypes, from the softmax
      statistics given (which may be those of a larger softmax the call is part of).
    """

    name: str
    forward: Callable
    backward: Callable


def within_lengths(lengths: jax.Array, size: int) -> jax.Array:
    """bool [B, size, 1, 1]: the positions before each row's length."""
    return (jnp.arange(size)[None, :] < lengths[:, None])[:, :, None, None]


def _visible(call: Call, nq: int, nk: int, causal: bool) -> jax.Array:
    """bool [B, Nq, Nk]: which keys each query of a kernel call sees (`Call`)."""
    qpos, kpos = jnp.arange(nq)[None, :, None], jnp.arange(nk)[None, None, :]
    if call.offsets is not None:
        assert call.lengths is not None  # given with the offsets
        start, length = call.offsets[:, None, None, :-1], call.lengths[:, None, None, :]
        q_in = (qpos[..., None] >= start) & (qpos[..., None] < start + length) & (length > 0)
        k_in = (kpos[..., None] >= start) & (kpos[..., None] < start + length)
        return jnp.any(q_in & k_in & ((qpos >= kpos)[..., None] if causal else True), axis=-1)
    mask = jnp.ones((1, nq, nk), bool)
    if call.q_lengths is not None:
        mask = mask & (qpos < call.q_lengths[:, None, None])
    if call.kv_lengths is not None:
        mask = mask & (kpos < call.kv_lengths[:, None, None])
    return mask & (qpos >= kpos) if causal else mask


def _xla_probabilities(q, k, call, causal, lse=None):
    """(scaled scores' probabilities fp32 [B, Nq, G, H/G, Nk] under the call's mask, lse fp32 [B, Nq, G, H/G])."""
    g, kw = k.shape[2], q.shape[-1]
    scores = jnp.einsum("bsgrk,btgk->bsgrt", grouped_heads(q, g), k.astype(jnp.float32)) / np.sqrt(kw)
    mask = _visible(call, q.shape[1], k.shape[1], causal)[:, :, None, None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    if lse is None:
        lse = jax.nn.logsumexp(scores, axis=-1)
    return jnp.exp(jnp.where(mask, scores - lse[..., None], -jnp.inf)), lse


def _xla_forward(q, k, v, call, causal):
    b, nq, h, kw = q.shape
    p, lse = _xla_probabilities(q, k, call, causal)
    out = jnp.einsum("bsgrt,btgk->bsgrk", p, v.astype(jnp.float32)).reshape(b, nq, h, kw)
    return out.astype(q.dtype), lse.reshape(b, nq, h)


def _xla_backward(q, k, v, out, lse, d_out, call, causal):
    b, nq, h, kw = q.shape
    g = k.shape[2]
    p, _ = _xla_probabilities(q, k, call, causal, lse.reshape(b, nq, g, h // g))
    do = grouped_heads(d_out, g)
    delta = jnp.sum(do * grouped_heads(out, g), axis=-1)
    dv = jnp.einsum("bsgrt,bsgrk->btgk", p, do)
    ds = p * (jnp.einsum("bsgrk,btgk->bsgrt", do, v.astype(jnp.float32)) - delta[..., None]) / np.sqrt(kw)
    dq = jnp.einsum("bsgrt,btgk->bsgrk", ds, k.astype(jnp.float32)).reshape(b, nq, h, kw)
    dk = jnp.einsum("bsgrt,bsgrk->btgk", ds, grouped_heads(q, g))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


XLA_KERNEL = Kernel("xla", _xla_forward, _xla_backward)


def _cudnn_call(q, call: Call, causal: bool) -> dict:
    """The keyword arguments of cuDNN's fused attention for a call (`Call`): packed segments, per-row lengths
    (padding), or neither; the causal diagonal is top-left, from each segment's first position."""
    _, _, mask_type, _ = jax_private.cudnn_attention_parts()
    b = q.shape[0]
    if call.offsets is not None:
        kw = {
            "q_seqlen": call.lengths,
            "kv_seqlen": call.lengths,
            "q_offsets": call.offsets,
            "kv_offsets": call.offsets,
        }
        mask = mask_type.PADDING_CAUSAL if causal else mask_type.PADDING
    elif call.q_lengths is not None or call.kv_lengths is not None:
        full = jnp.full((b,), q.shape[1], jnp.int32)
        q_len = full if call.q_lengths is None else call.q_lengths
        kv_len = full if call.kv_lengths is None else call.kv_lengths
        kw = {"q_seqlen": q_len, "kv_seqlen": kv_len, "q_offsets": None, "kv_offsets": None}
        mask = mask_type.PADDING_CAUSAL if causal else mask_type.PADDING
    else:
        kw = {"q_seqlen": None, "kv_seqlen": None, "q_offsets": None, "kv_offsets": None}
        mask = mask_type.CAUSAL if causal else mask_type.NO_MASK
    return {**kw, "scale": 1.0 / float(np.sqrt(q.shape[-1])), "mask_type": mask}


def _cudnn_forward(q, k, v, call, causal):
    attention, _, _, _ = jax_private.cudnn_attention_parts()
    kw = _cudnn_call(q, call, causal)
    out, stats = attention(q, k, v, qkv_layout="BTNH", return_residual=True, **kw)
    return out, _stats_to_lse(stats, call, q.shape)


def _cudnn_backward(q, k, v, out, lse, d_out, call, causal):
    _, backward, _, layout = jax_private.cudnn_attention_parts()
    kw = _cudnn_call(q, call, causal)
    unused = jnp.zeros(0, q.dtype)

    def given(x):
        return unused if x is None else x

    lengths_offsets = tuple(given(kw[k]) for k in ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets"))
    residuals = (q, k, v, unused, *lengths_offsets, unused, unused, _lse_to_stats(lse, call, q.shape), out)
    grads = backward(kw["scale"], 42, 0.0, (False, False), kw["mask_type"], layout, None, True, False, residuals, d_out)
    return grads[0], grads[1], grads[2]


def _stats_slots(call: Call, q_shape) -> tuple[jax.Array, jax.Array]:
    """Where cuDNN keeps each query's softmax statistic in a packed call: (slot int32 [B, Nq], position in the
    slot [B, Nq]). Its statistics are [B * S, H, Nq]: one slot per segment, the segments of all rows in order
    without the absent ones (the layout cuDNN's packed call is given, `jax_private.cudnn_attention_parts`), each
    slot indexed by the position within the segment."""
    b, nq = q_shape[:2]
    assert call.offsets is not None and call.lengths is not None  # a packed call
    starts, lengths = call.offsets[:, :-1], call.lengths
    present = lengths > 0
    before = jnp.cumsum(jnp.sum(present, axis=1)) - jnp.sum(present, axis=1)  # segments in earlier rows
    pos = jnp.arange(nq)[None, :, None]
    inside = (pos >= starts[:, None, :]) & (pos < (starts + lengths)[:, None, :]) & present[:, None, :]
    seg = jnp.argmax(inside, axis=-1)  # [B, Nq]
    slot = before[:, None] + seg
    within = jnp.arange(nq)[None, :] - jnp.take_along_axis(starts, seg, axis=1)
    return slot.astype(jnp.int32), within.astype(jnp.int32)


def _stats_to_lse(stats: jax.Array, call: Call, q_shape) -> jax.Array:
    """cuDNN's softmax statistics (natural-log log-sum-exp; [B, H, Nq], or per segment slot in a packed call) ->
    fp32 [B, Nq, H]."""
    b, nq, h, _ = q_shape
    if call.offsets is None:
        return jnp.swapaxes(stats.reshape(b, h, nq), 1, 2).astype(jnp.float32)
    slot, within = _stats_slots(call, q_shape)
    return stats[slot, :, within].astype(jnp.float32)  # [B, Nq, H]


def _lse_to_stats(lse: jax.Array, call: Call, q_shape) -> jax.Array:
    """The inverse of `_stats_to_lse`: fp32 [B, Nq, H] -> cuDNN's statistics layout."""
    b, nq, h, _ = q_shape
    if call.offsets is None:
        return jnp.swapaxes(lse, 1, 2)
    slot, within = _stats_slots(call, q_shape)
    assert call.lengths is not None  # a packed call
    slots = b * call.lengths.shape[1]
    return jnp.zeros((slots, h, nq), jnp.float32).at[slot, :, within].set(lse)


CUDNN_KERNEL = Kernel("cudnn", _cudnn_forward, _cudnn_backward)
