"""Hugging Face Llama weights in and out (`jaxpar.model.hf`), and every family's logits against transformers'
(the other families' own tests: test_hf_families.py).

The fixtures under tests/fixtures/ (hf_llama_untied: float32, untied head, 4/2 heads, llama3 rope scaling, one
file; hf_llama_tied_bf16: bfloat16, tied embeddings, 4/1 heads, rope_theta 500000, three shards with an index)
were written by transformers 5.24.0 (torch 2.13.0+cpu; versions.json beside each) with
tests/fixtures/make_hf_fixtures.py, together with LlamaForCausalLM's float32 CPU logits on tokens.npy.
That script's --check-export loads a directory jaxpar exported with transformers; here the exported tensors
are compared with the fixture's, name for name and bit for bit.
"""

import dataclasses
import json
import os
import shutil
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_helpers import FAMILY_FIXTURES, FIXTURES, TIED, UNTIED, assert_same_tensors, hf_tensors_of

from jaxpar.config.schema import ModelConfig
from jaxpar.model.hf import (
    HFConfigError,
    check_hf,
    load_hf,
    model_config_from_hf,
    save_hf,
)
from jaxpar.model.params import init_params, model_def
from jaxpar.model.rope import rope_inverse_frequencies


def jaxpar_logits(cfg: ModelConfig, params: dict, tokens: np.ndarray) -> np.ndarray:
    model = model_def(dataclasses.replace(cfg, attention="xla")).bind(jax.tree.map(jnp.asarray, params))
    return np.asarray(model(jnp.asarray(tokens), jnp.float32))


# fp32 logits against transformers', relative to the largest logit: both sides compute in fp32 with sums in other
# orders (about 3e-7 measured, on two CPUs); 1e-5 leaves room for another CPU's rounding without admitting a
# wrong model (a missing bias, norm or window moves them by 1e-2 and more: test_hf_families.py)
LOGITS_RTOL = 1e-5


@pytest.mark.parametrize("fixture", [UNTIED, TIED, *FAMILY_FIXTURES.values()], ids=os.path.basename)
def test_logits_equal_transformers(fixture):
    """The imported model's float32 logits equal transformers' (5.24.0; its class of the family) within
    LOGITS_RTOL of the largest logit."""
    assert json.load(open(os.path.join(fixture, "versions.json")))["transformers"] == "5.24.0"
    hf = load_hf(fixture)
    got = jaxpar_logits(hf.cfg, hf.params, np.load(os.path.join(fixture, "tokens.npy")))
    want = np.load(os.path.join(fixture, "logits.npy"))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_RTOL * np.abs(want).max())
    assert np.abs(want).max() > 3  # logits of some size: a near-zero model would pass anything


def test_imported_configs():
    untied, tied = load_hf(UNTIED), load_hf(TIED)
    assert (untied.dtype, tied.dtype) == ("float32", "bfloat16")
    assert (untied.cfg.n_heads, untied.cfg.kv_heads, tied.cfg.kv_heads, untied.cfg.head_width) == (4, 2, 1, 8)
    assert (untied.cfg.tie_embeddings, tied.cfg.tie_embeddings) == (False, True)
    assert "lm_head" in untied.params and "lm_head" not in tied.params
    assert (untied.cfg.rope_scaling, untied.cfg.rope_scaling_factor, untied.cfg.rope_original_max_position) == (
        "llama3",
        8.0,
        64,
    )
    assert (tied.cfg.rope_scaling, tied.cfg.rope_theta, tied.cfg.norm_eps) == ("none", 500000.0, 1e-6)
    assert untied.params["blocks"]["attn"]["wq"].shape == (2, 32, 4, 8)  # [L, D, H, K]
    assert untied.params["blocks"]["attn"]["wo"].shape == (2, 4, 8, 32)  # [L, H, K, D]


def test_llama3_scaling_is_what_matches():
    """Without the llama3 scaling the logits differ from transformers' (so the test above checks the scaling)."""
    hf = load_hf(UNTIED)
    plain = dataclasses.replace(hf.cfg, rope_scaling="none")
    got = jaxpar_logits(plain, hf.params, np.load(os.path.join(UNTIED, "tokens.npy")))
    assert np.abs(got - np.load(os.path.join(UNTIED, "logits.npy"))).max() > 1e-2


def test_llama3_inverse_frequencies_by_hand():
    """head_dim 8, theta 10000: wavelengths 2*pi*[1, 10, 100, 1000]; original 64 positions, factors 1 and 4:
    the first (< 16) kept, the second (16..64) interpolated, the last two (> 64) divided by 8."""
    inv = rope_inverse_frequencies(8, 10000.0, "llama3", 8.0, 1.0, 4.0, 64)
    base = 10000.0 ** (-np.arange(0, 8, 2) / 8)
    smooth = (64 / (2 * np.pi / base[1]) - 1) / 3
    want = [base[0], (1 - smooth) * base[1] / 8 + smooth * base[1], base[2] / 8, base[3] / 8]
    np.testing.assert_allclose(inv, want, rtol=1e-6)
    np.testing.assert_allclose(rope_inverse_frequencies(8, 10000.0, "linear", 4.0), base / 4, rtol=1e-6)
    with pytest.raises(ValueError, match="unknown rotary scaling 'yarn'"):
        rope_inverse_frequencies(8, 10000.0, "yarn")


@pytest.mark.parametrize(
    "fixture, dtype, shard", [(UNTIED, "float32", 5 * 2**30), (TIED, "bfloat16", 20_000)], ids=["fp32", "bf16"]
)
def test_round_trip_is_bit_identical(fixture, dtype, shard, tmp_path):
    """HF -> jaxpar -> HF gives the fixture's tensors bit for bit (sharded with an index for bf16), and a config
    that reads back as the same model."""
    hf = load_hf(fixture)
    out = str(tmp_path / "out")
    files = save_hf(hf.params, hf.cfg, out, dtype=dtype, base_config=hf.hf_config, max_shard_bytes=shard)
    assert ("model.safetensors.index.json" in files) == (fixture == TIED)
    assert_same_tensors(out, fixture)
    umask = os.umask(0)
    os.umask(umask)
    modes = {f: stat.S_IMODE(os.stat(os.path.join(out, f)).st_mode) for f in os.listdir(out)}
    assert set(modes.values()) == {0o666 & ~umask}, modes  # readable as any new file is, not safetensors' 0600
    back = json.load(open(os.path.join(out, "config.json")))
    assert model_config_from_hf(back) == model_config_from_hf(hf.hf_config)
    assert back["torch_dtype"] == dtype and back["bos_token_id"] == hf.hf_config["bos_token_id"]
    with pytest.raises(HFConfigError, match="already holds"):
        save_hf(hf.params, hf.cfg, out)
    with pytest.raises(HFConfigError, match="is a file; export into a new or empty directory"):
        save_hf(hf.params, hf.cfg, os.path.join(out, "config.json"))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jaxpar_params_round_trip(tied, dtype, tmp_path):
    """jaxpar -> HF -> jaxpar returns the parameters rounded to `dtype` exactly, and HF -> jaxpar -> HF again
    the same bytes; grouped-query heads, sharded files."""
    cfg = ModelConfig(vocab_size=96, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48, tie_embeddings=tied)
    params = jax.tree.map(np.asarray, init_params(cfg, 3))
    save_hf(params, cfg, str(tmp_path / "a"), dtype=dtype, max_shard_bytes=8_000)
    assert os.path.isfile(tmp_path / "a" / "model.safetensors.index.json")
    back = load_hf(str(tmp_path / "a"))
    assert back.cfg == dataclasses.replace(cfg, head_dim=8) and back.dtype == dtype
    rounded = jax.tree.map(lambda x: np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32)), params)
    jax.tree.map(np.testing.assert_array_equal, back.params, rounded)
    save_hf(back.params, back.cfg, str(tmp_path / "b"), dtype=dtype, max_shard_bytes=8_000)
    assert_same_tensors(str(tmp_path / "a"), str(tmp_path / "b"))


def _edited_copy(tmp_path, edit) -> str:
    out = str(tmp_path / "edited")
    shutil.copytree(UNTIED, out)
    path = os.path.join(out, "config.json")
    cfg = json.load(open(path))
    edit(cfg)
    json.dump(cfg, open(path, "w"))
    return out


def test_transformers_4_config_layout_reads_alike(tmp_path):
    def to_v4(cfg):
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in rope.items()}

    assert check_hf(_edited_copy(tmp_path, to_v4)) == load_hf(UNTIED).cfg


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c["rope_parameters"].update(rope_type="yarn"), "rope scaling type 'yarn' is not supported"),
        (lambda c: c.update(model_type="gemma3_text"), "model_type='gemma3_text' is not one jaxpar converts"),
        (lambda c: c.update(attention_bias=True), "attention_bias=True is not supported"),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        (lambda c: c.pop("hidden_size"), "config.json lacks 'hidden_size'"),
        (lambda c: c.update(intermediate_size=65), r"mlp.gate_proj.weight has shape \(64, 32\), config.json implies"),
        (lambda c: c.update(num_hidden_layers=3), r"missing: \['model.layers.2.input_layernorm.weight'"),
        (lambda c: c.update(num_hidden_layers=1), r"unexpected: \['model.layers.1.input_layernorm.weight'"),
    ],
    ids=["rope_type", "model_type", "bias", "activation", "missing_key", "shape", "missing", "unexpected"],
)
def test_unsupported_or_inconsistent_directories_are_refused(tmp_path, edit, message):
    with pytest.raises(HFConfigError, match=message):
        load_hf(_edited_copy(tmp_path, edit))


def test_missing_files_and_differing_model_are_named(tmp_path):
    with pytest.raises(HFConfigError, match="has no config.json"):
        load_hf(str(tmp_path))
    os.makedirs(tmp_path / "x")
    shutil.copy(os.path.join(UNTIED, "config.json"), tmp_path / "x")
    with pytest.raises(HFConfigError, match="holds neither model.safetensors nor model.safetensors.index.json"):
        load_hf(str(tmp_path / "x"))
    want = dataclasses.replace(load_hf(UNTIED).cfg, d_model=64, rope_theta=500000.0)
    with pytest.raises(
        HFConfigError, match=r"model.d_model: config 64, Hugging Face directory 32; model.rope_theta: config 500000"
    ):
        check_hf(UNTIED, want)


# config.json of meta-llama/Llama-3.2-1B and meta-llama/Meta-Llama-3-8B as published (keys jaxpar reads)
LLAMA3_2_1B = {
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "vocab_size": 128256,
}
LLAMA3_8B = {
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}


@pytest.mark.parametrize("name, published", [("llama3_2_1b", LLAMA3_2_1B), ("llama3_8b", LLAMA3_8B)])
def test_llama3_configs_are_the_published_models(name, published):
    """configs/llama3_*.yaml hold exactly the model of the published config.json (what model.init_from checks)."""
    from jaxpar.config import load_config
    from jaxpar.model.hf.config import model_differences

    root = os.path.dirname(os.path.dirname(FIXTURES))
    cfg = load_config(os.path.join(root, "configs", f"{name}.yaml"), num_devices=8)
    assert model_differences(cfg.model, model_config_from_hf(published)) == []
    assert cfg.data.token_dtype == "uint32"


def test_rotary_buffers_and_a_stored_tied_head_are_skipped(tmp_path):
    """Old exports hold rotary_emb.inv_freq buffers, and some tied ones store lm_head.weight too: both are read
    past (the tied model uses its embedding)."""
    from safetensors.numpy import save_file

    for fixture, extra in ((UNTIED, "model.layers.1.self_attn.rotary_emb.inv_freq"), (TIED, "lm_head.weight")):
        out = tmp_path / os.path.basename(fixture)
        os.makedirs(out)
        shutil.copy(os.path.join(fixture, "config.json"), out)
        tensors = hf_tensors_of(fixture)
        tensors[extra] = tensors["model.embed_tokens.weight"] if extra == "lm_head.weight" else np.ones(4, np.float32)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        jax.tree.map(np.testing.assert_array_equal, load_hf(str(out)).params, load_hf(fixture).params)


@pytest.mark.parametrize("name, total", [("llama3_2_1b", 1_235_814_400), ("llama3_8b", 8_030_261_248)])
def test_jaxpar_plan_takes_the_llama3_configs(name, total):
    """The planner (what jaxpar-plan prints) counts the published models' parameters: Llama 3.2 1B 1.24B (tied),
    Llama 3 8B 8.03B."""
    from jaxpar.analysis.planner.plan import plan
    from jaxpar.config import load_config, resolve_config

    root = os.path.dirname(os.path.dirname(FIXTURES))
    p = plan(resolve_config(load_config(os.path.join(root, "configs", f"{name}.yaml"), num_devices=8), 8))
    assert p["params"]["total"] == total
