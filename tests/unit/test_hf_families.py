"""Qwen2, Qwen3, Mistral, Mixtral and Gemma 2 in and out of Hugging Face format (`jaxpar.model.hf`).

Fixtures (tests/fixtures/, written by transformers 5.24.0 with torch 2.13.0+cpu through
tests/fixtures/make_hf_fixtures.py, every tensor random, biases and norm scales included):
  hf_qwen2_tied      float32, tied embeddings, 4/2 heads, q/k/v biases, one file
  hf_qwen3_bf16      bfloat16, untied, 4/2 heads of width 16 (not 32 / 4), qk-norm, five shards with an index
  hf_mistral_window  float32, untied, 4/1 heads, sliding window 5 on 16 tokens, one file
  hf_mixtral         float32, untied, 4/2 heads, 4 experts of width 48, top-2, one file
  hf_gemma2          float32, tied, 4 layers (local, global, local, global), 4/2 heads of width 16, window 5 on
                     the local layers, query_pre_attn_scalar 24, soft-capping 2 (scores) and 10 (logits)
Their logits against transformers' are test_hf.py's (every family's, one test). Here: each family's own feature
is what makes them match, the configs read, HF -> jaxpar -> HF is bit-identical, and what a family's transformers
class cannot express is refused on the way in and out.
"""

import copy
import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_helpers import FAMILY_FIXTURES, GEMMA2, MISTRAL, MIXTRAL, QWEN2, QWEN3, assert_same_tensors

from jaxpar.model.hf import HFConfigError, check_hf, load_hf, save_hf
from jaxpar.model.hf.config import hf_config_from_model, model_config_from_hf, model_differences
from jaxpar.model.params import model_def


def _logits(cfg, params, fixture) -> np.ndarray:
    model = model_def(dataclasses.replace(cfg, attention="xla")).bind(jax.tree.map(jnp.asarray, params))
    return np.asarray(model(jnp.asarray(np.load(os.path.join(fixture, "tokens.npy"))), jnp.float32))


def _without_feature(family: str, cfg, params):
    """The model without the family's own feature: (cfg, params)."""
    params = copy.deepcopy(params)
    if family == "qwen2":
        for key in ("bq", "bk", "bv"):
            params["blocks"]["attn"][key] = np.zeros_like(params["blocks"]["attn"][key])
    elif family == "qwen3":  # llama's attention: no qk-norm
        attn = params["blocks"]["attn"]
        del attn["q_norm"], attn["k_norm"]
        cfg = dataclasses.replace(cfg, name="llama")
    elif family == "mistral":
        cfg = dataclasses.replace(cfg, sliding_window=None)
    elif family == "gemma2":  # scores not soft-capped (the window, scale and logits' cap kept)
        cfg = dataclasses.replace(cfg, attention_softcap=None)
    else:  # mixtral: the raw top-1 probability instead of Mixtral's renormalised top-2 gates
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, top_k=1))
    return cfg, params


@pytest.mark.parametrize("family", list(FAMILY_FIXTURES))
def test_the_family_feature_is_what_matches(family):
    """Without its own feature (biases, qk-norm, window, renormalised top-2, soft-capped scores) a family's logits miss
    transformers' by far more than test_hf.py's bound: that test checks the feature."""
    fixture = FAMILY_FIXTURES[family]
    hf = load_hf(fixture)
    cfg, params = _without_feature(family, hf.cfg, hf.params)
    want = np.load(os.path.join(fixture, "logits.npy"))
    assert np.abs(_logits(cfg, params, fixture) - want).max() > 1e-2 * np.abs(want).max()


def test_imported_configs():
    qwen2, qwen3, mistral, mixtral = (load_hf(f) for f in (QWEN2, QWEN3, MISTRAL, MIXTRAL))
    assert [m.cfg.name for m in (qwen2, qwen3, mistral, mixtral)] == ["qwen2", "qwen3", "mistral", "mixtral"]
    assert (qwen2.cfg.tie_embeddings, qwen2.cfg.rope_theta, qwen2.dtype) == (True, 1e6, "float32")
    assert qwen2.params["blocks"]["attn"]["bq"].shape == (2, 4, 8)  # [L, H, K]
    assert qwen2.params["blocks"]["attn"]["bk"].shape == (2, 2, 8)  # [L, G, K]
    assert (qwen3.cfg.head_width, qwen3.cfg.d_model // qwen3.cfg.n_heads, qwen3.dtype) == (16, 8, "bfloat16")
    assert qwen3.params["blocks"]["attn"]["q_norm"]["scale"].shape == (2, 16)
    assert (mistral.cfg.sliding_window, mistral.cfg.kv_heads) == (5, 1)
    moe = mixtral.cfg.moe
    assert (moe.num_experts, moe.top_k, moe.every, moe.shared_experts, mixtral.cfg.d_ff) == (4, 2, 1, 0, 48)
    assert (mixtral.cfg.rope_theta, mixtral.cfg.norm_eps, mixtral.cfg.sliding_window) == (1e6, 1e-5, None)
    mlp = mixtral.params["blocks"]["moe"]["mlp"]
    shapes = (mlp["router"].shape, mlp["w_gate"].shape, mlp["w_down"].shape)
    assert shapes == ((2, 32, 4), (2, 4, 32, 48), (2, 4, 48, 32))  # [L, D, E], [L, E, D, F], [L, E, F, D]
    assert not any(m.cfg.moe.enabled for m in (qwen2, qwen3, mistral))
    gemma = load_hf(GEMMA2)
    c = gemma.cfg
    assert (c.name, c.n_layers, c.stack_depth, c.head_width, c.sliding_window, c.tie_embeddings) == (
        "gemma2",
        4,
        2,
        16,
        5,
        True,
    )
    assert (c.attention_scale_width, c.attention_softcap, c.final_softcap, c.norm_eps) == (24, 2.0, 10.0, 1e-6)
    pair = gemma.params["blocks"]
    assert sorted(pair) == ["full", "local"] and pair["local"]["attn"]["wq"].shape == (2, 32, 4, 16)  # [L/2, ...]
    assert sorted(pair["full"]) == ["attn", "attn_norm", "attn_post_norm", "mlp", "mlp_norm", "mlp_post_norm"]


@pytest.mark.parametrize("family", list(FAMILY_FIXTURES))
def test_round_trip_is_bit_identical(family, tmp_path):
    """HF -> jaxpar -> HF gives the fixture's tensors bit for bit in its own dtype (Qwen3's bf16 sharded with an
    index), and a config.json that reads back as the same model."""
    fixture = FAMILY_FIXTURES[family]
    hf = load_hf(fixture)
    out = str(tmp_path / "out")
    shard = 20_000 if family == "qwen3" else 5 * 2**30
    files = save_hf(hf.params, hf.cfg, out, dtype=hf.dtype, base_config=hf.hf_config, max_shard_bytes=shard)
    assert ("model.safetensors.index.json" in files) == (family == "qwen3")
    assert_same_tensors(out, fixture)
    back = json.load(open(os.path.join(out, "config.json")))
    assert back["architectures"] == hf.hf_config["architectures"]
    assert model_config_from_hf(back) == hf.cfg


def _edited(tmp_path, fixture, edit) -> str:
    out = str(tmp_path / "edited")
    shutil.copytree(fixture, out)
    path = os.path.join(out, "config.json")
    cfg = json.load(open(path))
    edit(cfg)
    json.dump(cfg, open(path, "w"))
    return out


@pytest.mark.parametrize(
    "fixture, edit, message",
    [
        (QWEN2, lambda c: c.update(use_sliding_window=True), "use_sliding_window=true: qwen2 then windows only"),
        (QWEN3, lambda c: c.update(layer_types=["sliding_attention", "full_attention"]), "layer_types holds"),
        (QWEN3, lambda c: c.update(attention_bias=True), "attention_bias=True is not supported by jaxpar's qwen3"),
        (MISTRAL, lambda c: c.update(sliding_window=0), "sliding_window=0 is not a positive number"),
        (MIXTRAL, lambda c: c.update(num_experts_per_tok=1), "num_experts_per_tok=1: Mixtral renormalises"),
        (MIXTRAL, lambda c: c.pop("num_local_experts"), "lacks 'num_local_experts', which a Mixtral config has"),
        (MIXTRAL, lambda c: c.update(num_local_experts=3), r"missing: \[\]|unexpected: \['model.layers.0.block"),
        (GEMMA2, lambda c: c.update(layer_types=["full_attention"] * 4), "layer_types must alternate"),
        (GEMMA2, lambda c: c.update(hidden_activation="gelu"), "hidden_activation='gelu' is not supported"),
    ],
    ids=[
        "qwen2_window",
        "qwen3_layer_types",
        "qwen3_bias",
        "mistral_window",
        "mixtral_top1",
        "mixtral_no_experts",
        "mixtral_expert_count",
        "gemma2_layer_types",
        "gemma2_activation",
    ],
)
def test_what_jaxpar_does_not_compute_is_refused(tmp_path, fixture, edit, message):
    with pytest.raises(HFConfigError, match=message):
        load_hf(_edited(tmp_path, fixture, edit))


def test_init_from_names_a_differing_family_or_window():
    """`model.init_from` (check_hf with the run's model) names each key on which the run differs."""
    mistral = load_hf(MISTRAL).cfg
    want = dataclasses.replace(mistral, name="llama", sliding_window=None)
    with pytest.raises(
        HFConfigError,
        match=r"model.name: config 'llama', Hugging Face directory 'mistral'.*"
        r"model.sliding_window: config None, Hugging Face directory 5",
    ):
        check_hf(MISTRAL, want)
    mixtral = load_hf(MIXTRAL).cfg
    fewer = dataclasses.replace(mixtral, moe=dataclasses.replace(mixtral.moe, num_experts=8))
    assert model_differences(fewer, mixtral) == ["model.moe.num_experts: config 8, Hugging Face directory 4"]


@pytest.mark.parametrize(
    "family, change, message",
    [
        ("mistral", {"name": "qwen2"}, "transformers' Qwen2ForCausalLM has no window on every layer"),
        ("qwen3", {"head_dim": 16, "name": "qwen2"}, "Qwen2 computes the head width as hidden_size"),
        ("mixtral", {"moe.every": 2}, r"Mixtral cannot express model.moe.every=2"),
        ("mixtral", {"moe.d_expert": 32}, r"model.moe.d_expert=32 \(Mixtral's experts are model.d_ff=48 wide\)"),
        ("mixtral", {"moe.gating": "sigmoid"}, r"Mixtral cannot express model.moe.gating=sigmoid"),
        ("qwen3", {"moe.num_experts": 4}, "transformers' Qwen3ForCausalLM is dense"),
        ("gemma2", {"sliding_window": None}, "Gemma2ForCausalLM needs the window of its local layers"),
        ("gemma2", {"name": "llama", "sliding_window": None}, "LlamaForCausalLM has no soft-capping or score scale"),
    ],
)
def test_export_refuses_what_the_family_cannot_express(family, change, message, tmp_path):
    """Refused before a file is written."""
    cfg = load_hf(FAMILY_FIXTURES[family]).cfg
    for key, value in change.items():
        if key.startswith("moe."):
            cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **{key[4:]: value}))
        else:
            cfg = dataclasses.replace(cfg, **{key: value})
    with pytest.raises(HFConfigError, match=message):
        hf_config_from_model(cfg, "float32")
    with pytest.raises(HFConfigError, match=message):
        save_hf({}, cfg, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")
