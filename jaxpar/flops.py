"""Model FLOPs per token, parameter counts, peak device FLOP/s and MFU.

Symbols: N non-embedding parameters, L layers, h model width (d_model), s sequence length.
Source: PaLM (Chowdhery et al. 2022), appendix B; Kaplan et al. 2020, section 2.1.
"""
from __future__ import annotations



from jaxpar.model.params import param_count

# Dense bf16 peak FLOP/s per device (vendor datasheets; no sparsity). Matched by lower-cased substring of
# `jax.Device.device_kind`; longer keys are tried first so "v5p" wins over a shorter overlapping key.
PEAK_FLOPS: dict[str, float] = {
    "h100": 989e12,    # H100 SXM ("NVIDIA H100 80GB HBM3")
    "h100 pcie": 756e12,  # a different chip: never report it at the SXM peak
    "h200": 989e12,
    "a100": 312e12,
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,  # v5e reports device_kind "TPU v5 lite"
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v5": 459e12,   # v5p reports device_kind "TPU v5"
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


def hardware_flops_per_token(n_params_non_embedding: int, n_layers: int, d_model: int, seq_len: int,
                             *, remat: bool = True) -> float:
    """FLOPs per token the hardware executes; with full per-block rematerialisation: 8N + 16*L*h*s.

    Forward costs 2N + 4*L*h*s, backward twice that (PaLM appendix B); full block remat runs the forward once more,
    so 4/3 of the model FLOPs. Without remat this equals `flops_per_token`. Use for HFU, never for MFU.
    """
    if not remat:
        return flops_per_token(n_params_non_embedding, n_layers, d_model, seq_len)
    return 8.0 * n_params_non_embedding + 16.0 * n_layers * d_model * seq_len


def count_non_embedding_params(params: dict, embedding_keys: tuple[str, ...] = ("embed", "lm_head")) -> int:
    """Parameters outside the top-level subtrees named in `embedding_keys` (the N of `flops_per_token`).

    Raises:
      TypeError: `params` is not a mapping.
    """
    if not hasattr(params, "items"):
        raise TypeError(f"params must be a nested dict, got {type(params).__name__}")
    return sum(param_count(v) for k, v in params.items() if k not in embedding_keys)


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
