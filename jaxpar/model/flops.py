"""Model FLOPs per token, parameter counts, peak device FLOP/s and MFU.

Symbols: N non-embedding parameters, L layers, h model width (d_model), s sequence length.
Source: PaLM (Chowdhery et al. 2022), appendix B; Kaplan et al. 2020, section 2.1.

Mixture of experts (`model.moe`): N counts the *active* parameters, those one token's forward uses: the
routed experts' weights enter top_k / E times, while the router, the shared experts, attention and norms enter
whole (`active_non_embedding_params`). That is the 6N rule over activated parameters that DeepSeek-V3's report
(arXiv 2412.19437, section 4.2 and table 1: 37B activated of 671B) and Switch Transformer (Fedus et al. 2021,
section 2: "FLOPs per token" of top-1 routing equal the dense model's) use: a token's matmuls touch only k experts.
Capacity routing's padding slots and dropped tokens are not counted either way (model FLOPs, not hardware).
"""

from __future__ import annotations

import math

import jax

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


def flops_per_token(n_params_non_embedding: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Model training FLOPs per token (forward + backward): 6N + 12*L*h*s.

    PaLM appendix B. The attention term 12*L*h*s is the full, un-halved one (QK^T and AV over all s positions,
    not discounting the causal mask). Recomputation is not counted: these are model FLOPs, the numerator of MFU.

    Returns:
      FLOPs per token (float).
    """
    return 6.0 * n_params_non_embedding + 12.0 * n_layers * d_model * seq_len


def recompute_flops_per_token(model, seq_len: int) -> float:
    """Forward FLOPs per token that `model.remat` runs a second time in the backward pass (hardware only), for
    the built-in `llama` family (`jaxpar.model.llama`; another family registers its own count).

    Per layer, with D = d_model, H heads, G key/value heads, K head width, F MLP width, s = `seq_len`
    (a matmul of an [s, a] by [a, b] costs 2ab FLOPs per token; the attention products QK^T and AV cost
    2sHK each; PaLM appendix B):
      none  0: every matmul output is saved;
      dots  4sHK: QK^T and AV have batch dimensions, so `dots_with_no_batch_dims_saveable` recomputes them;
      names 2D(HK + 2GK) + 2sHK + 2HKD + 4DF: only the attention context and the MLP hidden are saved, so the
            q/k/v projections and QK^T (for the softmax), the out projection (the MLP norm's backward needs its
            input) and the gate/up projections (SwiGLU's backward needs them) are recomputed;
      full  2D(HK + 2GK) + 4sHK + 2HKD + 4DF: the block forward except the down projection, whose output only
            feeds the residual sum that no backward needs.
    With tensor parallelism (mesh.tensor > 1) every policy keeps the output of the attention's exit collective
    (`jaxpar.model.stack`), so names and full do not recompute the out projection either: this count, which does
    not know the tensor size, is then 2HKD per layer high for those two.
    Checked against XLA's cost analysis of the compiled gradient in tests/unit/test_flops.py.
    With `model.moe`, an MoE block's gate/up term is 4D(top_k + shared_experts)F_e (its active experts; F_e the
    experts' width) and the router's 2DE is added for names and full.

    Args:
      model: a `ModelConfig` (uses remat, n_layers, d_model, n_heads, kv_heads, head_width, d_ff, moe).
    Raises:
      ValueError: an unknown remat policy.
    """
    d, h, g, k, f = model.d_model, model.n_heads, model.kv_heads, model.head_width, model.d_ff
    qkv, attention = 2 * d * (h * k + 2 * g * k), 2 * seq_len * h * k
    out, gate_up = 2 * h * k * d, 4 * d * f
    per_layer = {
        "none": 0,
        "dots": 2 * attention,
        "names": qkv + attention + out + gate_up,
        "full": qkv + 2 * attention + out + gate_up,
    }
    if model.remat not in per_layer:
        raise ValueError(f"unknown remat policy {model.remat!r}; expected one of {sorted(per_layer)}")
    total = model.n_layers * per_layer[model.remat]
    moe = getattr(model, "moe", None)
    if moe is not None and moe.enabled and model.remat in ("names", "full"):
        f_e = moe.d_expert or f
        total += model.stack_depth * (
            4 * d * (moe.top_k + moe.shared_experts) * f_e + 2 * d * moe.num_experts - gate_up
        )
    return float(total)


def hardware_flops_per_token(
    model_flops_per_token: float, recomputed_flops_per_token: float, *, stage_recompute: bool = False
) -> float:
    """FLOPs per token the hardware executes, for HFU (never MFU): model FLOPs plus the forward FLOPs the remat
    policy recomputes (`recompute_flops_per_token` for the built-in llama family), plus one more forward (a third
    of the model FLOPs) when `stage_recompute` (jaxpar's 1F1B schedule with `pipeline.recompute: true` rebuilds
    each stage's forward from its stashed input before the backward; see `jaxpar.parallel.pipeline` and
    `stage_recompute`). With remat none and no stage recompute the result is the model FLOPs: HFU == MFU."""
    extra = model_flops_per_token / 3 if stage_recompute else 0.0
    return model_flops_per_token + extra + recomputed_flops_per_token


def stage_recompute(cfg) -> bool:
    """Whether the step rebuilds each pipeline stage's forward before its backward: 1F1B on more than one stage
    with `pipeline.recompute: true` (GPipe and 1F1B without recompute keep the forward's residuals). `cfg`: a
    `jaxpar.config.schema.Config`."""
    return cfg.mesh.pipeline > 1 and cfg.pipeline.schedule == "1f1b" and cfg.pipeline.recompute


def param_count(params) -> int:
    """Number of scalar parameters in a pytree of arrays or ShapeDtypeStructs."""
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))


def count_non_embedding_params(params: dict, embedding_keys: tuple[str, ...] = ("embed", "lm_head")) -> int:
    """Parameters outside the top-level subtrees named in `embedding_keys` (the N of `flops_per_token`).

    Raises:
      TypeError: `params` is not a mapping.
    """
    if not hasattr(params, "items"):
        raise TypeError(f"params must be a nested dict, got {type(params).__name__}")
    return sum(param_count(v) for k, v in params.items() if k not in embedding_keys)


def inactive_expert_params(model) -> int:
    """Routed-expert parameters one token does not use, for the built-in llama's `model.moe`: per MoE block
    (E - top_k) experts of 3 * D * F_e weights (SwiGLU gate, up, down; F_e = moe.d_expert or d_ff). 0 for a
    dense model. `model`: a `ModelConfig`."""
    moe = getattr(model, "moe", None)
    if moe is None or not moe.enabled:
        return 0
    f_e = moe.d_expert or model.d_ff
    return model.stack_depth * (moe.num_experts - moe.top_k) * 3 * model.d_model * f_e


def active_non_embedding_params(params: dict, model) -> int:
    """The N of `flops_per_token` for `model` (a `ModelConfig`): `count_non_embedding_params(params)` less the
    experts a token does not use (`inactive_expert_params`); equal to it for a dense model."""
    return count_non_embedding_params(params) - inactive_expert_params(model)


def peak_flops(device_kind: str, override: float = 0.0) -> float | None:
    """Dense bf16 peak FLOP/s of one device: `override` if > 0, else `PEAK_FLOPS`, else None (e.g. "cpu")."""
    if override > 0:
        return float(override)
    kind = device_kind.lower()
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key in kind:
            return PEAK_FLOPS[key]
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
