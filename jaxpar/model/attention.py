"""Causal self-attention over (optionally packed) sequences, by the implementation `model.attention` resolves to
(`jaxpar.config.attention`): XLA's, or cuDNN's fused flash-attention kernel.

Shape letters: B batch, T sequence, H query heads, G key/value heads (G divides H: grouped-query attention), K
head width; `max_segments` (`model.max_segments`) is the most segments one sequence may hold.

Packed documents: `segment_ids` int32 [B, T] numbers the documents of each row; a token attends to the earlier
tokens of its own document only (causal and same segment id). A document is a run of equal ids: ids need not
be increasing, but one id must not appear in two runs of a row (the cuDNN path takes each run as a document; the
XLA path would join them). Without segment ids the whole row is one document.

Sliding window (`model.sliding_window` = W; Mistral, Jiang et al. 2023, section 2): query t also sees only keys
s > t - W, itself and the W - 1 before it, as transformers' Mistral mask does. Inside a packed document a token's
position and its position within the document differ by the document's start, so the same band holds in either
count: XLA's mask and cuDNN's `sliding_window_length` (which counts within each packed segment) agree.

Score scale and soft-capping (Gemma 2, Gemma Team 2024, section 2): the scores q k^T are scaled by `scale`
(default K ** -0.5), then with `softcap` c become c * tanh(scores / c) before the mask and softmax. XLA's path only:
jax's fused attention takes no soft-capping, so a capped call runs the einsums itself (the same [B, H, T, T] fp32
scores XLA's path writes); cuDNN's kernel refuses it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config.attention import ATTENTION_IMPLEMENTATIONS
from jaxpar.parallel import jax_private


def segment_mask(segment_ids_BT: jax.Array) -> jax.Array:
    """bool [B, 1, T, T]: query t may see key s when both carry the same segment id (causality is applied by
    the attention call)."""
    return segment_ids_BT[:, None, :, None] == segment_ids_BT[:, None, None, :]


def segment_positions(segment_ids_BT: jax.Array) -> jax.Array:
    """int32 [B, T]: each token's position within its run of equal segment ids (0 at each document's first
    token), the rotary positions of packed documents, so a document sees the positions it would alone."""
    b, t = segment_ids_BT.shape
    index_T = jnp.arange(t, dtype=jnp.int32)
    starts_BT = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    run_start_BT = jax.lax.cummax(jnp.where(starts_BT, index_T[None, :], 0), axis=1)
    return index_T[None, :] - run_start_BT


def run_lengths(segment_ids_Bn: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(length of each row's first run of equal segment ids, start of its last run), int32 [B] each: the document a
    slice of a row begins inside, and the one it ends inside."""
    n = segment_ids_Bn.shape[1]
    first = jnp.sum(jnp.cumprod(segment_ids_Bn == segment_ids_Bn[:, :1], axis=1), axis=1)
    last = jnp.sum(jnp.cumprod((segment_ids_Bn == segment_ids_Bn[:, -1:])[:, ::-1], axis=1), axis=1)
    return first.astype(jnp.int32), (n - last).astype(jnp.int32)


def packed_segments(segment_ids_BT: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """cuDNN's packed layout of `segment_ids_BT`: each run of equal ids is one segment.

    Returns:
      offsets int32 [B, max_segments + 1]: the first position of each segment, -1 after the last one;
      lengths int32 [B, max_segments]: each segment's length, -1 after the last one;
      overflow bool [B]: the row holds more than max_segments segments (its later segments are not in the layout).
    """
    b, t = segment_ids_BT.shape
    starts_BT = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    n_B = jnp.sum(starts_BT, axis=1)

    def row(starts_T):
        first = jnp.nonzero(starts_T, size=max_segments, fill_value=t)[0].astype(jnp.int32)
        ends = jnp.concatenate([first[1:], jnp.full((1,), t, jnp.int32)])
        present = first < t
        lengths = jnp.where(present, ends - first, -1)
        offsets = jnp.concatenate([jnp.where(present, first, -1), jnp.full((1,), -1, jnp.int32)])
        return offsets, lengths

    offsets, lengths = jax.vmap(row)(starts_BT)
    return offsets, lengths, n_B > max_segments


def _default_scale(head_width: int, scale: float | None) -> float:
    """`scale`, or K ** -0.5 computed as jax's attention computes its default (1 / sqrt(K), the same float)."""
    return 1.0 / float(np.sqrt(head_width)) if scale is None else scale


def _cudnn_packed(
    q, k, v, segment_ids_BT: jax.Array, max_segments: int, window: int | None, scale: float | None
) -> jax.Array:
    # The packed (ragged) layout is reached through cuDNN's own jax entry point: jax.nn.dot_product_attention
    # passes per-row lengths only (padding, one segment per row).
    cudnn_attention, MaskType = jax_private.cudnn_attention()
    offsets, lengths, overflow_B = packed_segments(segment_ids_BT, max_segments)
    out = cudnn_attention(
        q,
        k,
        v,
        q_seqlen=lengths,
        kv_seqlen=lengths,
        q_offsets=offsets,
        kv_offsets=offsets,
        scale=_default_scale(q.shape[-1], scale),
        mask_type=MaskType.PADDING_CAUSAL,
        qkv_layout="BTNH",
        sliding_window_length=window,  # (t - W, t]: the module docstring's band
    )
    # A row with more than max_segments segments would lose its last ones without a trace: make it NaN instead,
    # which the step's non-finite check reports (raise model.max_segments).
    return jnp.where(overflow_B[:, None, None, None], jnp.nan, out).astype(q.dtype)


def _xla_softcapped(q_BTHK, k_BTGK, v_BTGK, mask, window: int | None, scale: float | None, softcap: float) -> jax.Array:
    """Causal attention with soft-capped scores (module docstring) as jax's XLA path computes it: scores and
    softmax in fp32, the probabilities cast to v's dtype for the product with v. mask: bool [B, 1, T, T] or None."""
    b, t, h, kw = q_BTHK.shape
    g = k_BTGK.shape[2]
    q_BTGRK = q_BTHK.reshape(b, t, g, h // g, kw)
    scores = jnp.einsum("btgrk,bsgk->bgrts", q_BTGRK, k_BTGK, preferred_element_type=jnp.float32)
    scores = scores * _default_scale(kw, scale)
    scores = softcap * jnp.tanh(scores / softcap)
    pos = jnp.arange(t)
    visible = pos[None, :] <= pos[:, None]
    if window is not None:
        visible = visible & (pos[None, :] > pos[:, None] - window)
    visible = visible[None, None, None]  # [1, 1, 1, T, S]
    if mask is not None:
        visible = visible & mask[:, :, None]  # [B, 1, 1, T, S]
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bgrts,bsgk->btgrk", probs.astype(v_BTGK.dtype), v_BTGK)
    return out.reshape(b, t, h, kw).astype(q_BTHK.dtype)


def dot_product_attention(
    q_BTHK: jax.Array,
    k_BTGK: jax.Array,
    v_BTGK: jax.Array,
    *,
    implementation: str,
    segment_ids_BT: jax.Array | None = None,
    max_segments: int = 64,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Causal attention softmax(q k^T * scale) v, within segments when `segment_ids_BT` is given, within a
    sliding window when `window` is, the scores soft-capped when `softcap` is (module docstring).

    Args:
      q_BTHK: queries [B, T, H, K]; k_BTGK, v_BTGK: keys and values [B, T, G, K], the same dtype.
      implementation: `xla` or `cudnn` (already resolved: `jaxpar.config.attention.resolve_attention`).
      segment_ids_BT: int32 [B, T] document ids (module docstring), or None (one document per row).
      max_segments: the segments per row cuDNN's packed layout holds (unused by xla). A row with more gets a
        NaN output.
      window: W >= 1, the keys each query sees, itself included (module docstring), or None (all earlier ones).
      scale: the scores' multiplier; None: K ** -0.5.
      softcap: c > 0, the scores become c * tanh(scores / c); None: not capped. xla only.

    Returns:
      [B, T, H, K] in q's dtype.

    Raises:
      ValueError: an unknown implementation (`auto` must be resolved first), a window below 1, or soft-capping
        on cudnn.
    """
    if implementation not in ATTENTION_IMPLEMENTATIONS or implementation == "auto":
        raise ValueError(f"attention implementation {implementation!r}: resolve model.attention to xla or cudnn")
    if window is not None and window < 1:
        raise ValueError(f"attention window {window} must be >= 1 (the keys a query sees, itself included)")
    if softcap is not None and implementation != "xla":
        raise ValueError(f"soft-capped attention (softcap={softcap}) runs on xla only; cuDNN's kernel has none")
    # jax's (left, right) window: query t sees keys t - left .. t + right
    local = None if window is None else (window - 1, 0)
    if implementation == "xla":
        mask = None if segment_ids_BT is None else segment_mask(segment_ids_BT)
        if softcap is not None:
            return _xla_softcapped(q_BTHK, k_BTGK, v_BTGK, mask, window, scale, softcap)
        return jax.nn.dot_product_attention(
            q_BTHK,
            k_BTGK,
            v_BTGK,
            mask=mask,
            scale=scale,
            is_causal=True,
            local_window_size=local,
            implementation="xla",
        )
    if segment_ids_BT is None:
        return jax.nn.dot_product_attention(
            q_BTHK, k_BTGK, v_BTGK, scale=scale, is_causal=True, local_window_size=local, implementation="cudnn"
        )
    return _cudnn_packed(q_BTHK, k_BTGK, v_BTGK, segment_ids_BT, max_segments, window, scale)
