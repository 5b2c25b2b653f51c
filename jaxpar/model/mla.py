"""Multi-head Latent Attention (MLA): DeepSeek-V2 (arXiv 2405.04434, section 2.1) and DeepSeek-V3 (arXiv 2412.19437,
section 2.1.1, equations 1-11).

Shape letters: B batch, T sequence, D model width, H query heads, P the queries' and keys' head width without
rotary embedding (qk_nope_head_dim), R their rotary width (qk_rope_head_dim), U the values' head width
(v_head_dim), X the query latent's width (q_lora_rank), Z the key/value latent's width (kv_lora_rank), Y = X + Z + R
the latents together, W the attention kernel's head width, t size of the `tensor` mesh axis.

Per token t (V3 equations 1-11; the norms on the latents are V3's, section 2.1.1 and its released config):

    c_KV = RMSNorm(W_DKV h)   [Z]            k_R = RoPE(W_KR h)   [R], one rotary key shared by every head
    k_C = W_UK c_KV           [H, P]         v = W_UV c_KV        [H, U]
    c_Q = RMSNorm(W_DQ h)     [X]            (no query compression, q_lora_rank null: c_Q = h)
    q_C = W_UQ c_Q            [H, P]         q_R = RoPE(W_QR c_Q) [H, R]
    q = [q_C; q_R],  k = [k_C; k_R]  per head,  o = causal softmax(q . k * scale) v,  u = W_O [o_1 .. o_H]

scale = (P + R) ** -0.5 (the pretraining one; the released V3 config multiplies it by YaRN's mscale^2 for its 128K
context extension, which jaxpar does not compute: YaRN is out of scope, and `jaxpar.model.rope` has no YaRN scaling).

Parameters, laid out as DeepSeek's checkpoints store them (the latent and the shared rotary key in one
down-projection):
    wq_a [D, X] (W_DQ), q_norm [X], wq_b [X, H, P + R] (W_UQ and W_QR); or wq [D, H, P + R] without a query latent;
    wkv_a [D, Z + R] (W_DKV and W_KR), kv_norm [Z], wkv_b [Z, H, P + U] (W_UK and W_UV); wo [H, U, D] (W_O).
Logical axes: the latents' widths as a down-projection's output are `latent` (never split: every tensor rank
computes the whole latent); as an up-projection's input they are `embed`, the dimension fsdp and ZeRO split, as the
model width is for the usual attention's wq [D, H, K].

Rotary embedding pairs element i with i + R/2 (`jaxpar.model.layers.rotary`, Hugging Face's rotate-half), a fixed
permutation of RoFormer's adjacent pairs: DeepSeek's released weights pair adjacent elements, so loading them would
permute the rotary columns of wq_b and wkv_a (as transformers' DeepSeek-V3 `rope_interleave` does).

Tensor parallelism (`jaxpar.parallel.tensor`): the down-projections and latent norms are replicated over `tensor`
and run on the block input as the rank holds it (T/t tokens under sequence parallelism); `tp.enter` then takes the
latents [B, T, Y] (not the block input [B, T, D]: a smaller all-gather under sequence parallelism), so that
every replicated weight gets its gradient by the step's usual rule (whole on each rank, or this rank's tokens'
part summed over `tensor` by the step under sequence parallelism). wq_b, wkv_b (and wq) are column-parallel over
heads (H/t local), wo row-parallel, then `tp.exit`.

What the attention kernel gets (`jaxpar.model.attention.dot_product_attention`, the usual attention's entry): q and
k [B, T, H/t, W] and v [B, T, H/t, W] with W = max(P + R, U), the narrower of q/k and v padded with zeros to W
(zeros in q and k add nothing to the scores; zero value columns give zero output columns), the scale passed
explicitly ((P + R) ** -0.5, never the padded width's), and the output's first U columns kept. jax's public
`jax.nn.dot_product_attention` needs v as wide as k on both its paths (XLA and cuDNN); jax's cuDNN module itself
takes a narrower v (cuDNN 9.10+ on Hopper), which the packed path could use unpadded (a saving of (W - U) / W of
the value product). For DeepSeek-V3 W = 192 and U = 128: cuDNN's fused kernel takes a width of 192 on Hopper and
newer only (jax checks the local GPU), 128 elsewhere.

Context parallelism is not supported (`jaxpar.config.mla.check_mla` refuses it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.model.attention import dot_product_attention, segment_positions
from jaxpar.model.layers import RMSNorm, rotary
from jaxpar.model.stack import ATTENTION_CONTEXT
from jaxpar.parallel.tensor import NO_TENSOR_PARALLEL, TensorParallel, column_matmul, row_parallel


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> jax.Array:
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)


class MLA(nnx.Module):
    """Multi-head Latent Attention (module docstring): causal, within packed documents when given segment ids,
    within a sliding window of `window` keys when given, scores scaled by `scale` (None: (P + R) ** -0.5) and
    soft-capped by `softcap` (`jaxpar.model.attention`).

    Args:
      d: model width D.
      n_heads: H.
      kv_lora_rank: Z, the key/value latent's width.
      q_lora_rank: X, the query latent's width; None: queries projected from the block input (wq).
      qk_nope_head_dim, qk_rope_head_dim, v_head_dim: P, R (even), U.
      rope_theta: rotary base; rope_inv_freq: R/2 inverse frequencies (`jaxpar.model.rope`), None: theta ** (-2i/R).
      std: the normal initialiser's standard deviation of every weight; norm scales start at 1.
      norm_eps: the latents' RMSNorm epsilon.
      implementation: `xla` or `cudnn` (`jaxpar.config.attention`); `auto`, unresolved, runs xla.
      max_segments: as `jaxpar.model.layers.Attention`.
    """

    def __init__(
        self,
        d: int,
        n_heads: int,
        kv_lora_rank: int,
        q_lora_rank: int | None,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rope_theta: float,
        std: float,
        rngs: nnx.Rngs,
        norm_eps: float = 1e-6,
        implementation: str = "auto",
        max_segments: int = 64,
        rope_inv_freq: tuple[float, ...] | None = None,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ):
        if qk_rope_head_dim % 2:
            raise ValueError(f"MLA's rotary width qk_rope_head_dim={qk_rope_head_dim} must be even")
        h, n, r, e = n_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        q_axes = ("embed", "heads", "kv")
        # Each attribute assigned once (NNX fixes an attribute's kind at its first assignment).
        self.wq: nnx.Param | None
        self.wq_a: nnx.Param | None
        self.q_norm: RMSNorm | None
        self.wq_b: nnx.Param | None
        if q_lora_rank is None:
            self.wq = nnx.Param(_normal(rngs, (d, h, n + r), std), logical_axes=q_axes)
            self.wq_a, self.q_norm, self.wq_b = None, None, None
        else:
            self.wq = None
            self.wq_a = nnx.Param(_normal(rngs, (d, q_lora_rank), std), logical_axes=("embed", "latent"))
            self.q_norm = RMSNorm(q_lora_rank, norm_eps, axis="latent")
            self.wq_b = nnx.Param(_normal(rngs, (q_lora_rank, h, n + r), std), logical_axes=q_axes)
        self.wkv_a = nnx.Param(_normal(rngs, (d, kv_lora_rank + r), std), logical_axes=("embed", "latent"))
        self.kv_norm = RMSNorm(kv_lora_rank, norm_eps, axis="latent")
        self.wkv_b = nnx.Param(_normal(rngs, (kv_lora_rank, h, n + e), std), logical_axes=("embed", "heads", "kv"))
        self.wo = nnx.Param(_normal(rngs, (h, e, d), std), logical_axes=("heads", "kv", "embed"))
        self.rope_width = r  # R: the split points below, which the weights' shapes alone do not give
        self.value_width = e
        self.scale = (n + r) ** -0.5 if scale is None else scale
        self.window = window
        self.softcap = softcap
        self.rope_theta = rope_theta
        self.rope_inv_freq = rope_inv_freq
        self.implementation = implementation
        self.max_segments = max_segments

    def _latents(self, x_BTD: jax.Array) -> jax.Array:
        """The block input as this rank holds it [B, T/t or T, D] -> [c_Q; c_KV; W_KR h] [B, T/t or T, Y]
        (c_Q absent without a query latent), the norms applied, the rotary key not yet rotated."""
        dt = x_BTD.dtype
        # [B, T, Z + R]: c_KV before its norm, and W_KR h
        kv_latent = jnp.tensordot(x_BTD, self.wkv_a[...].astype(dt), axes=1)
        c_kv_BTZ, k_rope_BTR = kv_latent[..., : -self.rope_width], kv_latent[..., -self.rope_width :]
        parts = [self.kv_norm(c_kv_BTZ), k_rope_BTR]
        if self.wq_a is not None and self.q_norm is not None:
            parts.insert(0, self.q_norm(jnp.tensordot(x_BTD, self.wq_a[...].astype(dt), axes=1)))  # [B, T, X]
        return jnp.concatenate(parts, axis=-1)

    def __call__(
        self,
        x_BTD: jax.Array,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        segment_ids_BT: jax.Array | None = None,
        positions_BT: jax.Array | None = None,
    ) -> jax.Array:
        """x: [B, T/t or T, D] -> [B, T/t or T, D] (T/t under sequence parallelism), in x's dtype.

        segment_ids_BT: int32 [B, T] document ids of the whole sequence, or None; with them attention stays within
        each document and the rotary positions restart at each document's first token. positions_BT: int32 [B, T]
        rotary positions, given instead of derived here.

        Raises:
          ValueError: under context parallelism (`tp.context`), or with FP8 GEMMs (`tp.fp8`): neither is
            supported; `jaxpar.config.mla.check_mla` refuses both at load.
        """
        if tp.context.active or tp.fp8.active:
            raise ValueError("Multi-head Latent Attention runs without context parallelism and without FP8 GEMMs")
        r, e = self.rope_width, self.value_width
        # enter: all-gather of the latents over T under sequence parallelism (backward reduce-scatter), else the
        # identity (backward all-reduce): every rank's heads contributed to the latents' gradient.
        latents_BTY = tp.enter(self._latents(x_BTD))
        t = latents_BTY.shape[1]
        k_rope_BTR = latents_BTY[..., -r:]
        c_kv_BTZ = latents_BTY[..., -r - self.kv_norm.scale.shape[0] : -r]
        if positions_BT is not None:
            positions = positions_BT
        elif segment_ids_BT is None:
            positions = jnp.arange(t, dtype=jnp.int32)
        else:
            positions = segment_positions(segment_ids_BT)
        if self.wq is not None:
            q_BTHW = column_matmul(tp.enter(x_BTD), self.wq[...], tp)  # [B, T, H/t, P + R]
        else:
            assert self.wq_b is not None and self.q_norm is not None  # with a query latent
            c_q_BTX = latents_BTY[..., : self.q_norm.scale.shape[0]]
            q_BTHW = column_matmul(c_q_BTX, self.wq_b[...], tp)
        kv_up_BTHW = column_matmul(c_kv_BTZ, self.wkv_b[...], tp)  # [B, T, H/t, P + U]
        h = q_BTHW.shape[2]
        q_rope = rotary(q_BTHW[..., -r:], positions, self.rope_theta, self.rope_inv_freq)
        q_BTHW = jnp.concatenate([q_BTHW[..., :-r], q_rope], axis=-1)
        k_rope_BT1R = rotary(k_rope_BTR[:, :, None, :], positions, self.rope_theta, self.rope_inv_freq)
        k_nope_BTHP, v_BTHU = kv_up_BTHW[..., :-e], kv_up_BTHW[..., -e:]
        k_rope_BTHR = jnp.broadcast_to(k_rope_BT1R, (*k_nope_BTHP.shape[:3], r))  # one rotary key for every head
        k_BTHW = jnp.concatenate([k_nope_BTHP, k_rope_BTHR], axis=-1)
        # The kernel takes q, k and v of one width W (module docstring): pad the narrower with zeros.
        w = max(q_BTHW.shape[-1], e)
        q_BTHW, k_BTHW, v_BTHW = (_pad_last(a, w) for a in (q_BTHW, k_BTHW, v_BTHU))
        # `auto` is resolved by the step plan for its devices before the model is built; left unresolved (a
        # module built by hand) it runs XLA's attention.
        implementation = "xla" if self.implementation == "auto" else self.implementation
        out_BTHW = dot_product_attention(
            q_BTHW,
            k_BTHW,
            v_BTHW,
            implementation=implementation,
            segment_ids_BT=segment_ids_BT,
            max_segments=self.max_segments,
            window=self.window,
            scale=self.scale,
            softcap=self.softcap,
        )
        b = out_BTHW.shape[0]
        context_BTF = checkpoint_name(out_BTHW[..., :e].reshape(b, t, h * e), ATTENTION_CONTEXT)
        return row_parallel(context_BTF, self.wo[...].reshape(h * e, -1), None, tp)


def _pad_last(a: jax.Array, width: int) -> jax.Array:
    """a [..., w] -> [..., width], zeros appended (a itself when w == width)."""
    extra = width - a.shape[-1]
    return a if extra == 0 else jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, extra)])
