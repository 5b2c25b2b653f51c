"""DeepSeek-V3 in and out of Hugging Face format (`jaxpar.model.hf`): model_type deepseek_v3 <-> a jaxpar llama
with Multi-head Latent Attention (`jaxpar.model.mla`), dense first blocks and sigmoid-gated, grouped, scaled
routing with a balancing bias and a shared expert (`jaxpar.model.moe`).

Fixture tests/fixtures/hf_deepseek_v3, written by transformers 5.25.0 with torch 2.13.0+cpu through
tests/fixtures/make_hf_deepseek_fixture.py (every tensor random, norm scales and the routing bias included): float32,
untied, vocabulary 256, width 64, 4 layers (2 dense, then 2 MoE), 4 heads, q_lora_rank 32, kv_lora_rank 16,
qk_nope_head_dim 16, qk_rope_head_dim 8, v_head_dim 16, rotary columns interleaved (rope_interleave true), 8 experts
of width 32 in 2 groups (1 chosen), top-2, 1 shared expert, routed_scaling_factor 2.5, one file; with
DeepseekV3ForCausalLM's float32 CPU logits on tokens.npy.
"""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_helpers import FIXTURES, assert_same_tensors, hf_tensors_of
from safetensors.numpy import save_file

from jaxpar.config import load_config
from jaxpar.config.schema import ModelConfig, MoEConfig
from jaxpar.model.hf import HFConfigError, check_hf, load_hf, save_hf
from jaxpar.model.hf.config import hf_config_from_model, model_config_from_hf, model_differences
from jaxpar.model.hf.gather import export_shardings, save_hf_gathered
from jaxpar.model.hf.lazy import HFSliceReader
from jaxpar.model.hf.place import place_hf_params
from jaxpar.model.hf.weights import rotary_order
from jaxpar.model.params import init_params, model_def
from jaxpar.parallel.mesh import build_mesh, process_mesh
from jaxpar.training.plan import build_plan
from jaxpar.training.state import abstract_params

DEEPSEEK = os.path.join(FIXTURES, "hf_deepseek_v3")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# fp32 logits against transformers', relative to the largest logit: test_hf.py's LOGITS_RTOL, for its reason (both
# sides compute in fp32 with sums in other orders; measured 9.4e-7 here, 4.1e-6 absolute of a largest logit of 4.3).
# A wrong model misses by far more: without the rotary reordering by 0.73 of it, without the routing bias by 0.66.
LOGITS_RTOL = 1e-5


def _logits(cfg, params) -> np.ndarray:
    model = model_def(dataclasses.replace(cfg, attention="xla")).bind(jax.tree.map(jnp.asarray, params))
    return np.asarray(model(jnp.asarray(np.load(os.path.join(DEEPSEEK, "tokens.npy"))), jnp.float32))


def _edited(tmp_path, edit, name="edited") -> str:
    out = str(tmp_path / name)
    shutil.copytree(DEEPSEEK, out)
    path = os.path.join(out, "config.json")
    cfg = json.load(open(path))
    edit(cfg)
    json.dump(cfg, open(path, "w"))
    return out


@pytest.fixture(scope="module")
def imported():
    return load_hf(DEEPSEEK)


def test_logits_equal_transformers(imported):
    """The imported model's float32 logits equal DeepseekV3ForCausalLM's (transformers 5.25.0) within LOGITS_RTOL of
    the largest logit."""
    assert json.load(open(os.path.join(DEEPSEEK, "versions.json")))["transformers"] == "5.25.0"
    want = np.load(os.path.join(DEEPSEEK, "logits.npy"))
    got = _logits(imported.cfg, imported.params)
    assert got.shape == want.shape == (2, 16, 256)
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_RTOL * np.abs(want).max())
    assert np.abs(want).max() > 3  # logits of some size: a near-zero model would pass anything


def test_the_rotary_reordering_and_the_bias_are_what_match(imported, tmp_path):
    """Read as rotate-half (rope_interleave false on the same files: no reordering), or with the routing bias zeroed,
    the logits miss transformers' by far more than LOGITS_RTOL: the test above checks both."""
    want = np.load(os.path.join(DEEPSEEK, "logits.npy"))
    plain = load_hf(_edited(tmp_path, lambda c: c.update(rope_interleave=False)))
    assert plain.cfg == imported.cfg
    assert np.abs(_logits(plain.cfg, plain.params) - want).max() > 1e-1 * np.abs(want).max()
    unbiased = jax.tree.map(np.copy, imported.params)
    bias = unbiased["blocks"]["moe"]["mlp"]["router_bias"]
    assert bias.shape == (2, 8) and np.all(bias != 0)
    bias[...] = 0
    assert np.abs(_logits(imported.cfg, unbiased) - want).max() > 1e-1 * np.abs(want).max()


def test_imported_config_and_layout(imported):
    c, m = imported.cfg, imported.cfg.moe
    assert (c.name, c.n_layers, c.d_model, c.n_heads, c.d_ff, c.norm_eps) == ("llama", 4, 64, 4, 96, 1e-6)
    assert c.n_kv_heads is None and c.head_dim is None and not c.tie_embeddings
    assert (c.q_lora_rank, c.kv_lora_rank, c.mla_widths) == (32, 16, (16, 8, 16))
    assert (m.num_experts, m.top_k, m.d_expert, m.shared_experts, m.every, m.first_dense) == (8, 2, 32, 1, 1, 2)
    assert (m.gating, m.routed_scale, m.expert_groups, m.group_top_k, m.z_loss_weight) == ("sigmoid", 2.5, 2, 1, 0.0)
    assert c.first_dense == 2 and c.stack_depth == 2 and imported.dtype == "float32"
    p = imported.params
    assert sorted(p) == ["blocks", "embed", "final_norm", "first_dense_0", "first_dense_1", "lm_head"]
    assert p["first_dense_0"]["attn"]["wq_b"].shape == (32, 4, 24)  # [X, H, P + R], unstacked
    assert p["first_dense_1"]["mlp"]["w_gate"].shape == (64, 96)
    moe = p["blocks"]["moe"]
    assert moe["attn"]["wkv_a"].shape == (2, 64, 24) and moe["attn"]["wo"].shape == (2, 4, 16, 64)
    assert moe["mlp"]["w_gate"].shape == (2, 8, 64, 32) and moe["mlp"]["shared"]["w_down"].shape == (2, 32, 64)
    files = hf_tensors_of(DEEPSEEK)
    np.testing.assert_array_equal(
        moe["mlp"]["router_bias"][1], files["model.layers.3.mlp.gate.e_score_correction_bias"]
    )
    # the rotary columns: jaxpar's element i of the rotary part is the stored 2i, its i + R/2 the stored 2i + 1
    stored = files["model.layers.0.self_attn.q_b_proj.weight"].reshape(4, 24, 32)  # [H, P + R, X]
    np.testing.assert_array_equal(p["first_dense_0"]["attn"]["wq_b"][:, 2, 16 + 1], stored[2, 16 + 2])
    np.testing.assert_array_equal(p["first_dense_0"]["attn"]["wq_b"][:, 2, 16 + 4 + 1], stored[2, 16 + 3])
    kv_a = files["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"]  # [Z + R, D]
    np.testing.assert_array_equal(moe["attn"]["wkv_a"][0][:, 16:], kv_a[16 + rotary_order(8)].T)
    np.testing.assert_array_equal(rotary_order(8), [0, 2, 4, 6, 1, 3, 5, 7])


def test_round_trip_is_bit_identical(imported, tmp_path):
    """HF -> jaxpar -> HF gives the fixture's tensors bit for bit (the rotary columns interleaved again), and a
    config.json that reads back as the same model."""
    out = str(tmp_path / "out")
    save_hf(imported.params, imported.cfg, out, base_config=imported.hf_config)
    assert_same_tensors(out, DEEPSEEK)
    back = json.load(open(os.path.join(out, "config.json")))
    assert back["architectures"] == ["DeepseekV3ForCausalLM"] and back["model_type"] == "deepseek_v3"
    assert (back["rope_interleave"], back["num_nextn_predict_layers"], back["norm_topk_prob"]) == (True, 0, True)
    assert model_config_from_hf(back) == imported.cfg
    published = json.load(open(os.path.join(DEEPSEEK, "config.json")))
    for key in ("first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor", "moe_intermediate_size"):
        assert back[key] == published[key], key


def test_rotate_half_files_export_interleaved(imported, tmp_path):
    """A directory stored rotate-half (rope_interleave false) reads as such, and exports interleaved: the export
    reads back as the same parameters."""
    edited = _edited(tmp_path, lambda c: c.update(rope_interleave=False))
    plain = load_hf(edited)
    save_hf(plain.params, plain.cfg, str(tmp_path / "out"), base_config=plain.hf_config)
    exported = hf_tensors_of(str(tmp_path / "out"))
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    assert not np.array_equal(exported[name], hf_tensors_of(edited)[name])
    jax.tree.map(np.testing.assert_array_equal, load_hf(str(tmp_path / "out")).params, plain.params)


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(  # no query latent, tied, 3 groups of 2 experts of which 2 chosen, 2 shared experts, bf16 files
            vocab_size=64,
            d_model=32,
            n_layers=3,
            n_heads=2,
            d_ff=40,
            norm_eps=1e-6,
            tie_embeddings=True,
            kv_lora_rank=8,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=12,
            moe=MoEConfig(
                num_experts=6,
                top_k=3,
                d_expert=16,
                shared_experts=2,
                first_dense=1,
                gating="sigmoid",
                routed_scale=1.5,
                expert_groups=3,
                group_top_k=2,
            ),
        ),
        ModelConfig(  # dense: every block MLA with a SwiGLU MLP
            vocab_size=64,
            d_model=32,
            n_layers=2,
            n_heads=2,
            d_ff=40,
            norm_eps=1e-6,
            q_lora_rank=16,
            kv_lora_rank=8,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
        ),
    ],
    ids=["moe_no_q_latent", "dense"],
)
def test_jaxpar_params_round_trip(cfg, tmp_path):
    """jaxpar -> HF -> jaxpar returns the parameters (rounded to bf16 for the bf16 export, but the router's weight
    and bias, which transformers keeps in float32) and the model; HF -> jaxpar -> HF again the same bytes."""
    dtype = "bfloat16" if cfg.moe.enabled else "float32"
    rng = np.random.default_rng(3)  # random values of the model's shapes (the bias nonzero), without compiling
    shapes = jax.eval_shape(lambda: init_params(cfg, 0))
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)
    save_hf(params, cfg, str(tmp_path / "a"), dtype=dtype, max_shard_bytes=20_000)
    back = load_hf(str(tmp_path / "a"))
    z_loss = 0.0 if cfg.moe.enabled else cfg.moe.z_loss_weight  # sigmoid gates have no z-loss: an import sets 0
    assert back.cfg == dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, z_loss_weight=z_loss))
    assert back.dtype == dtype and model_differences(cfg, back.cfg) == []
    written = json.load(open(tmp_path / "a" / "config.json"))
    assert written["first_k_dense_replace"] == (1 if cfg.moe.enabled else 2)
    rounded = jax.tree.map(lambda x: np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32)), params)
    if cfg.moe.enabled:
        for key in ("router", "router_bias"):
            rounded["blocks"]["moe"]["mlp"][key] = params["blocks"]["moe"]["mlp"][key]
        stored = {k: v.dtype.name for k, v in hf_tensors_of(str(tmp_path / "a")).items() if ".1." in k}
        assert stored["model.layers.1.mlp.gate.e_score_correction_bias"] == "float32"
        assert stored["model.layers.1.mlp.gate.weight"] == "float32"
        assert set(stored.values()) == {"float32", "bfloat16"}
    jax.tree.map(np.testing.assert_array_equal, back.params, rounded)
    save_hf(back.params, back.cfg, str(tmp_path / "b"), dtype=dtype, max_shard_bytes=20_000)
    assert_same_tensors(str(tmp_path / "a"), str(tmp_path / "b"))


def test_sliced_paths_are_the_host_paths(imported, devices8, tmp_path):
    """By the slice (`HFSliceReader` onto data x fsdp x tensor at ZeRO-1; `save_hf_gathered` from a process mesh)
    the parameters are the eager load's bit for bit and the export the fixture's tensors (in bf16, `save_hf`'s)."""
    model = check_hf(DEEPSEEK)
    overrides = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "optimizer.zero_stage=1", "train.global_batch_size=8"]
    overrides.append("data.source=synthetic")  # the byte tokenizer of the default source needs 259 ids, not 256
    cfg = load_config({"model": dataclasses.asdict(model)}, overrides, num_devices=8)
    target = abstract_params(build_plan(cfg, build_mesh(cfg, jax.devices()[:8])))
    with HFSliceReader(DEEPSEEK, model) as reader:
        params = place_hf_params(reader, target)
        assert reader.bytes_read == reader.total_bytes
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, got), want in zip(flat, jax.tree.leaves(imported.params)):
        assert np.asarray(got).tobytes() == want.tobytes(), path
    mesh = process_mesh()
    sharded = jax.device_put(imported.params, export_shardings(model, mesh))
    save_hf_gathered(sharded, model, str(tmp_path / "out"), mesh, base_config=imported.hf_config)
    assert_same_tensors(str(tmp_path / "out"), DEEPSEEK)
    save_hf_gathered(sharded, model, str(tmp_path / "bf16"), mesh, dtype="bfloat16")  # the router in float32
    save_hf(imported.params, model, str(tmp_path / "bf16_host"), dtype="bfloat16")
    assert_same_tensors(str(tmp_path / "bf16"), str(tmp_path / "bf16_host"))


def test_multi_token_prediction_layers_are_not_read(imported, tmp_path):
    """The layers after the last (DeepSeek's multi-token prediction, model.layers.L...) are skipped; fp8-quantised
    weights (their weight_scale_inv tensors) are refused naming them."""
    out = str(tmp_path / "mtp")
    shutil.copytree(DEEPSEEK, out)
    extra = {"model.layers.4.eh_proj.weight": np.ones((64, 128), np.float32)}
    save_file(extra, os.path.join(out, "mtp.safetensors"))
    weight_map = {name: "model.safetensors" for name in hf_tensors_of(DEEPSEEK)} | {n: "mtp.safetensors" for n in extra}
    json.dump({"weight_map": weight_map}, open(os.path.join(out, "model.safetensors.index.json"), "w"))
    jax.tree.map(np.testing.assert_array_equal, load_hf(out).params, imported.params)
    save_file(
        {"model.layers.0.self_attn.o_proj.weight_scale_inv": np.ones((1, 1), np.float32)},
        os.path.join(out, "mtp.safetensors"),
    )
    json.dump(
        {"weight_map": {**weight_map, "model.layers.0.self_attn.o_proj.weight_scale_inv": "mtp.safetensors"}},
        open(os.path.join(out, "model.safetensors.index.json"), "w"),
    )
    with pytest.raises(HFConfigError, match="o_proj.weight_scale_inv and 0 more: fp8 block-quantised weights"):
        load_hf(out)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c["rope_parameters"].update(rope_type="yarn", factor=40.0), "rope scaling type 'yarn' is not"),
        (lambda c: c.update(norm_topk_prob=False), "norm_topk_prob=False: jaxpar's sigmoid gating"),
        (lambda c: c.update(rms_norm_eps=1e-5), "rms_norm_eps=1e-05: transformers' DeepseekV3 normalises"),
        (lambda c: c.update(attention_bias=True), "attention_bias=True is not supported"),
        (lambda c: c.update(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
        (lambda c: c.update(n_shared_experts=0), "n_shared_experts=0"),
        (lambda c: c.update(num_key_value_heads=2), "num_key_value_heads=2 differs from num_attention_heads=4"),
        (lambda c: c.update(quantization_config={"quant_method": "fp8"}), "quant_method 'fp8'"),
        (lambda c: c.pop("kv_lora_rank"), "config.json lacks 'kv_lora_rank'"),
        (lambda c: c.update(first_k_dense_replace=1), r"missing: \['model.layers.1.mlp.experts.0.down_proj.weight'"),
    ],
    ids=["yarn", "norm_topk", "eps", "bias", "scoring", "shared", "kv_heads", "fp8", "missing_key", "tensors"],
)
def test_what_jaxpar_does_not_compute_is_refused(tmp_path, edit, message):
    with pytest.raises(HFConfigError, match=message):
        load_hf(_edited(tmp_path, edit))


def test_exports_deepseek_cannot_express_are_refused(imported):
    cfg = imported.cfg
    for change, message in [
        (dict(norm_eps=1e-5), "model.norm_eps=1e-05"),
        (dict(sliding_window=8), "model.sliding_window=8"),
        (dict(moe=dataclasses.replace(cfg.moe, gating="softmax")), "model.moe.gating=softmax"),
        (dict(moe=dataclasses.replace(cfg.moe, shared_experts=0)), "model.moe.shared_experts=0"),
        (dict(name="qwen3"), "model.name=qwen3"),
    ]:
        with pytest.raises(HFConfigError, match=f"transformers' DeepseekV3 .* cannot express {message}"):
            hf_config_from_model(dataclasses.replace(cfg, **change), "float32")
    mixtral = dataclasses.replace(cfg, name="mixtral", kv_lora_rank=None, q_lora_rank=None)
    with pytest.raises(HFConfigError, match="Mixtral cannot express .* exports as deepseek_v3"):
        hf_config_from_model(mixtral, "float32")


# config.json of deepseek-ai/DeepSeek-V3 as published (the keys jaxpar reads, and DeepSeek's own routing keys)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_the_shipped_config_is_deepseek_v3_without_yarn():
    """configs/deepseek_v3.yaml is the published model but for YaRN (its 128K extension), which is refused; without
    it the two are the same model, and the config exports as the published one."""
    with pytest.raises(HFConfigError, match="rope scaling type 'yarn' is not supported: YaRN"):
        model_config_from_hf(DEEPSEEK_V3)
    published = model_config_from_hf({**DEEPSEEK_V3, "rope_scaling": None})
    shipped = load_config(os.path.join(ROOT, "configs", "deepseek_v3.yaml"), validate=False).model
    assert model_differences(shipped, published) == []
    hf = hf_config_from_model(shipped, "bfloat16")
    for key, value in DEEPSEEK_V3.items():
        if key not in (
            "rope_scaling",
            "max_position_embeddings",
            "num_nextn_predict_layers",
            "moe_layer_freq",
            "scoring_func",
            "topk_method",
        ):
            assert hf[key] == value, key
