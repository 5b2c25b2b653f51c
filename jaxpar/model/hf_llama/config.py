"""Hugging Face Llama `config.json` <-> jaxpar `ModelConfig`.

Reads both the transformers 4.x layout (`rope_theta` and `rope_scaling` at the top level, as Meta's published Llama
2/3 directories have it) and the 5.x one (`rope_parameters` holding `rope_theta` and `rope_type`); writes the 4.x
layout, which transformers 5.x also reads. Only what jaxpar's `llama` family computes is accepted: SiLU-gated MLP,
no biases, RMSNorm, rotary scaling none / linear / llama3; anything else is refused with the key that differs.
"""

from __future__ import annotations

import dataclasses
import json
import os

from jaxpar.config.paths import directory_problem
from jaxpar.config.schema import ModelConfig

CONFIG_FILE = "config.json"
HF_ARCHITECTURE = "LlamaForCausalLM"
DEFAULT_MAX_POSITIONS = 2048  # transformers' LlamaConfig default, written when nothing longer is known

# ModelConfig fields that fix the weights' meaning: an imported directory must agree with them.
IMPORTED_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "d_ff",
    "rope_theta",
    "rope_scaling",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_position",
    "norm_eps",
    "tie_embeddings",
)


class HFConfigError(ValueError):
    """A Hugging Face directory jaxpar cannot read as a Llama it computes exactly (the message names the key)."""


def read_hf_config(hf_dir: str) -> dict:
    """The parsed `HF_DIR/config.json`.

    Raises:
      HFConfigError: `hf_dir` is not a directory or has no readable config.json.
    """
    path = os.path.join(hf_dir, CONFIG_FILE)
    problem = directory_problem(hf_dir)
    if problem is not None:
        raise HFConfigError(f"{hf_dir!r} {problem}; pass a Hugging Face model directory (config.json + *.safetensors)")
    if not os.path.isfile(path):
        raise HFConfigError(f"{hf_dir!r} has no {CONFIG_FILE}; pass a Hugging Face model directory")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFConfigError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise HFConfigError(f"{path}: the top level is not a JSON object")
    return cfg


def _rope(hf: dict) -> dict:
    """ModelConfig's rope_* fields from either config layout."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):  # transformers 5.x
        theta, scaling = params.get("rope_theta", hf.get("rope_theta", 10000.0)), params
    else:  # transformers 4.x / Meta's published files
        theta, scaling = hf.get("rope_theta", 10000.0), hf.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    out = {"rope_theta": float(theta)}
    if kind == "default":
        return {**out, "rope_scaling": "none"}
    if kind == "linear":
        return {**out, "rope_scaling": "linear", "rope_scaling_factor": float(scaling["factor"])}
    if kind == "llama3":
        try:
            return {
                **out,
                "rope_scaling": "llama3",
                "rope_scaling_factor": float(scaling["factor"]),
                "rope_low_freq_factor": float(scaling["low_freq_factor"]),
                "rope_high_freq_factor": float(scaling["high_freq_factor"]),
                "rope_original_max_position": int(scaling["original_max_position_embeddings"]),
            }
        except KeyError as e:
            raise HFConfigError(f"config.json: llama3 rope scaling lacks {e.args[0]!r}") from e
    raise HFConfigError(
        f"config.json: rope scaling type {kind!r} is not supported (jaxpar computes default, linear and llama3); "
        f"use a checkpoint with one of those"
    )


def _require(hf: dict, key: str, allowed: tuple, default) -> None:
    value = hf.get(key, default)
    if value not in allowed:
        raise HFConfigError(
            f"config.json: {key}={value!r} is not supported by jaxpar's llama model (supported: {list(allowed)})"
        )


def model_config_from_hf(hf: dict, base: ModelConfig | None = None) -> ModelConfig:
    """The jaxpar `ModelConfig` of a Hugging Face Llama config dict: `base` (default `ModelConfig()`) with
    IMPORTED_FIELDS replaced (and name `llama`); the rest (remat, attention, init_std, ...) kept from `base`.

    Raises:
      HFConfigError: not a Llama (model_type), a feature jaxpar's model lacks (biases, another activation, an
        unknown rope scaling type), or a missing shape key; the message names the key.
    """
    _require(hf, "model_type", ("llama",), None)
    _require(hf, "hidden_act", ("silu",), "silu")
    _require(hf, "attention_bias", (False,), False)
    _require(hf, "mlp_bias", (False,), False)
    _require(hf, "pretraining_tp", (1,), 1)
    try:
        n_heads = int(hf["num_attention_heads"])
        d_model = int(hf["hidden_size"])
        fields = {
            "vocab_size": int(hf["vocab_size"]),
            "d_model": d_model,
            "n_layers": int(hf["num_hidden_layers"]),
            "n_heads": n_heads,
            "n_kv_heads": int(hf.get("num_key_value_heads") or n_heads),
            "head_dim": int(hf.get("head_dim") or d_model // n_heads),
            "d_ff": int(hf["intermediate_size"]),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            **_rope(hf),
        }
    except KeyError as e:
        raise HFConfigError(f"config.json lacks {e.args[0]!r}, which a Llama config has") from e
    return dataclasses.replace(base or ModelConfig(), name="llama", **fields)


def hf_config_from_model(cfg: ModelConfig, dtype: str, base: dict | None = None) -> dict:
    """A transformers `LlamaConfig` dict for `cfg` (4.x layout), weights stored as `dtype` ("float32",
    "bfloat16", "float16"). `base` (e.g. the imported directory's config.json: token ids, max positions) supplies
    every key jaxpar does not own; the shape, rope and dtype keys are always jaxpar's.

    Raises:
      HFConfigError: `cfg.name` is not `llama`, or `cfg.moe` is on (a Hugging Face Llama has no experts).
    """
    if cfg.name != "llama":
        raise HFConfigError(f"model.name={cfg.name!r}: only the built-in llama family exports to Hugging Face Llama")
    if cfg.moe.enabled:
        raise HFConfigError(
            f"model.moe.num_experts={cfg.moe.num_experts}: a mixture-of-experts model does not export to Hugging "
            f"Face Llama (which is dense); export a run without model.moe"
        )
    out = {k: v for k, v in (base or {}).items() if k not in ("rope_parameters", "torch_dtype", "dtype")}
    rope_scaling = None
    if cfg.rope_scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": cfg.rope_scaling_factor}
    elif cfg.rope_scaling == "llama3":
        rope_scaling = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position,
        }
    default_positions = DEFAULT_MAX_POSITIONS
    if cfg.rope_scaling == "llama3":
        default_positions = int(cfg.rope_original_max_position * cfg.rope_scaling_factor)
    out.update(
        {
            "architectures": [HF_ARCHITECTURE],
            "model_type": "llama",
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_width,
            "intermediate_size": cfg.d_ff,
            "hidden_act": "silu",
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": rope_scaling,
            "tie_word_embeddings": cfg.tie_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": dtype,
        }
    )
    out.setdefault("max_position_embeddings", default_positions)
    return out


def model_differences(want: ModelConfig, hf: ModelConfig) -> list[str]:
    """'model.KEY: config A, Hugging Face directory B' for every IMPORTED_FIELDS entry where they differ (head
    counts and widths compared as resolved: n_kv_heads null means n_heads)."""
    out = []
    for key in IMPORTED_FIELDS:
        a, b = getattr(want, key), getattr(hf, key)
        if key == "n_kv_heads":
            a, b = want.kv_heads, hf.kv_heads
        elif key == "head_dim":
            a, b = want.head_width, hf.head_width
        elif (
            key
            in ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position")
            and want.rope_scaling == hf.rope_scaling == "none"
        ):
            continue
        if a != b:
            out.append(f"model.{key}: config {a!r}, Hugging Face directory {b!r}")
    return out
