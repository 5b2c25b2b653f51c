"""Model FLOPs per token, parameter counts, peak device FLOP/s and MFU.

Symbols (PaLM's, formula quantities): P non-embedding parameters (PaLM's N), L layers, D model width (d_model, PaLM's
h), T sequence length (PaLM's s). Source: PaLM (Chowdhery et al. 2022), appendix B; Kaplan et al. 2020, section 2.1.
`model_flops` is the one place a run's FLOPs per token are computed (the training loop's MFU, the GPU acceptance
run, the planner's measured steps).

Mixture of experts (`model.moe`): P counts the *active* parameters, those one token's forward uses: the
routed experts' weights enter top_k / E times, while the router, the shared experts, attention and norms enter
whole (`active_non_embedding_params`). That is the 6P rule over activated parameters that DeepSeek-V3's report
(arXiv 2412.19437, section 4.2 and table 1: 37B activated of 671B) and Switch Transformer (Fedus et al. 2021,
section 2: "FLOPs per token" of top-1 routing equal the dense model's) use: a token's matmuls touch only k experts.
Capacity routing's padding slots and dropped tokens are not counted either way (model FLOPs, not hardware).
"""

from __future__ import annotations

import math

import jax

from jaxpar.model.registry import model_family

# Dense bf16 peak FLOP/s per device (vendor datasheets; no sparsity). Matched by lower-cased substring of
# `jax.Device.device_kind`; longer keys are tried first so "v5p" wins over a shorter overlapping key.
PEAK_FLOPS: dict[str, float] = {
    "h100": 989e12,  # H100 SXM ("NVIDIA H100 80GB HBM3")
    "h100 pcie": 756e12,  # a different chip: never report it at the SXM peak
    "h200": 989e12,
    "a100": 312e12,
    "b200": 2.25e15,  # HGX B200: 4.5 PFLOP/s FP16/BF16 with 2:4 sparsity, half of it dense
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,  # v5e reports device_kind "TPU v5 lite"
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v5": 459e12,  # v5p reports device_kind "TPU v5"
    "tpu v6 lite": 918e12,  # v6e (Trillium) reports "TPU v6 lite"
    "tpu v6e": 918e12,
}


# Dense FP8 (E4M3/E5M2 tensor-core) peak FLOP/s per device (vendor datasheets, no sparsity: half the "with
# sparsity" figure): twice bf16's on Hopper and Blackwell. A100 and the TPUs in `PEAK_FLOPS` have no FP8 tensor
# cores. Sources: NVIDIA H100 Tensor Core GPU datasheet (H100 SXM 3,958 TFLOPS FP8 with sparsity, PCIe 3,026), H200
# datasheet (3,958), HGX B200 (72 PFLOPS FP8/FP6 with sparsity over 8 GPUs: 4.5 PFLOPS dense each).
PEAK_FP8_FLOPS: dict[str, float] = {
    "h100": 1979e12,
    "h100 pcie": 1513e12,
    "h200": 1979e12,
    "b200": 4.5e15,
}


def flops_per_token(
    n_params_non_embedding: int, n_layers: int, d_model: int, seq_len: float, attention_width: float | None = None
) -> float:
    """Model training FLOPs per token (forward + backward): 6P + 12*L*D*T, or 6P + 6*L*A*T with `attention_width` A.

    PaLM appendix B. The attention term 12*L*D*T is the full, un-halved one (QK^T and AV over all T positions,
    not discounting the causal mask): per layer and token the forward's QK^T costs 2*T times the queries' width
    over the heads and AV 2*T times the values', D each in PaLM's count, and the backward twice the forward. A
    (`attention_width`, None: 2D) is the sum of those two widths when they are not D: H*(N + R) + H*E for
    Multi-head Latent Attention (`attention_width`). Recomputation is not counted: these are model FLOPs, the
    numerator of MFU.

    Returns:
      FLOPs per token (float).
    """
    width = 2.0 * d_model if attention_width is None else float(attention_width)
    return 6.0 * n_params_non_embedding + 6.0 * n_layers * width * seq_len


def attention_width(model) -> float | None:
    """The A of `flops_per_token` for `model` (a `ModelConfig`): with Multi-head Latent Attention
    (`model.kv_lora_rank`; DeepSeek-V2, arXiv 2405.04434, section 2.1) H*(N + R + E), the scores' width
    H*(qk_nope_head_dim + qk_rope_head_dim) plus the values' H*v_head_dim (the kernel's zero padding of the values,
    `jaxpar.model.mla`, is not model FLOPs); None (PaLM's 2D) for the usual attention."""
    if not getattr(model, "mla", False):
        return None
    nope, rope, value = model.mla_widths
    return float(model.n_heads * (nope + rope + value))


def hardware_flops_per_token(
    model_flops_per_token: float, recomputed_flops_per_token: float, *, stage_recompute: bool = False
) -> float:
    """FLOPs per token the hardware executes, for HFU (never MFU): model FLOPs plus the forward FLOPs the remat
    policy recomputes (`jaxpar.model.llama.recompute_flops_per_token` for the built-in llama family), plus one
    more forward (a third of the model FLOPs) when `stage_recompute` (jaxpar's 1F1B schedule with
    `pipeline.recompute: true` rebuilds each stage's forward from its stashed input before the backward; see
    `jaxpar.parallel.pipeline_1f1b` and `stage_recompute`). With remat none and no stage recompute the result is the
    model FLOPs: HFU == MFU."""
    extra = model_flops_per_token / 3 if stage_recompute else 0.0
    return model_flops_per_token + extra + recomputed_flops_per_token


def stage_recompute(cfg) -> bool:
    """Whether the step rebuilds each pipeline stage's forward before its backward: 1F1B or a zero-bubble schedule
    (zb-h1, zb-v) on more than one stage with `pipeline.recompute: true` (GPipe, and the others without
    recompute, keep the forward's residuals). `cfg`: a `jaxpar.config.schema.Config`."""
    return cfg.mesh.pipeline > 1 and cfg.pipeline.schedule != "gpipe" and cfg.pipeline.recompute


def param_count(params) -> int:
    """Number of scalar parameters in a pytree of arrays or ShapeDtypeStructs."""
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))


def count_non_embedding_params(params: dict, embedding_keys: tuple[str, ...] = ("embed", "lm_head")) -> int:
    """Parameters outside the top-level subtrees named in `embedding_keys` (the P of `flops_per_token`).

    Raises:
      TypeError: `params` is not a mapping.
    """
    if not hasattr(params, "items"):
        raise TypeError(f"params must be a nested dict, got {type(params).__name__}")
    return sum(param_count(v) for k, v in params.items() if k not in embedding_keys)


def inactive_expert_params(model) -> int:
    """Routed-expert parameters one token does not use, for the built-in llama's `model.moe`: per MoE block
    (E - k) experts of 3 * D * F_e weights (SwiGLU gate, up, down; F_e = moe.d_expert or d_ff). 0 for a
    dense model. `model`: a `ModelConfig`."""
    moe = getattr(model, "moe", None)
    if moe is None or not moe.enabled:
        return 0
    f_e = moe.d_expert or model.d_ff
    return model.stack_depth * (moe.num_experts - moe.top_k) * 3 * model.d_model * f_e


def active_non_embedding_params(params: dict, model) -> int:
    """The P of `flops_per_token` for `model` (a `ModelConfig`): `count_non_embedding_params(params)` less the
    experts a token does not use (`inactive_expert_params`); equal to it for a dense model."""
    return count_non_embedding_params(params) - inactive_expert_params(model)


def attention_span(model, seq_len: int) -> float:
    """Keys per query, averaged over the layers, of a model of `seq_len` tokens (`model`: a `ModelConfig`): T
    without a window; min(T, W) with `model.sliding_window` W on every layer; for gemma2, whose local layers (every
    other one) alone are windowed (`jaxpar.model.gemma`), (T + min(T, W)) / 2. Every attention FLOP count is
    linear in it."""
    if model.sliding_window is None:
        return float(seq_len)
    windowed = float(min(seq_len, model.sliding_window))
    return (seq_len + windowed) / 2 if model.name == "gemma2" else windowed


def model_flops(cfg, params) -> tuple[float, float | None]:
    """(model FLOPs per token, hardware FLOPs per token or None) of training `cfg` (a `jaxpar.config.Config`):
    `flops_per_token` of the active non-embedding parameters of `params` (a pytree of arrays or
    ShapeDtypeStructs: `active_non_embedding_params`), and `hardware_flops_per_token` with the model family's
    recompute count (`jaxpar.model.registry.ModelFamily.recompute_flops_per_token`) and the pipeline's stage
    recompute (`stage_recompute`); None where the family registered no recompute count.

    With a sliding window (`model.sliding_window` = W) a query's scores cover min(T, W) keys, so both counts take
    the mean attention span over the layers for T (`attention_span`; the same un-halved convention as PaLM's:
    `flops_per_token`). With Multi-head Latent Attention the attention products take its widths
    (`attention_width`), and the built-in family's recompute count takes MLA's projections
    (`jaxpar.model.llama.recompute_flops_per_token`).

    Raises:
      ConfigError: `model.name` is not a registered model family.
    """
    model = cfg.model
    span = attention_span(model, cfg.data.seq_len)
    per_token = flops_per_token(
        active_non_embedding_params(params, model), model.n_layers, model.d_model, span, attention_width(model)
    )
    recompute = model_family(model.name).recompute_flops_per_token
    if recompute is None:
        return per_token, None
    recomputed = recompute(model, span)
    return per_token, hardware_flops_per_token(per_token, recomputed, stage_recompute=stage_recompute(cfg))


def row_flops_per_token(cfg, params) -> float:
    """Training FLOPs per token of one row of the layer stack (a layer, or a group of `model.moe.every` blocks)
    as the hardware runs it: `model_flops`' hardware count (the remat policy's and the pipeline's recomputed
    forwards included; the model count where the family registered none) over `model.stack_depth` rows plus the
    `model.moe.first_dense` blocks before the stack, each costed as 1/`model.layers_per_unit` row (DeepSeek-V3
    sizes its dense FFN, 3*D*18432, as its MoE block's active experts, 9*3*D*2048). What a pipeline stage's
    layers cost against its head's 6*D*V (`jaxpar.parallel.layer_split.chunk_counts`)."""
    model, hardware = model_flops(cfg, params)
    m = cfg.model
    return (hardware if hardware is not None else model) / (m.stack_depth + m.first_dense / m.layers_per_unit)


def peak_flops(device_kind: str, override: float = 0.0, table: dict[str, float] = PEAK_FLOPS) -> float | None:
    """Dense peak FLOP/s of one device: `override` if > 0, else `table`'s entry (`PEAK_FLOPS`, bf16; or
    `PEAK_FP8_FLOPS`), else None (e.g. "cpu", or an A100's FP8)."""
    if override > 0:
        return float(override)
    kind = device_kind.lower()
    for key in sorted(table, key=len, reverse=True):
        if key in kind:
            return table[key]
    return None


def mfu(tokens_per_s: float, flops_per_token: float, num_devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation = tokens_per_s * flops_per_token / (num_devices * peak); None if peak is None.

    Args:
      tokens_per_s: global training throughput (tokens/s over all devices).
      flops_per_token: model FLOPs per token (`flops_per_token`, not the hardware count).
      num_devices: devices the throughput is spread over.
      peak: per-device peak FLOP/s (`peak_flops`).
    """
    if peak is None:
        return None
    return tokens_per_s * flops_per_token / (num_devices * peak)
