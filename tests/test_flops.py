"""FLOPs formulas, parameter counts, peak lookup and MFU arithmetic, checked against hand-computed numbers."""
import jax
import jax.numpy as jnp
import pytest

from jaxpar import flops
from jaxpar.model import param_count


def test_flops_per_token_by_hand():
    # N=1000, L=2, h=16, s=32: 6*1000 + 12*2*16*32 = 6000 + 12288
    assert flops.flops_per_token(1000, 2, 16, 32) == 18288.0


def test_hardware_flops_adds_one_forward():
    # 8*1000 + 16*2*16*32 = 8000 + 16384; exactly 4/3 of the model FLOPs
    hw = flops.hardware_flops_per_token(1000, 2, 16, 32)
    assert hw == 24384.0
    assert hw == pytest.approx(flops.flops_per_token(1000, 2, 16, 32) * 4 / 3)
    assert flops.hardware_flops_per_token(1000, 2, 16, 32, remat=False) == 18288.0


def test_param_counts_exclude_top_level_embeddings():
    params = {
        "embed": {"table": jnp.zeros((10, 4))},                      # 40
        "layers": {"w": jnp.zeros((4, 8)), "b": jnp.zeros((8,))},  # 40
        "norm": {"scale": jax.ShapeDtypeStruct((4,), jnp.float32)},  # 4
        "lm_head": {"w": jnp.zeros((4, 10))},                        # 40
    }
    assert param_count(params) == 124
    assert flops.count_non_embedding_params(params) == 44
    assert flops.count_non_embedding_params(params, embedding_keys=("embed",)) == 84
    with pytest.raises(TypeError):
        flops.count_non_embedding_params([jnp.zeros(3)])


@pytest.mark.parametrize("kind, peak", [
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
])
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
