"""Rotary inverse frequencies, plain or with a context-extension scaling (Llama 3's, or linear interpolation).

The plain frequencies are RoFormer's (Su et al. 2021, eq. 15): inv_freq[i] = theta ** (-2i / K) for i < K/2, the
same as Hugging Face's `_compute_default_rope_parameters`. The scalings follow Hugging Face transformers'
`modeling_rope_utils` (`_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`, the latter from
Meta's llama-models `apply_scaling`), and, like them, leave the attention temperature at 1.
"""

from __future__ import annotations

import math

import numpy as np

from jaxpar.config.choices import ROPE_SCALINGS


def rope_inverse_frequencies(
    head_dim: int,
    theta: float,
    scaling: str = "none",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position: int = 8192,
) -> np.ndarray:
    """Inverse frequencies float32 [head_dim // 2] (radians per position) of rotary embedding.

    scaling:
      none: theta ** (-2i / head_dim).
      linear: the plain ones / factor (position interpolation, Chen et al. 2023).
      llama3: wavelengths 2*pi/f longer than original_max_position / low_freq_factor are divided by `factor`,
        those shorter than original_max_position / high_freq_factor kept, and those between interpolated with
        s = (original_max_position / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor):
        (1 - s) * f / factor + s * f.

    Computed in float32 step by step as Hugging Face does (numpy's float32 power may differ from torch's by an ulp).

    Raises:
      ValueError: an unknown `scaling`, or llama3 with high_freq_factor <= low_freq_factor.
    """
    if scaling not in ROPE_SCALINGS:
        raise ValueError(f"unknown rotary scaling {scaling!r}; use one of {ROPE_SCALINGS}")
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    inv = inv.astype(np.float32)
    if scaling == "linear":
        return (inv / np.float32(factor)).astype(np.float32)
    if scaling == "llama3":
        if high_freq_factor <= low_freq_factor:
            raise ValueError(
                f"llama3 rotary scaling needs high_freq_factor ({high_freq_factor}) > low_freq_factor "
                f"({low_freq_factor})"
            )
        low_wavelen = original_max_position / low_freq_factor
        high_wavelen = original_max_position / high_freq_factor
        wavelen = (2 * math.pi / inv).astype(np.float32)
        scaled = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv).astype(np.float32)
        smooth = ((original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)).astype(
            np.float32
        )
        smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def model_inverse_frequencies(cfg) -> tuple[float, ...] | None:
    """The rotary inverse frequencies [head_width / 2] of a `ModelConfig`'s `rope_scaling`, or None for `none` (the
    plain theta ** (-2i / K), computed in the model)."""
    if cfg.rope_scaling == "none":
        return None
    inv = rope_inverse_frequencies(
        cfg.head_width,
        cfg.rope_theta,
        cfg.rope_scaling,
        cfg.rope_scaling_factor,
        cfg.rope_low_freq_factor,
        cfg.rope_high_freq_factor,
        cfg.rope_original_max_position,
    )
    return tuple(float(f) for f in inv)
