"""Decoder-only Llama-style transformer in Flax NNX with a stacked, scanned layer axis.

Shape letters: B batch, T sequence, D model width, V vocabulary, L layers.

The L blocks are created with `nnx.vmap`, so every block parameter has a leading `layers` dimension, and run
with `jax.lax.scan`: compile time does not grow with depth and a pipeline can split the stack into stages.

Parallelism enters through one hook: `gather(module) -> module` is applied to each submodule right before it
is used (the embedding, each block inside the scan, the final norm and head). On one device it is the
identity; inside the train step's `shard_map` it all-gathers the module's fsdp-sharded weights
(`jaxpar.parallel.gather`), and its transpose reduce-scatters their gradients.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config.mesh_axes import STORAGE_AXES
from jaxpar.config.schema import ModelConfig
from jaxpar.model.layers import ATTENTION_CONTEXT, MLP_HIDDEN, Attention, Embed, LMHead, RMSNorm, SwiGLU
from jaxpar.parallel.tensor import NO_TENSOR_PARALLEL, TensorParallel

Gather = Callable[[nnx.Module], nnx.Module]
GATHERED_WEIGHT = "gathered_weight"  # checkpoint name of all-gathered weights: never saved for backward


def _identity(module: nnx.Module) -> nnx.Module:
    return module


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x)). x: [B, T, D]."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_width, cfg.rope_theta,
                              cfg.init_std, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff, cfg.init_std, rngs)

    def __call__(self, x_BTD: jax.Array, tp: TensorParallel = NO_TENSOR_PARALLEL) -> jax.Array:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), tp)
        return x_BTD + self.mlp(self.mlp_norm(x_BTD), tp)


def _is_weight_gather(params: dict) -> bool:
    """Whether a custom-VJP call is `jaxpar.parallel.gather.gather_weight`: its body all-gathers over fsdp/data."""
    for eqn in params["call_jaxpr"].jaxpr.eqns if "call_jaxpr" in params else ():
        if eqn.primitive.name == "all_gather":
            axes = eqn.params["axis_name"]
            if set((axes,) if isinstance(axes, str) else axes) & set(STORAGE_AXES):
                return True
    return False


def _save_dots_and_tensor_collectives(prim, *avals, **params) -> bool:
    """Saves matmul outputs and the outputs of the tensor-parallel collectives (custom VJPs over `tensor`), so the
    backward recomputes neither a matmul nor a tensor collective; never saves an all-gathered weight."""
    if prim.name == "custom_vjp_call":
        return not _is_weight_gather(params)
    return jax.checkpoint_policies.dots_saveable(prim, *avals, **params)


_REMAT_POLICIES = {
    # Every matmul output and tensor-collective output is saved, so neither is recomputed; elementwise ops
    # (norms, rotary, SwiGLU gate) are recomputed, and so are the all-gathered weights: they are re-gathered in
    # the backward instead of being kept, which is what FSDP / ZeRO-3 do. (A "save everything except the
    # gathered weights" policy keeps them anyway: a cast or reshape of a gathered weight is saveable.)
    "none": _save_dots_and_tensor_collectives,
    # Recompute the whole block in the backward from its input.
    "full": jax.checkpoint_policies.nothing_saveable,
    # Save matmul outputs without batch dimensions, recompute the rest.
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Save only the named activations (attention context and MLP hidden, the inputs of the row-parallel
    # projections): the backward recomputes the rest of the block but not the attention itself.
    "names": jax.checkpoint_policies.save_only_these_names(ATTENTION_CONTEXT, MLP_HIDDEN),
}


class Transformer(nnx.Module):
    """Token ids [B, T] int32 -> logits [B, T, V] in the compute dtype.

    Attributes:
      embed: `Embed` table [V, D].
      blocks: L stacked `Block`s (leading `layers` dimension on every parameter).
      final_norm: `RMSNorm` [D].
      lm_head: `LMHead` [D, V], or None with tied embeddings.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.d_model, cfg.init_std, rngs)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(block_rngs: nnx.Rngs) -> Block:
            return Block(cfg, block_rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else LMHead(cfg.d_model, cfg.vocab_size, cfg.init_std, rngs)

    def embed_tokens(self, tokens_BT: jax.Array, dtype: jnp.dtype, gather: Gather = _identity,
                     tp: TensorParallel = NO_TENSOR_PARALLEL) -> jax.Array:
        """Token ids [B, T] -> activations [B, T, D] (T/t under sequence parallelism) in `dtype`."""
        return gather(self.embed)(tokens_BT, dtype, tp)

    def run_blocks(self, x_BTD: jax.Array, gather: Gather = _identity,
                   tp: TensorParallel = NO_TENSOR_PARALLEL) -> jax.Array:
        """Scans the stacked blocks (all of this module's layers) over activations [B, T, D]."""
        graphdef, stacked = nnx.split(self.blocks)

        def body(x, layer_state):
            block = gather(nnx.merge(graphdef, layer_state))
            return block(x, tp), None

        body = jax.checkpoint(body, policy=_REMAT_POLICIES[self.cfg.remat], prevent_cse=False)
        x_BTD, _ = jax.lax.scan(body, x_BTD, stacked)
        return x_BTD

    def logits(self, x_BTD: jax.Array, gather: Gather = _identity,
               tp: TensorParallel = NO_TENSOR_PARALLEL) -> jax.Array:
        """Final norm and output projection: [B, T, D] -> [B, T, V] (V/t, this rank's vocabulary shard)."""
        x_BTD = gather(self.final_norm)(x_BTD)
        if self.lm_head is None:
            return gather(self.embed).attend(x_BTD, tp)
        return gather(self.lm_head)(x_BTD, tp)

    def __call__(self, tokens_BT: jax.Array, dtype: jnp.dtype = jnp.float32, gather: Gather = _identity,
                 tp: TensorParallel = NO_TENSOR_PARALLEL) -> jax.Array:
        x_BTD = self.embed_tokens(tokens_BT, dtype, gather, tp)
        return self.logits(self.run_blocks(x_BTD, gather, tp), gather, tp)


def token_loss_sum(logits_BTV: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array,
                   tp: TensorParallel = NO_TENSOR_PARALLEL) -> jax.Array:
    """Sum over tokens of mask * cross-entropy(logits, target), in fp32 nats. A zero mask contributes 0.
    With tensor parallelism the logits are this rank's vocabulary shard (see `TensorParallel`)."""
    return tp.cross_entropy_sum(logits_BTV, targets_BT, mask_BT)
