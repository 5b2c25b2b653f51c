"""A second model family, written only against jaxpar's public model API: a GPT-2-style decoder.

    import gpt2            # registers model.name "gpt2" (this file, on sys.path)
    cfg = jaxpar.load_config("configs/tiny.yaml", ["model.name=gpt2"])

GPT-2 (Radford et al. 2019, section 2.3; the GPT-1 architecture of Radford et al. 2018, section 3.1, with the
layer norm moved to each block's input): learned absolute positions added to the token embedding; pre-norm blocks
of causal multi-head attention and a GELU MLP, every linear layer and LayerNorm with a bias; a final LayerNorm;
the output projection tied to the token embedding.

It differs from the built-in `llama` family in every part the interface touches (LayerNorm with bias instead of
RMSNorm, biased projections, GELU instead of SwiGLU, learned positions instead of rotary, tied head), and takes
part in every kind of parallelism through jaxpar's building blocks:

* tensor: attention heads and the MLP hidden width are split over `tensor` by `column_parallel` (with their
  biases) and joined by `row_parallel` (its bias added once, after the reduction); the token table and tied head
  are vocabulary-parallel (`jaxpar.model.Embed`); with sequence parallelism each rank adds the positions of its
  own slice of the sequence (`TensorParallel.sequence_start`);
* fsdp / ZeRO: every parameter names its dimensions (`logical_axes`), `embed` being the one they shard;
* pipeline: the blocks are stacked (`stack_layers`) and scanned (`scan_layers`); the three parts
  `embed_tokens`, `run_blocks`, `logits` are what the stages run.

Mixture of experts (`model.moe`, with `model.moe.every=1`: every block's MLP is a `jaxpar.model.MoE`, SwiGLU
experts as the built-in family's): the blocks return their router statistics beside their output and
`run_blocks_with_stats` stacks them, which is all the train step needs for the auxiliary losses, expert
parallelism (`model.moe.expert_axes`) and the metrics.

Packed documents (`data.document_masking`): `run_blocks` takes the batch's segment ids, so attention never crosses
a document boundary (`jaxpar.model.dot_product_attention`, on the `model.attention` implementation); the learned
positions are added by `embed_tokens`, which sees no segment ids, so they run across the row (a document after
the first starts at a later position than it would alone).

Reads from `ModelConfig`: vocab_size, d_model, n_layers, n_heads, head_dim, d_ff, norm_eps, init_std, remat,
attention, max_segments, moe.
Refuses n_kv_heads other than n_heads (no grouped-query attention), untied embeddings (GPT-2 ties them) and
model.moe.every other than 1;
ignores rope_theta. Sequences may be at most `MAX_POSITIONS` tokens (the position table's rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.model import (
    ATTENTION_CONTEXT,
    MLP_HIDDEN,
    NO_TENSOR_PARALLEL,
    Embed,
    Gather,
    ModelConfig,
    MoE,
    TensorParallel,
    column_parallel,
    dot_product_attention,
    no_gather,
    register_model,
    row_parallel,
    scan_layers,
    stack_layers,
)

MAX_POSITIONS = 1024  # GPT-2's context length


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> jax.Array:
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)


class LayerNorm(nnx.Module):
    """LayerNorm (Ba et al. 2016) with scale and bias, in fp32: x [..., D] -> same shape and dtype."""

    def __init__(self, d: int, eps: float):
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32), logical_axes=("embed",))
        self.bias = nnx.Param(jnp.zeros((d,), jnp.float32), logical_axes=("embed",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


class CausalSelfAttention(nnx.Module):
    """Multi-head causal attention with biased projections. Q, K, V column-parallel (H/t local heads), the
    output row-parallel. x: [B, T or T/t, D] -> same."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, heads, head_dim, std, n_layers = cfg.d_model, cfg.n_heads, cfg.head_width, cfg.init_std, cfg.n_layers
        # Heads side by side on one axis of width H * K, split over `tensor` by whole heads (H % t == 0).
        self.head_dim = head_dim
        # model.attention, resolved to xla or cudnn before the model is built; M documents per row for cuDNN.
        self.implementation, self.max_segments = cfg.attention, cfg.max_segments
        for name in ("q", "k", "v"):
            setattr(
                self, f"w{name}", nnx.Param(_normal(rngs, (d, heads * head_dim), std), logical_axes=("embed", "heads"))
            )
            setattr(self, f"b{name}", nnx.Param(jnp.zeros((heads * head_dim,), jnp.float32), logical_axes=("heads",)))
        # GPT-2 scales the residual projections' initialisation by 1/sqrt(2L) (Radford et al. 2019, 2.3).
        self.wo = nnx.Param(
            _normal(rngs, (heads * head_dim, d), std / (2 * n_layers) ** 0.5), logical_axes=("heads", "embed")
        )
        self.bo = nnx.Param(jnp.zeros((d,), jnp.float32), logical_axes=("embed",))

    def __call__(self, x_BTD: jax.Array, tp: TensorParallel, segment_ids_BT: jax.Array | None = None) -> jax.Array:
        x_BTD = tp.enter(x_BTD)  # column-parallel input: one all-gather (or identity) for all three projections
        b, t, _ = x_BTD.shape
        q, k, v = (
            column_parallel(x_BTD, w[...], bias[...], NO_TENSOR_PARALLEL).reshape(b, t, -1, self.head_dim)
            for w, bias in ((self.wq, self.bq), (self.wk, self.bk), (self.wv, self.bv))
        )
        out_BTHK = dot_product_attention(  # H/t local heads, within documents when segment ids are given
            q, k, v, implementation=self.implementation, segment_ids_BT=segment_ids_BT, max_segments=self.max_segments
        )
        context_BTF = checkpoint_name(out_BTHK.reshape(b, t, -1), ATTENTION_CONTEXT)
        return row_parallel(context_BTF, self.wo[...], self.bo[...], tp)


class MLP(nnx.Module):
    """Linear D -> F, GELU (tanh form, as GPT-2), linear F -> D, both with biases; column- then row-parallel."""

    def __init__(self, d: int, f: int, std: float, n_layers: int, rngs: nnx.Rngs):
        self.w_in = nnx.Param(_normal(rngs, (d, f), std), logical_axes=("embed", "mlp"))
        self.b_in = nnx.Param(jnp.zeros((f,), jnp.float32), logical_axes=("mlp",))
        self.w_out = nnx.Param(_normal(rngs, (f, d), std / (2 * n_layers) ** 0.5), logical_axes=("mlp", "embed"))
        self.b_out = nnx.Param(jnp.zeros((d,), jnp.float32), logical_axes=("embed",))

    def __call__(self, x_BTD: jax.Array, tp: TensorParallel) -> jax.Array:
        h_BTF = jax.nn.gelu(column_parallel(x_BTD, self.w_in[...], self.b_in[...], tp), approximate=True)
        return row_parallel(checkpoint_name(h_BTF, MLP_HIDDEN), self.w_out[...], self.b_out[...], tp)


class Block(nnx.Module):
    """Pre-norm GPT-2 block: x + attn(ln_1(x)), then + mlp(ln_2(x)). x: [B, T or T/t, D]. With `model.moe` the
    MLP is a `MoE` and the block returns (x, its router statistics)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.ln_1 = LayerNorm(cfg.d_model, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg, rngs)
        self.ln_2 = LayerNorm(cfg.d_model, cfg.norm_eps)
        if cfg.moe.enabled:
            self.mlp = MoE(cfg.d_model, cfg.moe.d_expert or cfg.d_ff, cfg.moe, cfg.init_std, rngs)
        else:
            self.mlp = MLP(cfg.d_model, cfg.d_ff, cfg.init_std, cfg.n_layers, rngs)
        self.moe = cfg.moe.enabled

    def __call__(
        self, x_BTD: jax.Array, tp: TensorParallel, segment_ids_BT: jax.Array | None = None
    ) -> jax.Array | tuple[jax.Array, dict]:
        x_BTD = x_BTD + self.attn(self.ln_1(x_BTD), tp, segment_ids_BT)
        if self.moe:
            y_BTD, stats = self.mlp(self.ln_2(x_BTD), tp)
            return x_BTD + y_BTD, stats
        return x_BTD + self.mlp(self.ln_2(x_BTD), tp)


class Positions(nnx.Module):
    """Learned absolute positions [MAX_POSITIONS, D]; the rows are never sharded (logical axis None)."""

    def __init__(self, d: int, rngs: nnx.Rngs):
        self.table = nnx.Param(_normal(rngs, (MAX_POSITIONS, d), 0.01), logical_axes=(None, "embed"))


class GPT2(nnx.Module):
    """Token ids [B, T] int32 -> logits [B, T, V]: a `jaxpar.model.LanguageModel`.

    Attributes:
      embed: vocabulary-parallel token table [V, D] (also the output projection: tied).
      positions: learned position table [MAX_POSITIONS, D].
      blocks: L stacked `Block`s.
      final_norm: `LayerNorm` [D].

    Raises:
      ValueError: (at construction) n_kv_heads other than n_heads, or untied embeddings; (at trace) a
        sequence longer than MAX_POSITIONS.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        if cfg.kv_heads != cfg.n_heads:
            raise ValueError(
                f"model gpt2 has no grouped-query attention: set model.n_kv_heads=null (got "
                f"{cfg.n_kv_heads} with n_heads={cfg.n_heads})"
            )
        if not cfg.tie_embeddings:
            raise ValueError(
                "model gpt2 ties its output projection to the token embedding: set model.tie_embeddings=true"
            )
        if cfg.moe.enabled and cfg.moe.every != 1:
            raise ValueError(f"model gpt2 makes every block MoE: set model.moe.every=1 (got {cfg.moe.every})")
        self.remat = cfg.remat
        self.moe = cfg.moe.enabled
        self.embed = Embed(cfg.vocab_size, cfg.d_model, cfg.init_std, rngs)
        self.positions = Positions(cfg.d_model, rngs)
        self.blocks = stack_layers(cfg.n_layers, lambda layer_rngs: Block(cfg, layer_rngs), rngs)
        self.final_norm = LayerNorm(cfg.d_model, cfg.norm_eps)

    def embed_tokens(
        self,
        tokens_BT: jax.Array,
        dtype: jnp.dtype,
        gather: Gather = no_gather,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
    ) -> jax.Array:
        """Token ids [B, T] -> token + position embeddings [B, T, D] ([B, T/t, D] with sequence parallelism)."""
        seq = tokens_BT.shape[1]
        if seq > MAX_POSITIONS:
            raise ValueError(f"model gpt2 has {MAX_POSITIONS} positions; data.seq_len={seq} is longer")
        x_BTD = gather(self.embed)(tokens_BT, dtype, tp)
        local = x_BTD.shape[1]  # T, or T/t: this rank's slice of the sequence
        table = gather(self.positions).table[...]
        positions_TD = jax.lax.dynamic_slice_in_dim(table, tp.sequence_start(local), local, axis=0)
        return x_BTD + positions_TD.astype(dtype)[None]

    def run_blocks(
        self,
        x_BTD: jax.Array,
        gather: Gather = no_gather,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        segment_ids_BT: jax.Array | None = None,
    ) -> jax.Array:
        """The stacked blocks this module holds (a pipeline stage's share) over [B, T or T/t, D]; packed documents'
        segment ids int32 [B, T] keep attention within each document."""
        if self.moe:
            return self.run_blocks_with_stats(x_BTD, gather, tp, segment_ids_BT)[0]
        return scan_layers(self.blocks, x_BTD, self.remat, gather, tp, segment_ids_BT)

    def run_blocks_with_stats(
        self,
        x_BTD: jax.Array,
        gather: Gather = no_gather,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        segment_ids_BT: jax.Array | None = None,
    ) -> tuple[jax.Array, dict]:
        """`run_blocks` with `model.moe`: (activations, the MoE blocks' router statistics stacked over layers)."""
        return scan_layers(self.blocks, x_BTD, self.remat, gather, tp, segment_ids_BT, with_aux=True)

    def logits(
        self, x_BTD: jax.Array, gather: Gather = no_gather, tp: TensorParallel = NO_TENSOR_PARALLEL
    ) -> jax.Array:
        """Final LayerNorm and the tied projection: [B, T or T/t, D] -> [B, T, V/t] (this rank's vocabulary)."""
        return gather(self.embed).attend(gather(self.final_norm)(x_BTD), tp)

    def __call__(
        self,
        tokens_BT: jax.Array,
        dtype: jnp.dtype = jnp.float32,
        gather: Gather = no_gather,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
    ) -> jax.Array:
        return self.logits(self.run_blocks(self.embed_tokens(tokens_BT, dtype, gather, tp), gather, tp), gather, tp)


register_model("gpt2", GPT2, replace=True)  # replace: importing this file twice (as a script and a module)
