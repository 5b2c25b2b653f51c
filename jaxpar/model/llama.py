"""The built-in model family `llama`: a decoder-only Llama-style transformer in Flax NNX (registered by name in
`jaxpar.model.registry`; it implements `jaxpar.model.interface.LanguageModel`).

Shape letters: B batch, T sequence, D model width, V vocabulary, L layers.

Pre-norm blocks with RMSNorm, rotary attention with grouped-query heads and a SwiGLU MLP (Touvron et al. 2023,
"LLaMA", section 2.2); the L blocks are stacked on a leading `layers` axis (`jaxpar.model.stack`).
"""

from __future__ import annotations

from typing import cast

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config.schema import ModelConfig
from jaxpar.model.layers import Attention, Embed, LMHead, RMSNorm, SwiGLU
from jaxpar.model.moe import MoE
from jaxpar.model.rope import model_inverse_frequencies
from jaxpar.model.stack import Gather, no_gather, scan_layers, stack_layers
from jaxpar.parallel.tensor import NO_TENSOR_PARALLEL, TensorParallel


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x)). x: [B, T, D].

    With `moe` the MLP is a mixture of experts (`jaxpar.model.moe.MoE`) and the block returns (x, router
    statistics)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(
            cfg.d_model,
            cfg.n_heads,
            cfg.kv_heads,
            cfg.head_width,
            cfg.rope_theta,
            cfg.init_std,
            rngs,
            implementation=cfg.attention,
            max_segments=cfg.max_segments,
            rope_inv_freq=model_inverse_frequencies(cfg),
        )
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp: MoE | SwiGLU
        if moe:
            self.mlp = MoE(cfg.d_model, cfg.moe.d_expert or cfg.d_ff, cfg.moe, cfg.init_std, rngs)
        else:
            self.mlp = SwiGLU(cfg.d_model, cfg.d_ff, cfg.init_std, rngs)
        self.moe = moe

    def __call__(
        self, x_BTD: jax.Array, tp: TensorParallel = NO_TENSOR_PARALLEL, segment_ids_BT: jax.Array | None = None
    ) -> jax.Array | tuple[jax.Array, dict]:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), tp, segment_ids_BT)
        if isinstance(self.mlp, MoE):  # self.moe
            y_BTD, stats = self.mlp(self.mlp_norm(x_BTD), tp)
            return x_BTD + y_BTD, stats
        return x_BTD + self.mlp(self.mlp_norm(x_BTD), tp)


class MoEGroup(nnx.Module):
    """The stack's unit with `model.moe` on: `model.moe.every` blocks, dense ones (`dense_0`, ...) then one MoE
    block (`moe`); returns (x [B, T, D], the MoE block's router statistics)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.n_dense = cfg.moe.every - 1
        for i in range(self.n_dense):
            setattr(self, f"dense_{i}", Block(cfg, rngs))
        self.moe = Block(cfg, rngs, moe=True)

    def __call__(
        self, x_BTD: jax.Array, tp: TensorParallel = NO_TENSOR_PARALLEL, segment_ids_BT: jax.Array | None = None
    ) -> tuple[jax.Array, dict]:
        for i in range(self.n_dense):
            x_BTD = getattr(self, f"dense_{i}")(x_BTD, tp, segment_ids_BT)
        return cast(tuple[jax.Array, dict], self.moe(x_BTD, tp, segment_ids_BT))  # an MoE block: (x, statistics)


class Llama(nnx.Module):
    """Token ids [B, T] int32 -> logits [B, T, V] in the compute dtype.

    Reads every `ModelConfig` field: vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, d_ff,
    rope_theta, rope_scaling (and its factors), norm_eps, tie_embeddings, init_std, remat, attention, max_segments
    (init_from is read by the training loop, not the model).

    Attributes:
      embed: `Embed` table [V, D].
      blocks: L stacked `Block`s (leading `layers` dimension on every parameter); with `model.moe`,
        L / moe.every stacked `MoEGroup`s.
      final_norm: `RMSNorm` [D].
      lm_head: `LMHead` [D, V], or None with tied embeddings.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.d_model, cfg.init_std, rngs)
        if cfg.moe.enabled:
            units = cfg.n_layers // cfg.moe.every
            self.blocks = stack_layers(units, lambda layer_rngs: MoEGroup(cfg, layer_rngs), rngs)
        else:
            self.blocks = stack_layers(cfg.n_layers, lambda layer_rngs: Block(cfg, layer_rngs), rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else LMHead(cfg.d_model, cfg.vocab_size, cfg.init_std, rngs)

    def embed_tokens(
        self,
        tokens_BT: jax.Array,
        dtype: jnp.dtype,
        gather: Gather = no_gather,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
    ) -> jax.Array:
        """Token ids [B, T] -> activations [B, T, D] (T/t under sequence parallelism) in `dtype`."""
        return gather(self.embed)(tokens_BT, dtype, tp)

    def run_blocks(
        self,
        x_BTD: jax.Array,
        gather: Gather = no_gather,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        segment_ids_BT: jax.Array | None = None,
    ) -> jax.Array:
        """Scans the stacked blocks (all of this module's layers) over activations [B, T, D]; with segment ids
        (int32 [B, T]) attention stays within each packed document."""
        return self.run_blocks_with_stats(x_BTD, gather, tp, segment_ids_BT)[0]

    def run_blocks_with_stats(
        self,
        x_BTD: jax.Array,
        gather: Gather = no_gather,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        segment_ids_BT: jax.Array | None = None,
    ) -> tuple[jax.Array, dict | None]:
        """`run_blocks`, and with `model.moe` the router statistics of every MoE block stacked on a leading
        dimension of size n_layers / moe.every (`jaxpar.model.moe`), else None."""
        if not self.cfg.moe.enabled:
            return scan_layers(self.blocks, x_BTD, self.cfg.remat, gather, tp, segment_ids_BT), None
        return scan_layers(self.blocks, x_BTD, self.cfg.remat, gather, tp, segment_ids_BT, with_aux=True)

    def logits(
        self, x_BTD: jax.Array, gather: Gather = no_gather, tp: TensorParallel = NO_TENSOR_PARALLEL
    ) -> jax.Array:
        """Final norm and output projection: [B, T, D] -> [B, T, V] (V/t, this rank's vocabulary shard)."""
        x_BTD = gather(self.final_norm)(x_BTD)
        if self.lm_head is None:
            return gather(self.embed).attend(x_BTD, tp)
        return gather(self.lm_head)(x_BTD, tp)

    def __call__(
        self,
        tokens_BT: jax.Array,
        dtype: jnp.dtype = jnp.float32,
        gather: Gather = no_gather,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        segment_ids_BT: jax.Array | None = None,
    ) -> jax.Array:
        x_BTD = self.embed_tokens(tokens_BT, dtype, gather, tp)
        return self.logits(self.run_blocks(x_BTD, gather, tp, segment_ids_BT), gather, tp)
