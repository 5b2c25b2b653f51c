"""The built-in family `gemma2`: Gemma 2 (Gemma Team 2024, "Gemma 2: Improving Open Language Models at a Practical
Size", arXiv 2408.00118, section 2 and table 1) in Flax NNX, registered in `jaxpar.model.registry`.

Shape letters: B batch, T sequence, D model width, V vocabulary, L layers.

What sets it apart from `jaxpar.model.llama`:
  * RMSNorm as x / rms(x) * (1 + w), the weights starting at 0 (`RMSNorm(offset=1)`);
  * a norm before and after each sublayer: x + post_norm(attn(pre_norm(x))), then the same around the MLP;
  * a GeGLU MLP: GELU (tanh approximation) on the gate (`jaxpar.model.layers.GeGLU`);
  * the embeddings scaled by sqrt(D), rounded to the compute dtype as transformers does;
  * local and global attention layers alternating, the first local: a local layer sees `model.sliding_window`
    keys (4096 in every published size), a global one every earlier key. The layer stack's unit is one such pair
    (`GemmaPair`: `ModelConfig.layers_per_unit` is 2), so the L / 2 pairs stack and scan like any family's layers
    and a pipeline stage holds whole pairs;
  * the attention scores scaled by `model.attention_scale_width` ** -0.5 (query_pre_attn_scalar: 256, or 144 for
    27B) and soft-capped at `model.attention_softcap` (50), the output logits at `model.final_softcap` (30): XLA's
    attention only, as cuDNN's fused kernel has no soft-capping (`jaxpar.model.attention`);
  * tied embeddings in every published size (an untied head is computed too).
Gemma 2 rather than Gemma 3: Gemma 3 alternates five local layers with one global one, with another rotary base on
each, and its published depths (26, 34, 48, 62 layers) do not divide into units of six: it would need a per-layer
switch inside the scanned stack. Gemma 2's 1:1 alternation stacks as pairs at every published depth (26, 42, 46).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config.errors import ConfigError
from jaxpar.config.schema import ModelConfig
from jaxpar.model.layers import Embed, GeGLU, LMHead, RMSNorm
from jaxpar.model.llama import Llama, make_attention
from jaxpar.model.stack import Gather, no_gather, stack_layers
from jaxpar.parallel.tensor import NO_TENSOR_PARALLEL, TensorParallel


def _norm(cfg: ModelConfig) -> RMSNorm:
    return RMSNorm(cfg.d_model, cfg.norm_eps, offset=1.0)


class GemmaBlock(nnx.Module):
    """x + attn_post_norm(attn(attn_norm(x))), then x + mlp_post_norm(mlp(mlp_norm(x))). x: [B, T, D] (T/t under
    sequence parallelism: the norms act per token). `local`: the attention sees `model.sliding_window` keys."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, local: bool):
        self.attn_norm = _norm(cfg)
        self.attn = make_attention(cfg, rngs, windowed=local)
        self.attn_post_norm = _norm(cfg)
        self.mlp_norm = _norm(cfg)
        self.mlp = GeGLU(cfg.d_model, cfg.d_ff, cfg.init_std, rngs)
        self.mlp_post_norm = _norm(cfg)

    def __call__(
        self,
        x_BTD: jax.Array,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        segment_ids_BT: jax.Array | None = None,
        positions_BT: jax.Array | None = None,
    ) -> jax.Array:
        x_BTD = x_BTD + self.attn_post_norm(self.attn(self.attn_norm(x_BTD), tp, segment_ids_BT, positions_BT))
        return x_BTD + self.mlp_post_norm(self.mlp(self.mlp_norm(x_BTD), tp))


class GemmaPair(nnx.Module):
    """The stack's unit: a local attention layer (`local`), then a global one (`full`). x: [B, T, D]."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.local = GemmaBlock(cfg, rngs, local=True)
        self.full = GemmaBlock(cfg, rngs, local=False)

    def __call__(
        self,
        x_BTD: jax.Array,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        segment_ids_BT: jax.Array | None = None,
        positions_BT: jax.Array | None = None,
    ) -> jax.Array:
        x_BTD = self.local(x_BTD, tp, segment_ids_BT, positions_BT)
        return self.full(x_BTD, tp, segment_ids_BT, positions_BT)


class Gemma2(Llama):
    """Token ids [B, T] int32 -> logits [B, T, V] in the compute dtype (module docstring).

    Reads the `ModelConfig` fields `jaxpar.model.llama.Llama` reads; `model.sliding_window` applies to the local
    layers only.

    Attributes:
      embed: `Embed` table [V, D] (its rows scaled by sqrt(D) on the way in, not in the tied head).
      blocks: L / 2 stacked `GemmaPair`s.
      final_norm: `RMSNorm` [D] of the (1 + w) form.
      lm_head: `LMHead` [D, V], or None with tied embeddings.

    Raises:
      ConfigError: `model.moe` is on, or `model.n_layers` is odd.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        if cfg.moe.enabled:
            raise ConfigError(
                f"model.name=gemma2 is a dense model but model.moe.num_experts={cfg.moe.num_experts}; set "
                f"model.moe.num_experts=0"
            )
        if cfg.n_layers % 2:
            raise ConfigError(
                f"model.n_layers={cfg.n_layers} must be even for model.name=gemma2 (local and global layers "
                f"alternate, stacked as pairs)"
            )
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.d_model, cfg.init_std, rngs)
        self.blocks = stack_layers(cfg.n_layers // 2, lambda layer_rngs: GemmaPair(cfg, layer_rngs), rngs)
        self.final_norm = _norm(cfg)
        self.lm_head = None if cfg.tie_embeddings else LMHead(cfg.d_model, cfg.vocab_size, cfg.init_std, rngs)

    def embed_tokens(
        self,
        tokens_BT: jax.Array,
        dtype: jnp.dtype,
        gather: Gather = no_gather,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        segment_ids_BT: jax.Array | None = None,
        positions_BT: jax.Array | None = None,
    ) -> jax.Array:
        """Token ids [B, T] -> activations [B, T, D] (T/t under sequence parallelism) in `dtype`, scaled by
        sqrt(D) rounded to `dtype` (transformers' Gemma2TextScaledWordEmbedding). Segment ids and positions are
        for `Llama.embed_tokens`' first dense blocks, which gemma2 has none of (it has no experts)."""
        x_BTD = gather(self.embed)(tokens_BT, dtype, tp)
        return x_BTD * jnp.asarray(np.sqrt(self.cfg.d_model), dtype)


def fp8_gemm_sites(model: ModelConfig) -> int:
    """The FP8 GEMMs one row of the gemma2 stack runs: two blocks of 7 (q, k, v, o, gate, up, down)."""
    return 14
