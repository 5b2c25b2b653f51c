"""Transformer building blocks in Flax NNX: RMSNorm, rotary embedding, attention, SwiGLU MLP, token embedding.

Shape letters: B batch, T sequence, D model width, H query heads, G key/value heads, K head width,
F MLP hidden width, V vocabulary.

Every parameter is an `nnx.Param` carrying `logical_axes`, one name per dimension from
{embed, mlp, heads, kv, vocab}; `jaxpar.parallel.sharding` maps these to mesh axes. Modules read their head counts and
widths from the weights they hold, so the same code runs on whole weights or on tensor-parallel shards.
Weights are cast to the activation dtype at use; parameters keep their storage dtype.

Tensor parallelism (`jaxpar.parallel.tensor`): attention splits heads and the MLP its hidden width over
`tensor` (column-parallel in, row-parallel out); the embedding and output projection split the vocabulary.
Each `__call__` takes the `TensorParallel` context; its default (size 1) adds no collective.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.config.attention import resolve_attention
from jaxpar.model.attention import dot_product_attention, segment_positions
from jaxpar.model.context_attention import context_attention
from jaxpar.model.stack import ATTENTION_CONTEXT, MLP_HIDDEN
from jaxpar.parallel.tensor import NO_TENSOR_PARALLEL, TensorParallel, column_matmul, row_parallel


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> jax.Array:
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)


class RMSNorm(nnx.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019): x / rms(x) * (offset + scale), computed in fp32. x: [..., d].

    `axis` is the scale's logical axis: `embed` for the model width D, `kv` for a head's width K (qk-norm).
    `offset` 1 is Gemma's form (1 + w), its scale starting at 0; 0 (default) is Llama's, the scale starting at 1."""

    def __init__(self, d: int, eps: float, axis: str = "embed", offset: float = 0.0):
        start = jnp.zeros((d,), jnp.float32) if offset else jnp.ones((d,), jnp.float32)
        self.scale = nnx.Param(start, logical_axes=(axis,))
        self.eps = eps
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (y * (self.offset + scale if self.offset else scale)).astype(x.dtype)


def rotary(
    x_BTHK: jax.Array, positions: jax.Array, theta: float, inv_freq: tuple[float, ...] | None = None
) -> jax.Array:
    """Rotary position embedding (RoFormer, Su et al. 2021, eq. 34), rotating the two halves of K: element i
    pairs with element i + K/2 (Hugging Face's `rotate_half` convention, so Hugging Face Llama weights load
    without permuting q/k rows).

    positions: int [T] (every row alike) or [B, T] (per row, e.g. restarting at each packed document).
    inv_freq: K/2 inverse frequencies (`jaxpar.model.rope.rope_inverse_frequencies`, e.g. with Llama 3's scaling);
    None: theta ** (-2i / K)."""
    half = x_BTHK.shape[-1] // 2
    if inv_freq is None:
        freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    else:
        freq = jnp.asarray(inv_freq, jnp.float32)
    positions_BT = positions if positions.ndim == 2 else positions[None, :]
    angle_BTK = positions_BT.astype(jnp.float32)[..., None] * freq
    sin, cos = jnp.sin(angle_BTK)[:, :, None, :], jnp.cos(angle_BTK)[:, :, None, :]
    x1, x2 = jnp.split(x_BTHK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTHK.dtype)


class Attention(nnx.Module):
    """Causal multi-head attention with optional grouped-query attention (G key/value heads, G divides H), within
    packed documents when given segment ids, within a sliding window of `window` keys when given
    (`jaxpar.model.attention`).

    Per-family options: `qkv_bias` adds biases bq [H, K], bk and bv [G, K] to the projections (Qwen2);
    `qk_norm_eps` applies an RMSNorm over each head's K to the queries and keys (`q_norm`, `k_norm`, scales [K]
    shared by the heads) before the rotary embedding (Qwen3; Dehghani et al. 2023, "Scaling Vision Transformers
    to 22 Billion Parameters", section 3.1.2). `scale` (None: K ** -0.5) multiplies the scores and `softcap` caps
    them (Gemma 2; `jaxpar.model.attention`).

    `implementation` is `model.attention` (`jaxpar.config.attention`): `xla`, `cudnn`, or `auto` (resolved when
    called, on jax's default backend; `jaxpar.training.plan.build_plan` resolves it for the mesh's devices
    before the model is built). `max_segments` bounds the documents per row on the cuDNN path
    (`jaxpar.model.attention`).
    """

    def __init__(
        self,
        d: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rope_theta: float,
        std: float,
        rngs: nnx.Rngs,
        implementation: str = "auto",
        max_segments: int = 64,
        rope_inv_freq: tuple[float, ...] | None = None,
        qkv_bias: bool = False,
        qk_norm_eps: float | None = None,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ):
        self.wq = nnx.Param(_normal(rngs, (d, n_heads, head_dim), std), logical_axes=("embed", "heads", "kv"))
        self.wk = nnx.Param(_normal(rngs, (d, n_kv_heads, head_dim), std), logical_axes=("embed", "heads", "kv"))
        self.wv = nnx.Param(_normal(rngs, (d, n_kv_heads, head_dim), std), logical_axes=("embed", "heads", "kv"))
        self.wo = nnx.Param(_normal(rngs, (n_heads, head_dim, d), std), logical_axes=("heads", "kv", "embed"))
        zeros = jnp.zeros  # the biases start at zero, as transformers initialises them
        self.bq = nnx.Param(zeros((n_heads, head_dim)), logical_axes=("heads", "kv")) if qkv_bias else None
        self.bk = nnx.Param(zeros((n_kv_heads, head_dim)), logical_axes=("heads", "kv")) if qkv_bias else None
        self.bv = nnx.Param(zeros((n_kv_heads, head_dim)), logical_axes=("heads", "kv")) if qkv_bias else None
        self.q_norm = RMSNorm(head_dim, qk_norm_eps, axis="kv") if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps, axis="kv") if qk_norm_eps is not None else None
        self.window = window
        self.scale = scale  # None: K ** -0.5
        self.softcap = softcap
        self.rope_theta = rope_theta
        self.rope_inv_freq = rope_inv_freq  # None: plain theta ** (-2i / K)
        self.implementation = implementation
        self.max_segments = max_segments

    def __call__(
        self,
        x_BTD: jax.Array,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        segment_ids_BT: jax.Array | None = None,
        positions_BT: jax.Array | None = None,
    ) -> jax.Array:
        """x: [B, T/t or T, D] -> [B, T/t or T, D]. Q, K, V are column-parallel (H/t and G/t local heads), the
        output projection row-parallel. segment_ids_BT: int32 [B, T] document ids of the whole sequence (also
        under sequence parallelism: attention runs on the gathered sequence), or None. With them attention stays
        within each document and the rotary positions restart at each document's first token
        (`jaxpar.model.attention.segment_positions`). positions_BT: int32 [B, T] rotary positions, given
        (computed once per microbatch) instead of derived here.

        Under context parallelism (`tp.context`) T is this device's R = T/c tokens of the load-balanced layout:
        segment_ids_BT and positions_BT are its slice, and attention reaches the rest of the sequence through
        `jaxpar.parallel.context` (with segment ids the positions are then required: a slice cannot tell where its
        documents began)."""
        dt = x_BTD.dtype
        x_BTD = tp.enter(x_BTD)
        cp = tp.context
        if positions_BT is not None:
            positions = positions_BT
        elif segment_ids_BT is None:
            positions = cp.positions(x_BTD.shape[1])  # arange(T) without context parallelism
        elif cp.active:
            raise ValueError(
                "context parallelism with packed documents needs the rotary positions of this device's slice "
                "(positions_BT), which restart at documents that may begin on another device: the train step "
                "computes them from the whole sequence; pass them through run_blocks"
            )
        else:
            positions = segment_positions(segment_ids_BT)
        q = column_matmul(x_BTD, self.wq[...], tp)  # [B, T, H, K]
        k = column_matmul(x_BTD, self.wk[...], tp)  # [B, T, G, K]
        v = column_matmul(x_BTD, self.wv[...], tp)
        if self.bq is not None and self.bk is not None and self.bv is not None:  # this rank's heads [H/t, K]
            q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[...].astype(dt)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotary(q, positions, self.rope_theta, self.rope_inv_freq)
        k = rotary(k, positions, self.rope_theta, self.rope_inv_freq)
        implementation = self.implementation
        if implementation == "auto":
            implementation = resolve_attention(
                "auto", jax.default_backend(), jnp.dtype(dt).name, q.shape[-1], self.softcap
            )
        if cp.active:
            if (self.window, self.scale, self.softcap) != (None, None, None):  # jaxpar.config.validate refuses first
                raise ValueError("a window, score scale or soft-capping cannot run under context parallelism")
            out_BTHK = context_attention(q, k, v, segment_ids_BT, cp, implementation, self.max_segments)
        else:
            out_BTHK = dot_product_attention(
                q,
                k,
                v,
                implementation=implementation,
                segment_ids_BT=segment_ids_BT,
                max_segments=self.max_segments,
                window=self.window,
                scale=self.scale,
                softcap=self.softcap,
            )
        b, t, h, kw = out_BTHK.shape
        wo_FD = self.wo[...].reshape(h * kw, -1)
        context_BTF = checkpoint_name(out_BTHK.reshape(b, t, h * kw), ATTENTION_CONTEXT)
        return row_parallel(context_BTF, wo_FD, None, tp)


class SwiGLU(nnx.Module):
    """Gated MLP (Shazeer 2020): down(act(x @ gate) * (x @ up)), act = SiLU (`activation`)."""

    @staticmethod
    def activation(x: jax.Array) -> jax.Array:
        return jax.nn.silu(x)

    def __init__(self, d: int, f: int, std: float, rngs: nnx.Rngs):
        self.w_gate = nnx.Param(_normal(rngs, (d, f), std), logical_axes=("embed", "mlp"))
        self.w_up = nnx.Param(_normal(rngs, (d, f), std), logical_axes=("embed", "mlp"))
        self.w_down = nnx.Param(_normal(rngs, (f, d), std), logical_axes=("mlp", "embed"))

    def __call__(self, x_BTD: jax.Array, tp: TensorParallel = NO_TENSOR_PARALLEL) -> jax.Array:
        """x: [B, T/t or T, D] -> same. Gate and up are column-parallel (F/t local), down row-parallel."""
        x_BTD = tp.enter(x_BTD)
        h_BTF = self.activation(column_matmul(x_BTD, self.w_gate[...], tp)) * column_matmul(x_BTD, self.w_up[...], tp)
        return row_parallel(checkpoint_name(h_BTF, MLP_HIDDEN), self.w_down[...], None, tp)


class GeGLU(SwiGLU):
    """Gated MLP with GELU (tanh approximation) for the gate: Gemma's (Shazeer 2020, "GLU Variants Improve
    Transformer"; transformers' `gelu_pytorch_tanh`)."""

    @staticmethod
    def activation(x: jax.Array) -> jax.Array:
        return jax.nn.gelu(x, approximate=True)


class Embed(nnx.Module):
    """Token embedding table [V, D]; `attend` projects activations back onto the vocabulary (tied head)."""

    def __init__(self, vocab: int, d: int, std: float, rngs: nnx.Rngs):
        self.table = nnx.Param(_normal(rngs, (vocab, d), std), logical_axes=("vocab", "embed"))

    def __call__(self, tokens_BT: jax.Array, dtype: jnp.dtype, tp: TensorParallel = NO_TENSOR_PARALLEL) -> jax.Array:
        """Token ids [B, T] -> [B, T/t or T, D] in `dtype`; the table's rows may be a vocabulary shard."""
        return tp.embed(self.table[...].astype(dtype), tokens_BT)

    def attend(self, x_BTD: jax.Array, tp: TensorParallel = NO_TENSOR_PARALLEL) -> jax.Array:
        """[B, T/t or T, D] -> logits [B, T, V/t] over this rank's vocabulary shard."""
        return tp.enter(x_BTD) @ self.table[...].astype(x_BTD.dtype).T


class LMHead(nnx.Module):
    """Untied output projection [D, V]."""

    def __init__(self, d: int, vocab: int, std: float, rngs: nnx.Rngs):
        self.kernel = nnx.Param(_normal(rngs, (d, vocab), std), logical_axes=("embed", "vocab"))

    def __call__(self, x_BTD: jax.Array, tp: TensorParallel = NO_TENSOR_PARALLEL) -> jax.Array:
        """[B, T/t or T, D] -> logits [B, T, V/t]: column-parallel over the vocabulary."""
        return tp.enter(x_BTD) @ self.kernel[...].astype(x_BTD.dtype)
