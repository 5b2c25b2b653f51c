"""FLOPs formulas, parameter counts, peak lookup and MFU arithmetic, checked against hand-computed numbers."""

import os

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxpar.config import load_config
from jaxpar.model import flops
from jaxpar.model.flops import param_count
from jaxpar.model.llama import Llama, recompute_flops_per_token

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_flops_per_token_by_hand():
    # N=1000, L=2, h=16, s=32: 6*1000 + 12*2*16*32 = 6000 + 12288
    assert flops.flops_per_token(1000, 2, 16, 32) == 18288.0


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "dots", "names", "full"])
def test_recompute_flops_match_xla_cost_analysis(policy):
    """The extra FLOPs a remat policy costs equal XLA's count for the compiled gradient, within 1%.

    Two layers: XLA's cost analysis counts a while loop's body once, so the difference against `none` is one
    layer's recompute (with one layer the scan is inlined and CSE merges the recompute away).
    """
    b, t = 2, 64

    def grad_flops(remat):
        cfg = load_config(
            os.path.join(ROOT, "configs", "tiny.yaml"),
            [
                "model.n_layers=2",
                f"model.remat={remat}",
                "model.d_model=256",
                "model.d_ff=1024",
                "model.n_heads=4",
                "model.n_kv_heads=2",
                "mesh.data=1",
                "mesh.tensor=1",
            ],
        ).model
        graphdef, state = nnx.split(Llama(cfg, nnx.Rngs(0)))

        def loss(state, x):
            return jnp.sum(nnx.merge(graphdef, state).run_blocks(x) ** 2)

        analysis = jax.jit(jax.grad(loss)).lower(state, jnp.ones((b, t, cfg.d_model))).compile().cost_analysis()
        return (analysis[0] if isinstance(analysis, list) else analysis)["flops"], cfg

    base, _ = grad_flops("none")
    measured, cfg = grad_flops(policy)
    per_layer = recompute_flops_per_token(cfg, t) / cfg.n_layers
    assert (measured - base) / (b * t) == pytest.approx(per_layer, rel=0.01, abs=1000)
    if policy == "full":  # a real recompute, a large share of the forward
        assert per_layer > 1e6
    recomputed = recompute_flops_per_token(cfg, t)  # 1F1B's stage recompute adds a third of the model FLOPs
    assert flops.hardware_flops_per_token(90.0, recomputed, stage_recompute=True) == 90.0 + 30.0 + recomputed


def test_param_counts_exclude_top_level_embeddings():
    params = {
        "embed": {"table": jnp.zeros((10, 4))},  # 40
        "layers": {"w": jnp.zeros((4, 8)), "b": jnp.zeros((8,))},  # 40
        "norm": {"scale": jax.ShapeDtypeStruct((4,), jnp.float32)},  # 4
        "lm_head": {"w": jnp.zeros((4, 10))},  # 40
    }
    assert param_count(params) == 124
    assert flops.count_non_embedding_params(params) == 44
    assert flops.count_non_embedding_params(params, embedding_keys=("embed",)) == 84
    with pytest.raises(TypeError):
        flops.count_non_embedding_params([jnp.zeros(3)])


@pytest.mark.parametrize(
    "kind, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-40GB", 312e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("TPU v4", 275e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5p", 459e12),
        ("TPU v6 lite", 918e12),
        ("cpu", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_lookup(kind, peak):
    assert flops.peak_flops(kind) == peak


def test_override_wins_and_zero_means_table():
    assert flops.peak_flops("cpu", override=1e12) == 1e12
    assert flops.peak_flops("NVIDIA H100 80GB HBM3", override=5e14) == 5e14
    assert flops.peak_flops("NVIDIA H100 80GB HBM3", override=0.0) == 989e12


def test_mfu_arithmetic():
    # 1e4 tok/s * 6e10 FLOP/tok = 6e14 FLOP/s over 2 devices of 1e15 -> 0.3
    assert flops.mfu(1e4, 6e10, 2, 1e15) == pytest.approx(0.3)
    assert flops.mfu(1e4, 6e10, 2, None) is None


@pytest.mark.parametrize(
    "overrides,recomputes",
    [
        (["mesh.pipeline=2", "pipeline.schedule=1f1b", "pipeline.recompute=false"], False),
        (["mesh.pipeline=2", "pipeline.schedule=1f1b", "pipeline.recompute=true"], True),
        (["mesh.pipeline=2", "pipeline.schedule=gpipe", "pipeline.recompute=true"], False),
        (["mesh.pipeline=1", "pipeline.schedule=1f1b", "pipeline.recompute=true"], False),
    ],
)
def test_hfu_equals_mfu_without_remat_and_stage_recompute(overrides, recomputes):
    """The 1F1B stage recompute counts in hardware FLOPs only when pipeline.recompute is on: with remat none and
    residuals kept, hardware FLOPs are the model FLOPs (hfu == mfu)."""
    mesh = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]
    cfg = load_config("configs/tiny.yaml", [*mesh, "model.remat=none", *overrides], validate=False)
    assert flops.stage_recompute(cfg) is recomputes
    model = flops.flops_per_token(1000, cfg.model.n_layers, cfg.model.d_model, cfg.data.seq_len)
    recomputed = recompute_flops_per_token(cfg.model, cfg.data.seq_len)
    assert recomputed == 0.0
    hardware = flops.hardware_flops_per_token(model, recomputed, stage_recompute=flops.stage_recompute(cfg))
    assert hardware == (model * 4 / 3 if recomputes else model)


def test_a_sliding_window_caps_the_attention_span():
    """With model.sliding_window W < T both counts take min(T, W) keys per query for T; at W >= T nothing changes."""
    mesh = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "model.remat=full", "data.seq_len=64"]
    plain = load_config("configs/tiny.yaml", mesh, validate=False)
    windowed = load_config("configs/tiny.yaml", [*mesh, "model.sliding_window=16"], validate=False)
    params = {"blocks": {"w": jax.ShapeDtypeStruct((1000,), jnp.float32)}}
    m = plain.model
    assert flops.model_flops(windowed, params) == (
        flops.flops_per_token(1000, m.n_layers, m.d_model, 16),
        flops.flops_per_token(1000, m.n_layers, m.d_model, 16) + recompute_flops_per_token(m, 16),
    )
    long = load_config("configs/tiny.yaml", [*mesh, "model.sliding_window=64"], validate=False)
    assert flops.model_flops(long, params) == flops.model_flops(plain, params)


def test_gemma2_windows_half_its_layers():
    """gemma2's local layers (every other one) alone see model.sliding_window keys: the mean span is (T + W) / 2."""
    from jaxpar.config.schema import ModelConfig

    assert flops.attention_span(ModelConfig(name="gemma2", sliding_window=16), 64) == 40.0
    assert flops.attention_span(ModelConfig(name="mistral", sliding_window=16), 64) == 16.0
    assert flops.attention_span(ModelConfig(name="gemma2"), 64) == 64.0
