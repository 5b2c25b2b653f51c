"""The built-in Llama-style model families: a decoder-only transformer in Flax NNX (registered by name in
`jaxpar.model.registry`; it implements `jaxpar.model.interface.LanguageModel`).

Shape letters: B batch, T sequence, D model width, V vocabulary, L layers, H heads, G key/value heads, K head width.

Pre-norm blocks with RMSNorm, rotary attention with grouped-query heads and a SwiGLU MLP (Touvron et al. 2023,
"LLaMA", section 2.2); the L blocks are stacked on a leading `layers` axis (`jaxpar.model.stack`). The families
that differ from Llama only in what `Variant` names, one module computing them all (`model.name` selects one):

  llama    Llama 2 / 3.x.
  qwen2    Qwen2 / Qwen2.5 (Yang et al. 2024, "Qwen2 Technical Report", section 2.2.1): biases on the q, k and v
           projections.
  qwen3    Qwen3 (Yang et al. 2025, "Qwen3 Technical Report", section 2): RMSNorm over each head's queries and
           keys (qk-norm), no biases. With `model.moe` it is Qwen3-MoE's computation.
  mistral  Mistral 7B (Jiang et al. 2023, section 2): Llama's blocks; its sliding window is `model.sliding_window`,
           which every family honours.
  mixtral  Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", section 2.1): Mistral whose every MLP is a
           top-k mixture of experts (`model.moe`, required; `jaxpar.model.moe` routes as Mixtral does).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import cast

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config.errors import ConfigError
from jaxpar.config.schema import FIRST_DENSE, ModelConfig
from jaxpar.model.layers import Attention, Embed, LMHead, RMSNorm, SwiGLU
from jaxpar.model.mla import MLA
from jaxpar.model.moe import MoE
from jaxpar.model.rope import model_inverse_frequencies
from jaxpar.model.stack import Gather, no_gather, run_layer, scan_layers, stack_layers
from jaxpar.parallel.tensor import NO_TENSOR_PARALLEL, TensorParallel


@dataclasses.dataclass(frozen=True)
class Variant:
    """What sets one family of this module apart from Llama (module docstring).

    Attributes:
      name: the family's `model.name`.
      qkv_bias: biases on the q, k and v projections (`jaxpar.model.layers.Attention`).
      qk_norm: RMSNorm over each head's queries and keys, with epsilon `model.norm_eps`.
      moe: `model.moe` must be on (True), must be off (False), or either (None).
    """

    name: str
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool | None = None


LLAMA = Variant("llama")
QWEN2 = Variant("qwen2", qkv_bias=True, moe=False)  # Qwen2-MoE's gated shared expert is not computed here
QWEN3 = Variant("qwen3", qk_norm=True)
MISTRAL = Variant("mistral", moe=False)  # with experts it is mixtral
MIXTRAL = Variant("mixtral", moe=True)
VARIANTS = {v.name: v for v in (LLAMA, QWEN2, QWEN3, MISTRAL, MIXTRAL)}


def check_variant(cfg: ModelConfig, variant: Variant) -> None:
    """Raises ConfigError (a ValueError), naming the fix, where `cfg.moe` contradicts the family (`Variant.moe`)."""
    if variant.moe is True and not cfg.moe.enabled:
        raise ConfigError(
            f"model.name={variant.name} is a mixture of experts: set model.moe.num_experts (e.g. 8) and "
            f"model.moe.top_k (e.g. 2), or use model.name=mistral for the dense model"
        )
    if variant.moe is False and cfg.moe.enabled:
        instead = "mixtral" if variant is MISTRAL else "qwen3 or llama"
        raise ConfigError(
            f"model.name={variant.name} is a dense model but model.moe.num_experts={cfg.moe.num_experts}: use "
            f"model.name={instead} for experts, or set model.moe.num_experts=0"
        )


def attention_scale(cfg: ModelConfig) -> float | None:
    """The scores' multiplier `model.attention_scale_width` ** -0.5, or None (the head width's K ** -0.5)."""
    return None if cfg.attention_scale_width is None else float(cfg.attention_scale_width) ** -0.5


def softcapped(logits: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(logits / cap) in the logits' dtype, as transformers' Gemma 2 caps its logits; `logits` when cap
    is None. Its backward reads the output y alone (the derivative is 1 - (y / cap)^2), which the loss keeps
    anyway: no [B, T, V] residual of its own (measured: an fp32 one cost Gemma 2 9B 5 GB per device)."""
    if cap is None:
        return logits
    return _softcap(logits, float(cap))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _softcap(x: jax.Array, cap: float) -> jax.Array:
    return (jnp.tanh(x / cap) * cap).astype(x.dtype)


def _softcap_fwd(x: jax.Array, cap: float) -> tuple[jax.Array, jax.Array]:
    y = _softcap(x, cap)
    return y, y


def _softcap_bwd(cap: float, y: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    y32 = y.astype(jnp.float32) / cap
    return ((g.astype(jnp.float32) * (1.0 - y32 * y32)).astype(g.dtype),)


_softcap.defvjp(_softcap_fwd, _softcap_bwd)


def make_attention(
    cfg: ModelConfig, rngs: nnx.Rngs, variant: Variant = LLAMA, windowed: bool = True
) -> Attention | MLA:
    """The attention of one block of `cfg`: its heads, rotary embedding, implementation and `variant`'s biases or
    qk-norm, the score scale and soft-capping, and `model.sliding_window` when `windowed` (gemma2's global layers
    are not). With `model.kv_lora_rank` set, Multi-head Latent Attention (`jaxpar.model.mla.MLA`) with the same
    rotary base and scaling, implementation, score scale, soft-capping and window.

    Raises:
      ConfigError: MLA for a family with biases or qk-norm on its projections (`variant`), which MLA has not.
    """
    if cfg.kv_lora_rank is not None:  # cfg.mla
        if variant.qkv_bias or variant.qk_norm:
            raise ConfigError(
                f"model.kv_lora_rank={cfg.kv_lora_rank} (Multi-head Latent Attention) with model.name={variant.name}, "
                f"whose attention has q/k/v biases or qk-norm that MLA has not; use model.name=llama, or set "
                f"model.kv_lora_rank=null"
            )
        nope, rope, value = cfg.mla_widths
        inv_freq = model_inverse_frequencies(dataclasses.replace(cfg, head_dim=rope))  # over the rotary width R
        return MLA(
            cfg.d_model,
            cfg.n_heads,
            cfg.kv_lora_rank,
            cfg.q_lora_rank,
            nope,
            rope,
            value,
            cfg.rope_theta,
            cfg.init_std,
            rngs,
            norm_eps=cfg.norm_eps,
            implementation=cfg.attention,
            max_segments=cfg.max_segments,
            rope_inv_freq=inv_freq,
            window=cfg.sliding_window if windowed else None,
            scale=attention_scale(cfg),
            softcap=cfg.attention_softcap,
        )
    return Attention(
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
        qkv_bias=variant.qkv_bias,
        qk_norm_eps=cfg.norm_eps if variant.qk_norm else None,
        window=cfg.sliding_window if windowed else None,
        scale=attention_scale(cfg),
        softcap=cfg.attention_softcap,
    )


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x)). x: [B, T, D].

    With `moe` the MLP is a mixture of experts (`jaxpar.model.moe.MoE`) and the block returns (x, router
    statistics)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False, variant: Variant = LLAMA):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = make_attention(cfg, rngs, variant)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp: MoE | SwiGLU
        if moe:
            self.mlp = MoE(cfg.d_model, cfg.moe.d_expert or cfg.d_ff, cfg.moe, cfg.init_std, rngs)
        else:
            self.mlp = SwiGLU(cfg.d_model, cfg.d_ff, cfg.init_std, rngs)
        self.moe = moe

    def __call__(
        self,
        x_BTD: jax.Array,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        segment_ids_BT: jax.Array | None = None,
        positions_BT: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, dict]:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), tp, segment_ids_BT, positions_BT)
        if isinstance(self.mlp, MoE):  # self.moe
            y_BTD, stats = self.mlp(self.mlp_norm(x_BTD), tp)
            return x_BTD + y_BTD, stats
        return x_BTD + self.mlp(self.mlp_norm(x_BTD), tp)


class MoEGroup(nnx.Module):
    """The stack's unit with `model.moe` on: `model.moe.every` blocks, dense ones (`dense_0`, ...) then one MoE
    block (`moe`); returns (x [B, T, D], the MoE block's router statistics)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, variant: Variant = LLAMA):
        self.n_dense = cfg.moe.every - 1
        for i in range(self.n_dense):
            setattr(self, f"dense_{i}", Block(cfg, rngs, variant=variant))
        self.moe = Block(cfg, rngs, moe=True, variant=variant)

    def __call__(
        self,
        x_BTD: jax.Array,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        segment_ids_BT: jax.Array | None = None,
        positions_BT: jax.Array | None = None,
    ) -> tuple[jax.Array, dict]:
        for i in range(self.n_dense):
            x_BTD = getattr(self, f"dense_{i}")(x_BTD, tp, segment_ids_BT, positions_BT)
        # an MoE block: (x, statistics)
        return cast(tuple[jax.Array, dict], self.moe(x_BTD, tp, segment_ids_BT, positions_BT))


class Llama(nnx.Module):
    """Token ids [B, T] int32 -> logits [B, T, V] in the compute dtype, for every family of the module docstring
    (`variant`).

    Reads every `ModelConfig` field: vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, d_ff,
    rope_theta, rope_scaling (and its factors), norm_eps, tie_embeddings, init_std, remat, attention, max_segments,
    sliding_window, attention_softcap, final_softcap, attention_scale_width, moe (init_from is read by the training
    loop, not the model).

    Raises:
      ConfigError: `cfg.moe` contradicts the family (`check_variant`).

    Attributes:
      embed: `Embed` table [V, D].
      first_dense_0, ...: with `model.moe.first_dense` = k, the k dense `Block`s before the stack, each its own
        module (no `layers` dimension: they run with the embedding, `embed_tokens`).
      blocks: L stacked `Block`s (leading `layers` dimension on every parameter); with `model.moe`,
        (L - first_dense) / moe.every stacked `MoEGroup`s.
      final_norm: `RMSNorm` [D].
      lm_head: `LMHead` [D, V], or None with tied embeddings.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, variant: Variant = LLAMA):
        check_variant(cfg, variant)
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.d_model, cfg.init_std, rngs)
        for i in range(cfg.first_dense):
            setattr(self, f"{FIRST_DENSE}{i}", Block(cfg, rngs, variant=variant))
        if cfg.moe.enabled:
            units = cfg.stack_depth
            self.blocks = stack_layers(units, lambda layer_rngs: MoEGroup(cfg, layer_rngs, variant), rngs)
        else:
            self.blocks = stack_layers(cfg.n_layers, lambda layer_rngs: Block(cfg, layer_rngs, variant=variant), rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
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
        """Token ids [B, T] -> activations [B, T, D] (T/t under sequence parallelism) in `dtype`: the embedding,
        then `model.moe.first_dense`'s dense blocks (each gathered and checkpointed as a stacked layer is,
        `jaxpar.model.stack.run_layer`; segment ids and rotary positions as `run_blocks` takes them)."""
        x_BTD = gather(self.embed)(tokens_BT, dtype, tp)
        for i in range(self.cfg.first_dense):
            block = getattr(self, f"{FIRST_DENSE}{i}")
            x_BTD = run_layer(block, x_BTD, self.cfg.remat, gather, tp, segment_ids_BT, positions_BT)
        return x_BTD

    def run_blocks(
        self,
        x_BTD: jax.Array,
        gather: Gather = no_gather,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        segment_ids_BT: jax.Array | None = None,
        positions_BT: jax.Array | None = None,
    ) -> jax.Array:
        """Scans the stacked blocks (all of this module's layers) over activations [B, T, D]; with segment ids
        (int32 [B, T]) attention stays within each packed document; positions_BT (int32 [B, T]) are the rotary
        positions when given (context parallelism: this device's slice, `jaxpar.model.layers.Attention`)."""
        return self.run_blocks_with_stats(x_BTD, gather, tp, segment_ids_BT, positions_BT)[0]

    def run_blocks_with_stats(
        self,
        x_BTD: jax.Array,
        gather: Gather = no_gather,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        segment_ids_BT: jax.Array | None = None,
        positions_BT: jax.Array | None = None,
    ) -> tuple[jax.Array, dict | None]:
        """`run_blocks`, and with `model.moe` the router statistics of every MoE block stacked on a leading
        dimension of size n_layers / moe.every (`jaxpar.model.moe`), else None."""
        remat = self.cfg.remat
        if not self.cfg.moe.enabled:
            return scan_layers(self.blocks, x_BTD, remat, gather, tp, segment_ids_BT, positions_BT=positions_BT), None
        return scan_layers(
            self.blocks, x_BTD, remat, gather, tp, segment_ids_BT, with_aux=True, positions_BT=positions_BT
        )

    def logits(
        self, x_BTD: jax.Array, gather: Gather = no_gather, tp: TensorParallel = NO_TENSOR_PARALLEL
    ) -> jax.Array:
        """Final norm and output projection: [B, T, D] -> [B, T, V] (V/t, this rank's vocabulary shard)."""
        x_BTD = gather(self.final_norm)(x_BTD)
        if self.lm_head is None:
            logits = gather(self.embed).attend(x_BTD, tp)
        else:
            logits = gather(self.lm_head)(x_BTD, tp)
        return softcapped(logits, self.cfg.final_softcap)

    def __call__(
        self,
        tokens_BT: jax.Array,
        dtype: jnp.dtype = jnp.float32,
        gather: Gather = no_gather,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        segment_ids_BT: jax.Array | None = None,
    ) -> jax.Array:
        x_BTD = self.embed_tokens(tokens_BT, dtype, gather, tp, segment_ids_BT)
        return self.logits(self.run_blocks(x_BTD, gather, tp, segment_ids_BT), gather, tp)


def fp8_gemm_sites(model) -> int:
    """The FP8 GEMMs (`precision.fp8`) one row of the built-in llama's layer stack runs, each with its own scales:
    a block's 7 (q, k, v, o, MLP gate, up, down), or with `model.moe` a row of `model.moe.every` blocks whose
    last is an MoE block: its attention's 4, the routed experts' 3 (each stacked weight one tensor) and, with
    shared experts, their SwiGLU's 3.

    Args:
      model: a `ModelConfig` (uses moe.enabled, moe.every, moe.shared_experts).
    """
    dense = 7
    if not model.moe.enabled:
        return dense
    return (model.moe.every - 1) * dense + 4 + 3 + (3 if model.moe.shared_experts else 0)


def recompute_flops_per_token(model, seq_len: float) -> float:
    """Forward FLOPs per token that `model.remat` runs a second time in the backward pass (hardware only), for
    the built-in `llama` family (another family registers its own count, `jaxpar.model.registry`; the total is
    `jaxpar.model.flops.hardware_flops_per_token`).

    Per layer, with D = d_model, H heads, G key/value heads, K head width, F MLP width, T = `seq_len`
    (a matmul of an [T, a] by [a, b] costs 2ab FLOPs per token; the attention products QK^T and AV cost
    2THK each; PaLM appendix B):
      none  0: every matmul output is saved;
      dots  4THK: QK^T and AV have batch dimensions, so `dots_with_no_batch_dims_saveable` recomputes them;
      names 2D(HK + 2GK) + 2THK + 2HKD + 4DF: only the attention context and the MLP hidden are saved, so the
            q/k/v projections and QK^T (for the softmax), the out projection (the MLP norm's backward needs its
            input) and the gate/up projections (SwiGLU's backward needs them) are recomputed;
      full  2D(HK + 2GK) + 4THK + 2HKD + 4DF: the block forward except the down projection, whose output only
            feeds the residual sum that no backward needs.
    With tensor parallelism (mesh.tensor > 1) every policy keeps the output of the attention's exit collective
    (`jaxpar.model.stack`), so names and full do not recompute the out projection either: this count, which does
    not know the tensor size, is then 2HKD per layer high for those two.
    Checked against XLA's cost analysis of the compiled gradient in tests/unit/test_flops.py.
    With `model.moe`, an MoE block's gate/up term is 4D(k + shared_experts)F_e (its k = top_k active experts; F_e
    the experts' width) and the router's 2DE is added for names and full. With Multi-head Latent Attention
    (`jaxpar.model.mla`) the projections are its down- and up-projections, 2(DX + XH(N + R) + D(Z + R) +
    ZH(N + E)), QK^T costs 2TH(N + R), AV 2THE and the out projection 2HED.

    Args:
      model: a `ModelConfig` (uses remat, n_layers, d_model, n_heads, kv_heads, head_width, d_ff, moe).
    Raises:
      ValueError: an unknown remat policy.
    """
    d, h, g, k, f = model.d_model, model.n_heads, model.kv_heads, model.head_width, model.d_ff
    if getattr(model, "mla", False):  # scores of width N + R, values and context of width E (jaxpar.model.mla)
        nope, rope, value = model.mla_widths
        z, x = model.kv_lora_rank, model.q_lora_rank
        queries = d * h * (nope + rope) if x is None else d * x + x * h * (nope + rope)
        qkv = 2 * (queries + d * (z + rope) + z * h * (nope + value))
        scores, weighted, out = 2 * seq_len * h * (nope + rope), 2 * seq_len * h * value, 2 * h * value * d
    else:
        qkv, scores, out = 2 * d * (h * k + 2 * g * k), 2 * seq_len * h * k, 2 * h * k * d
        weighted = scores
    gate_up = 4 * d * f
    # Per layer: (the recomputed FLOPs besides the MLP's gate/up projections, whether those are recomputed too).
    # Which matmul outputs a policy keeps is its own matter, not `REMAT_KEEPING_EXITS_ONLY` (which collective
    # outputs it keeps), though names and full happen to be in both.
    per_layer = {
        "none": (0, False),
        "dots": (scores + weighted, False),
        "names": (qkv + scores + out, True),
        "full": (qkv + scores + weighted + out, True),
    }
    if model.remat not in per_layer:
        raise ValueError(f"unknown remat policy {model.remat!r}; expected one of {sorted(per_layer)}")
    rest, gate_up_recomputed = per_layer[model.remat]
    total = model.n_layers * (rest + (gate_up if gate_up_recomputed else 0))
    moe = getattr(model, "moe", None)
    if moe is not None and moe.enabled and gate_up_recomputed:
        f_e = moe.d_expert or f
        total += model.stack_depth * (
            4 * d * (moe.top_k + moe.shared_experts) * f_e + 2 * d * moe.num_experts - gate_up
        )
    return float(total)
