"""Hugging Face `config.json` <-> jaxpar `ModelConfig`, for the families of `jaxpar.model.llama`.

    config.json model_type / architecture      jaxpar model.name   what the family adds to Llama
    llama    LlamaForCausalLM                  llama
    qwen2    Qwen2ForCausalLM                  qwen2               q/k/v biases
    qwen3    Qwen3ForCausalLM                  qwen3               qk-norm (q_norm, k_norm), explicit head_dim
    mistral  MistralForCausalLM                mistral             sliding_window -> model.sliding_window
    mixtral  MixtralForCausalLM                mixtral             num_local_experts -> model.moe.num_experts,
                                                                   num_experts_per_tok -> model.moe.top_k (every
                                                                   block, no shared experts), sliding_window
    gemma2   Gemma2ForCausalLM                 gemma2              `jaxpar.model.gemma`; sliding_window (its local
                                                                   layers), query_pre_attn_scalar ->
                                                                   model.attention_scale_width,
                                                                   attn_logit_softcapping -> model.attention_softcap,
                                                                   final_logit_softcapping -> model.final_softcap
    deepseek_v3  DeepseekV3ForCausalLM         llama               Multi-head Latent Attention (`jaxpar.model.mla`):
                                                                   q_lora_rank, kv_lora_rank, qk_nope_head_dim,
                                                                   qk_rope_head_dim, v_head_dim -> model.*; DeepSeekMoE
                                                                   (`jaxpar.model.moe`, sigmoid gating):
                                                                   first_k_dense_replace -> model.moe.first_dense,
                                                                   intermediate_size -> model.d_ff (the dense blocks),
                                                                   moe_intermediate_size -> model.moe.d_expert,
                                                                   n_routed_experts -> num_experts,
                                                                   num_experts_per_tok -> top_k,
                                                                   n_shared_experts -> shared_experts,
                                                                   routed_scaling_factor -> routed_scale,
                                                                   n_group -> expert_groups, topk_group -> group_top_k

A jaxpar model with `model.kv_lora_rank` set (MLA) exports as deepseek_v3 whatever its model.name (llama, mistral or
mixtral, which compute alike with MLA), with or without experts (a dense one as first_k_dense_replace =
num_hidden_layers); imported, deepseek_v3 is model.name llama. What transformers' DeepseekV3 computes and jaxpar
does not is refused: norm_topk_prob false (jaxpar's sigmoid gates are always normalised over the top-k), YaRN rope
scaling (DeepSeek-V3's released 128K config), an rms_norm_eps other than 1e-6 (transformers' latent norms use 1e-6
whatever it says, jaxpar's model.norm_eps), attention biases, fp8-quantised weights (`quantization_config`).
Multi-token prediction (num_nextn_predict_layers) is not part of transformers' DeepseekV3ForCausalLM forward nor of
jaxpar's model: the key is ignored on import, and an export writes 0. Whether the rotary columns are stored in
DeepSeek's interleaved pairs (rope_interleave, transformers' default true) is the weights' matter
(`jaxpar.model.hf.weights`); an export writes them interleaved, rope_interleave true.

Reads both the transformers 4.x layout (`rope_theta` and `rope_scaling` at the top level, as Meta's published Llama
2/3 directories have it) and the 5.x one (`rope_parameters` holding `rope_theta` and `rope_type`); writes the 4.x
layout, which transformers 5.x also reads. Only what jaxpar computes is accepted: SiLU-gated MLP, RMSNorm, rotary
scaling none / linear / llama3, a window on every layer or none (Qwen2/3's `use_sliding_window`, which windows only
some layers, is refused); anything else is refused with the key that differs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

from jaxpar.config.mla import MLA_KEYS
from jaxpar.config.paths import directory_problem
from jaxpar.config.schema import ModelConfig, MoEConfig

_LOGGER = logging.getLogger("jaxpar.model.hf")

CONFIG_FILE = "config.json"
# jaxpar model.name -> transformers' architecture; config.json's model_type is the same name as jaxpar's
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}
DEEPSEEK_V3 = "deepseek_v3"  # the model_type of every MLA model (jaxpar model.name llama: module docstring)
HF_ARCHITECTURES = {**ARCHITECTURES, DEEPSEEK_V3: "DeepseekV3ForCausalLM"}  # config.json model_type -> class
MLA_NAMES = ("llama", "mistral", "mixtral")  # the families whose blocks are DeepseekV3's with MLA
MLA_NORM_EPS = 1e-6  # transformers' DeepseekV3 latent norms' epsilon (its RMSNorm default, not rms_norm_eps)
# transformers' DeepseekV3Config defaults of the keys that are not the model's shape, where config.json leaves one out
_DEEPSEEK_V3_DEFAULTS = {
    "first_k_dense_replace": 3,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
}
DEFAULT_MAX_POSITIONS = 2048  # transformers' LlamaConfig default, written when nothing longer is known
# transformers' defaults where config.json leaves a key out (each family's configuration class)
_DEFAULT_THETA = {"mixtral": 1e6}
_DEFAULT_EPS = {"mixtral": 1e-5}
_WINDOWED = ("mistral", "mixtral", "gemma2")  # families with a sliding_window (gemma2's on its local layers)
GEMMA2_LAYER_TYPES = ("sliding_attention", "full_attention")  # Gemma 2's layers alternate, the first local
_GEMMA2_DEFAULTS = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096}

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
    "sliding_window",
    "attention_softcap",
    "final_softcap",
    "attention_scale_width",
    *MLA_KEYS,
)
_MLA_WIDTHS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")  # ModelConfig.mla_widths' order
# model.moe fields a Mixtral's or DeepSeek-V3's config.json fixes (the routing mode, capacity, loss weights and
# balancing-bias rate are the run's own)
IMPORTED_MOE_FIELDS = (
    "num_experts",
    "top_k",
    "every",
    "shared_experts",
    "d_expert",
    "first_dense",
    "gating",
    "routed_scale",
    "expert_groups",
    "group_top_k",
)


class HFConfigError(ValueError):
    """A Hugging Face directory jaxpar cannot read as a model it computes exactly (the message names the key)."""


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


def _rope(hf: dict, default_theta: float) -> dict:
    """ModelConfig's rope_* fields from either config layout."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):  # transformers 5.x
        theta, scaling = params.get("rope_theta", hf.get("rope_theta", default_theta)), params
    else:  # transformers 4.x / Meta's published files
        theta, scaling = hf.get("rope_theta", default_theta), hf.get("rope_scaling") or {}
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
    if kind == "yarn":
        raise HFConfigError(
            "config.json: rope scaling type 'yarn' is not supported: YaRN's context extension (e.g. DeepSeek-V3's "
            "released 128K config) needs its own frequencies and attention-scale correction (mscale), which jaxpar's "
            "rotary embedding (jaxpar.model.rope) does not compute; use a checkpoint with rope scaling default, "
            "linear or llama3"
        )
    raise HFConfigError(
        f"config.json: rope scaling type {kind!r} is not supported (jaxpar computes default, linear and llama3); "
        f"use a checkpoint with one of those"
    )


def _require(hf: dict, key: str, allowed: tuple, default) -> None:
    value = hf.get(key, default)
    if value not in allowed:
        raise HFConfigError(
            f"config.json: {key}={value!r} is not supported by jaxpar's {hf.get('model_type')} model (supported: "
            f"{list(allowed)})"
        )


def _window(hf: dict, family: str) -> int | None:
    """model.sliding_window of a config.json (module docstring)."""
    if family in ("qwen2", "qwen3"):
        kinds = set(hf.get("layer_types") or ["full_attention"])
        if kinds != {"full_attention"}:
            raise HFConfigError(
                f"config.json: layer_types holds {sorted(kinds - {'full_attention'})}: jaxpar's {family} runs full "
                f"attention on every layer (its window, model.sliding_window, covers every layer); use a checkpoint "
                f"whose layers are all full_attention"
            )
        if hf.get("use_sliding_window", False):
            raise HFConfigError(
                f"config.json: use_sliding_window=true: {family} then windows only the layers from "
                f"max_window_layers={hf.get('max_window_layers')} on, which jaxpar does not compute (its window, "
                f"model.sliding_window, covers every layer); use a checkpoint without it"
            )
        return None  # their sliding_window key is unused without use_sliding_window
    if family not in _WINDOWED:
        return None
    window = hf.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise HFConfigError(f"config.json: sliding_window={window!r} is not a positive number of tokens or null")
    return window


def _softcaps(hf: dict, family: str) -> dict:
    """model.attention_softcap, final_softcap and attention_scale_width of a config.json (None but for gemma2)."""
    if family != "gemma2":
        return {"attention_softcap": None, "final_softcap": None, "attention_scale_width": None}

    def cap(key: str) -> float | None:
        value = hf.get(key)
        return None if value is None else float(value)

    return {
        "attention_softcap": cap("attn_logit_softcapping"),
        "final_softcap": cap("final_logit_softcapping"),
        "attention_scale_width": int(hf["query_pre_attn_scalar"]),
    }


def _moe(hf: dict, base_moe: MoEConfig) -> MoEConfig:
    """model.moe of a Mixtral config.json: its experts on every block, `base_moe`'s routing and loss settings."""
    try:
        experts, top_k = int(hf["num_local_experts"]), int(hf["num_experts_per_tok"])
    except KeyError as e:
        raise HFConfigError(f"config.json lacks {e.args[0]!r}, which a Mixtral config has") from e
    if top_k < 2:
        raise HFConfigError(
            f"config.json: num_experts_per_tok={top_k}: Mixtral renormalises its top-k gates, which jaxpar does for "
            f"top_k >= 2 only (top-1 keeps the raw probability, as Switch Transformer does)"
        )
    if hf.get("router_jitter_noise", 0.0):
        _LOGGER.warning(
            "config.json: router_jitter_noise=%s is a training-time perturbation jaxpar does not apply; the weights "
            "load as they are",
            hf["router_jitter_noise"],
        )
    return dataclasses.replace(
        base_moe,
        num_experts=experts,
        top_k=top_k,
        every=1,
        shared_experts=0,
        d_expert=0,
        first_dense=0,
        gating="softmax",
        routed_scale=1.0,
        expert_groups=1,
        group_top_k=0,
    )


def _deepseek_v3(hf: dict, base: ModelConfig) -> ModelConfig:
    """The ModelConfig (model.name llama, `base`'s other fields kept) of a DeepSeek-V3 config.json (module
    docstring); the routing mode, capacity, aux-loss weight and bias rate stay `base`'s, the z-loss weight is 0
    (sigmoid gates have none: `jaxpar.config.moe`)."""
    _require(hf, "hidden_act", ("silu",), "silu")
    _require(hf, "attention_bias", (False,), False)
    # DeepSeek's own (remote-code) keys: transformers' DeepseekV3 always computes these, which jaxpar does too
    _require(hf, "scoring_func", ("sigmoid",), "sigmoid")
    _require(hf, "topk_method", ("noaux_tc",), "noaux_tc")
    _require(hf, "moe_layer_freq", (1,), 1)
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method") if isinstance(hf["quantization_config"], dict) else None
        raise HFConfigError(
            f"config.json: quantization_config (quant_method {method!r}): the weights are quantised (DeepSeek-V3's "
            f"release stores fp8 blocks with weight_scale_inv tensors); jaxpar imports F32, BF16 and F16 weights: "
            f"dequantise them to bfloat16 first (e.g. DeepSeek's fp8_cast_bf16.py) and drop quantization_config"
        )
    hf = {**_DEEPSEEK_V3_DEFAULTS, **hf}
    if hf["norm_topk_prob"] is not True:
        raise HFConfigError(
            f"config.json: norm_topk_prob={hf['norm_topk_prob']!r}: jaxpar's sigmoid gating "
            f"(model.moe.gating=sigmoid) always normalises the top-k gates to sum to 1 (DeepSeek-V3's eq. 13); use "
            f"a checkpoint with norm_topk_prob true"
        )
    if float(hf["rms_norm_eps"]) != MLA_NORM_EPS:
        raise HFConfigError(
            f"config.json: rms_norm_eps={hf['rms_norm_eps']}: transformers' DeepseekV3 normalises the query and "
            f"key/value latents with epsilon {MLA_NORM_EPS} whatever rms_norm_eps says, and jaxpar's MLA with "
            f"model.norm_eps, as every norm; only rms_norm_eps {MLA_NORM_EPS} (DeepSeek-V3's) computes alike"
        )
    try:
        n_heads, layers = int(hf["num_attention_heads"]), int(hf["num_hidden_layers"])
        if hf.get("num_key_value_heads") not in (None, n_heads):
            raise HFConfigError(
                f"config.json: num_key_value_heads={hf['num_key_value_heads']} differs from num_attention_heads="
                f"{n_heads}: Multi-head Latent Attention gives every head its own keys and values"
            )
        q_lora = hf["q_lora_rank"]
        mla = {
            "n_kv_heads": None,
            "head_dim": None,  # MLA's widths are their own keys (transformers' head_dim is qk_rope_head_dim)
            "kv_lora_rank": int(hf["kv_lora_rank"]),
            "q_lora_rank": None if q_lora is None else int(q_lora),
            "qk_nope_head_dim": int(hf["qk_nope_head_dim"]),
            "qk_rope_head_dim": int(hf["qk_rope_head_dim"]),
            "v_head_dim": int(hf["v_head_dim"]),
        }
        first = int(hf["first_k_dense_replace"] or 0)
        moe = dataclasses.replace(base.moe, num_experts=0)
        if first < layers:  # else every block is dense: transformers builds no MoE layer
            groups = int(hf["n_group"] or 1)
            shared = int(hf["n_shared_experts"] or 0)
            if shared < 1:
                raise HFConfigError(
                    f"config.json: n_shared_experts={hf['n_shared_experts']!r}: transformers' DeepseekV3 then has "
                    f"zero-width shared-expert tensors, which jaxpar's MoE (no shared experts: none) does not hold"
                )
            moe = dataclasses.replace(
                base.moe,
                num_experts=int(hf["n_routed_experts"]),
                top_k=int(hf["num_experts_per_tok"]),
                d_expert=int(hf["moe_intermediate_size"]),
                shared_experts=shared,
                every=1,
                first_dense=first,
                gating="sigmoid",
                routed_scale=float(hf["routed_scaling_factor"]),
                expert_groups=groups,
                group_top_k=0 if groups == 1 else int(hf["topk_group"] or groups),
                z_loss_weight=0.0,
            )
        fields = {
            "vocab_size": int(hf["vocab_size"]),
            "d_model": int(hf["hidden_size"]),
            "n_layers": layers,
            "n_heads": n_heads,
            "d_ff": int(hf["intermediate_size"]),
            "norm_eps": float(hf["rms_norm_eps"]),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "sliding_window": None,
            **_softcaps(hf, DEEPSEEK_V3),
            **_rope(hf, 10000.0),
            **mla,
        }
    except KeyError as e:
        raise HFConfigError(f"config.json lacks {e.args[0]!r}, which a {DEEPSEEK_V3} config has") from e
    if hf.get("num_nextn_predict_layers"):
        _LOGGER.info(
            "config.json: num_nextn_predict_layers=%s: multi-token prediction is not part of transformers' "
            "DeepseekV3ForCausalLM forward nor of jaxpar's model; its layers' tensors (model.layers.%d and on), "
            "where stored, are not read",
            hf["num_nextn_predict_layers"],
            layers,
        )
    return dataclasses.replace(base, name="llama", moe=moe, **fields)


def model_config_from_hf(hf: dict, base: ModelConfig | None = None) -> ModelConfig:
    """The jaxpar `ModelConfig` of a Hugging Face config dict (module docstring's families): `base` (default
    `ModelConfig()`) with `name`, IMPORTED_FIELDS and, for Mixtral and DeepSeek-V3, IMPORTED_MOE_FIELDS replaced;
    the rest (remat, attention, init_std, the MoE routing mode, ...) kept from `base`.

    Raises:
      HFConfigError: a model_type jaxpar does not convert, a feature its model lacks (a bias it does not have,
        another activation, an unknown rope scaling type (YaRN included), a window on some layers only, DeepSeek-V3
        gates not normalised over the top-k, quantised weights), or a missing shape key; the message names the key.
    """
    family = hf.get("model_type")
    if family not in HF_ARCHITECTURES:
        raise HFConfigError(
            f"config.json: model_type={family!r} is not one jaxpar converts (supported: {sorted(HF_ARCHITECTURES)})"
        )
    if family == DEEPSEEK_V3:
        return _deepseek_v3(hf, base or ModelConfig())
    if family == "gemma2":
        _require(hf, "hidden_activation", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh")
        _require(hf, "attention_bias", (False,), False)
        _require(hf, "use_bidirectional_attention", (None, False), None)
        want = [GEMMA2_LAYER_TYPES[i % 2] for i in range(int(hf.get("num_hidden_layers", 0)))]
        if hf.get("layer_types", want) != want:
            raise HFConfigError(
                "config.json: layer_types must alternate sliding_attention and full_attention from the first layer, "
                "as every Gemma 2 does (jaxpar stacks them as pairs)"
            )
    else:
        _require(hf, "hidden_act", ("silu",), "silu")
    if family in ("llama", "qwen3"):
        _require(hf, "attention_bias", (False,), False)  # qwen2's q/k/v biases are fixed by its architecture
    if family == "llama":
        _require(hf, "mlp_bias", (False,), False)
        _require(hf, "pretraining_tp", (1,), 1)
    base = base or ModelConfig()
    if family == "gemma2":
        hf = {**_GEMMA2_DEFAULTS, **hf}
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
            "norm_eps": float(hf.get("rms_norm_eps", _DEFAULT_EPS.get(family, 1e-6))),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", family == "gemma2")),
            "sliding_window": _window(hf, family),
            **_softcaps(hf, family),
            **_rope(hf, _DEFAULT_THETA.get(family, 10000.0)),
        }
    except KeyError as e:
        raise HFConfigError(f"config.json lacks {e.args[0]!r}, which a {family} config has") from e
    moe = _moe(hf, base.moe) if family == "mixtral" else dataclasses.replace(base.moe, num_experts=0)
    return dataclasses.replace(base, name=family, moe=moe, **fields)


def _exportable(cfg: ModelConfig) -> None:
    """Raises HFConfigError where `cfg` has something its family's transformers class cannot express."""
    name = cfg.name
    if name not in ARCHITECTURES:
        raise HFConfigError(
            f"model.name={name!r}: only the built-in families {sorted(ARCHITECTURES)} export to Hugging Face format"
        )
    if cfg.mla:
        _exportable_mla(cfg)
        return
    if cfg.sliding_window is not None and name not in _WINDOWED:
        raise HFConfigError(
            f"model.sliding_window={cfg.sliding_window}: transformers' {ARCHITECTURES[name]} has no window on every "
            f"layer; export a run without one, or of model.name mistral"
        )
    capped = [
        f"model.{k}={getattr(cfg, k)}"
        for k in ("attention_softcap", "final_softcap", "attention_scale_width")
        if getattr(cfg, k) is not None
    ]
    if capped and name != "gemma2":
        raise HFConfigError(
            f"{', '.join(capped)}: transformers' {ARCHITECTURES[name]} has no soft-capping or score scale of its own; "
            f"export a run without them, or of model.name gemma2"
        )
    if name == "gemma2" and cfg.sliding_window is None:
        raise HFConfigError(
            "model.sliding_window=null: transformers' Gemma2ForCausalLM needs the window of its local layers; export "
            "a run with model.sliding_window set (Gemma 2: 4096)"
        )
    if name == "qwen2" and cfg.head_width * cfg.n_heads != cfg.d_model:
        raise HFConfigError(
            f"model.head_dim={cfg.head_width}: transformers' Qwen2 computes the head width as hidden_size / "
            f"num_attention_heads = {cfg.d_model // cfg.n_heads}; export a run with model.head_dim null"
        )
    moe = cfg.moe
    if name != "mixtral":
        if moe.enabled:  # the model refuses these too (jaxpar.model.llama.check_variant), but for qwen3
            raise HFConfigError(
                f"model.moe.num_experts={moe.num_experts}: transformers' {ARCHITECTURES[name]} is dense; export a "
                f"run without model.moe, or of model.name mixtral"
            )
        return
    problems = []
    if moe.every != 1:
        problems.append(f"model.moe.every={moe.every} (Mixtral: every block, 1)")
    if moe.shared_experts:
        problems.append(f"model.moe.shared_experts={moe.shared_experts} (Mixtral: 0)")
    if moe.d_expert not in (0, cfg.d_ff):
        problems.append(f"model.moe.d_expert={moe.d_expert} (Mixtral's experts are model.d_ff={cfg.d_ff} wide)")
    if moe.top_k < 2:
        problems.append(f"model.moe.top_k={moe.top_k} (Mixtral renormalises top-k gates, k >= 2)")
    if moe.first_dense:
        problems.append(f"model.moe.first_dense={moe.first_dense} (Mixtral: experts in every block, 0)")
    if moe.gating != "softmax" or moe.routed_scale != 1.0 or moe.expert_groups != 1:
        problems.append(
            f"model.moe.gating={moe.gating}, routed_scale={moe.routed_scale}, expert_groups={moe.expert_groups} "
            f"(Mixtral: softmax, 1.0, 1)"
        )
    if problems:
        raise HFConfigError(
            "transformers' Mixtral cannot express "
            + "; ".join(problems)
            + " (transformers' DeepseekV3 has dense first blocks, shared experts and sigmoid, scaled, grouped "
            "routing, with Multi-head Latent Attention: a run with model.kv_lora_rank set exports as deepseek_v3)"
        )


def _exportable_mla(cfg: ModelConfig) -> None:
    """Raises HFConfigError where transformers' DeepseekV3 cannot express the MLA model `cfg`."""
    moe, problems = cfg.moe, []
    if cfg.name not in MLA_NAMES:
        problems.append(f"model.name={cfg.name} (its blocks are {', '.join(MLA_NAMES)}'s)")
    if cfg.sliding_window is not None:
        problems.append(f"model.sliding_window={cfg.sliding_window} (DeepseekV3: full attention)")
    problems += [
        f"model.{k}={getattr(cfg, k)} (DeepseekV3: null)"
        for k in ("attention_softcap", "final_softcap", "attention_scale_width")
        if getattr(cfg, k) is not None
    ]
    if cfg.norm_eps != MLA_NORM_EPS:
        problems.append(
            f"model.norm_eps={cfg.norm_eps} (DeepseekV3's latent norms use {MLA_NORM_EPS} whatever rms_norm_eps says)"
        )
    if moe.enabled:
        if moe.every != 1:
            problems.append(f"model.moe.every={moe.every} (DeepseekV3: every block after the dense ones, 1)")
        if moe.gating != "sigmoid":
            problems.append(f"model.moe.gating={moe.gating} (DeepseekV3: sigmoid)")
        if moe.shared_experts < 1:
            problems.append(f"model.moe.shared_experts={moe.shared_experts} (DeepseekV3: at least 1)")
        if moe.group_top_k and moe.num_experts // moe.expert_groups < 2:
            problems.append(
                f"model.moe.expert_groups={moe.expert_groups} of {moe.num_experts} experts (DeepseekV3 scores a "
                f"group by its top 2: at least 2 experts a group)"
            )
    if problems:
        raise HFConfigError(
            "transformers' DeepseekV3 (the class of a model with model.kv_lora_rank, Multi-head Latent Attention) "
            "cannot express " + "; ".join(problems)
        )


def hf_model_type(cfg: ModelConfig) -> str:
    """config.json's model_type for a jaxpar model of `cfg`: deepseek_v3 with Multi-head Latent Attention
    (`model.kv_lora_rank` set), else `cfg.name`."""
    return DEEPSEEK_V3 if cfg.mla else cfg.name


def _deepseek_v3_keys(cfg: ModelConfig) -> dict:
    """The DeepseekV3 keys of an MLA model (module docstring): latents, widths, rotary layout, experts."""
    nope, rope, value = cfg.mla_widths
    out = {
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": value,
        "head_dim": rope,  # what transformers' DeepseekV3Config sets it to (its rotary width)
        "rope_interleave": True,  # the rotary columns are written in DeepSeek's interleaved pairs
        "attention_bias": False,
        "num_nextn_predict_layers": 0,  # no multi-token-prediction layers written
    }
    moe = cfg.moe
    if not moe.enabled:
        return {**out, "first_k_dense_replace": cfg.n_layers}  # every block dense
    return {
        **out,
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.d_expert or cfg.d_ff,
        "n_shared_experts": moe.shared_experts,
        "first_k_dense_replace": moe.first_dense,
        "routed_scaling_factor": moe.routed_scale,
        "n_group": moe.expert_groups if moe.group_top_k else 1,  # group_top_k 0: every group, as one group
        "topk_group": moe.group_top_k or 1,
        "norm_topk_prob": True,
    }


def hf_config_from_model(cfg: ModelConfig, dtype: str, base: dict | None = None) -> dict:
    """A transformers config dict of `cfg`'s family (4.x layout), weights stored as `dtype` ("float32",
    "bfloat16", "float16"). `base` (e.g. the imported directory's config.json: token ids, max positions) supplies
    every key jaxpar does not own; the shape, rope, window, expert and dtype keys are always jaxpar's.

    A model with Multi-head Latent Attention (`model.kv_lora_rank`) is transformers' DeepseekV3 (module docstring:
    model_type deepseek_v3, its experts' and latents' keys, rope_interleave true).

    Raises:
      HFConfigError: `cfg.name` is not one of `ARCHITECTURES`, or `cfg` has what its family's transformers
        class cannot express (a window outside Mistral/Mixtral/Gemma 2, soft-capping or a score scale outside
        Gemma 2, experts outside Mixtral or unlike Mixtral's (dense first blocks, sigmoid or grouped routing
        included) without MLA, a Qwen2 head width other than hidden_size / num_attention_heads; with MLA: a
        window, soft-capping, a score scale, model.norm_eps other than 1e-6, softmax gating, no shared experts,
        `every` other than 1, or groups of a single expert).
    """
    _exportable(cfg)
    name, model_type = cfg.name, hf_model_type(cfg)
    out = {k: v for k, v in (base or {}).items() if k not in ("rope_parameters", "torch_dtype", "dtype")}
    if out.get("model_type", model_type) != model_type:  # another family's keys (e.g. a llama run's, as qwen2)
        out = {k: v for k, v in out.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
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
            "architectures": [HF_ARCHITECTURES[model_type]],
            "model_type": model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.kv_heads,
            "intermediate_size": cfg.d_ff,
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": rope_scaling,
            "tie_word_embeddings": cfg.tie_embeddings,
            "torch_dtype": dtype,
        }
    )
    if model_type == DEEPSEEK_V3:
        out.update({"hidden_act": "silu", **_deepseek_v3_keys(cfg)})
        out.setdefault("max_position_embeddings", default_positions)
        return out
    if name != "qwen2":  # Qwen2's head width is hidden_size / num_attention_heads, with no key (_exportable)
        out["head_dim"] = cfg.head_width
    if name == "gemma2":
        out.update(
            {
                "hidden_activation": "gelu_pytorch_tanh",
                "attention_bias": False,
                "query_pre_attn_scalar": cfg.attention_scale_width or cfg.head_width,
                "attn_logit_softcapping": cfg.attention_softcap,
                "final_logit_softcapping": cfg.final_softcap,
                "layer_types": [GEMMA2_LAYER_TYPES[i % 2] for i in range(cfg.n_layers)],
            }
        )
        out.pop("hidden_act", None)
    else:
        out["hidden_act"] = "silu"
    if name == "llama":
        out.update({"attention_bias": False, "mlp_bias": False})
    if name == "qwen3":
        out["attention_bias"] = False
    if name in ("qwen2", "qwen3"):
        out.update({"use_sliding_window": False, "layer_types": ["full_attention"] * cfg.n_layers})
    if name in _WINDOWED:
        out["sliding_window"] = cfg.sliding_window
    if name == "mixtral":
        out.update({"num_local_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.top_k})
    out.setdefault("max_position_embeddings", default_positions)
    return out


def model_differences(want: ModelConfig, hf: ModelConfig) -> list[str]:
    """'model.KEY: config A, Hugging Face directory B' for the name and every IMPORTED_FIELDS and
    IMPORTED_MOE_FIELDS entry where they differ (head counts and widths compared as resolved: n_kv_heads null
    means n_heads; an expert width of 0 as model.d_ff; MLA's widths as `ModelConfig.mla_widths` and only between
    two MLA models, whose head_dim is no more than the widths' default)."""
    out = []
    mla = want.mla and hf.mla
    if want.name != hf.name:
        out.append(f"model.name: config {want.name!r}, Hugging Face directory {hf.name!r}")
    for key in IMPORTED_MOE_FIELDS:
        a, b = getattr(want.moe, key), getattr(hf.moe, key)
        if key == "d_expert":
            a, b = a or want.d_ff, b or hf.d_ff
        if (want.moe.enabled or hf.moe.enabled) and a != b:
            out.append(f"model.moe.{key}: config {a!r}, Hugging Face directory {b!r}")
    for key in IMPORTED_FIELDS:
        a, b = getattr(want, key), getattr(hf, key)
        if key == "n_kv_heads":
            a, b = want.kv_heads, hf.kv_heads
        elif key == "head_dim":
            if mla:
                continue
            a, b = want.head_width, hf.head_width
        elif key in _MLA_WIDTHS or key == "q_lora_rank":
            if not mla:
                continue  # without MLA on both sides they mean nothing (kv_lora_rank differs, if either has it)
            if key in _MLA_WIDTHS:
                a, b = (m.mla_widths[_MLA_WIDTHS.index(key)] for m in (want, hf))
        elif (
            key
            in ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position")
            and want.rope_scaling == hf.rope_scaling == "none"
        ):
            continue
        if a != b:
            out.append(f"model.{key}: config {a!r}, Hugging Face directory {b!r}")
    return out
