"""FP8 GEMMs (`jaxpar.parallel.fp8`): each GEMM within the bound E4M3's and E5M2's rounding gives, the scales'
edge cases, and the model's projections really in FP8 (the head not).

The per-GEMM bound. Per-tensor scaling maps X's largest magnitude onto the format's largest value, so X / s never
overflows, and rounding X / s to FP8 errs by at most u |X / s| in the normal range plus half the subnormal spacing
below it: |X^ - X| <= u |X| + a s, with (u, a) = (2^-4, 2^-10) for E4M3 (3 mantissa bits, subnormal spacing
2^-9) and (2^-3, 2^-17) for E5M2 (2 mantissa bits, subnormal spacing 2^-16). A GEMM of two quantised operands then
errs, per output element, by at most

    |A^ B^ - A B| <= sum_k |A^_k - A_k| |B^_k| + |A_k| |B^_k - B_k|
                  <= (u_A |A| + a_A s_A) @ ((1 + u_B) |B| + a_B s_B) + |A| @ (u_B |B| + a_B s_B)

plus the fp32 accumulation (K 2^-24 sum |A^ B^|) and two roundings of the result to its dtype (the GEMM's own
and after the scales' product). The forward y = x w has u = 2^-4 on both sides; the backward dx = g w^T and
dw = x^T g have E5M2's 2^-3 on the gradient's side. A bf16 GEMM of the same inputs errs by the fp32 accumulation
and one rounding to bf16 (2^-9 |y|): FP8 and bf16 agree within the sum of their bounds.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.parallel.fp8 import (
    BACKWARD_FORMAT,
    FORWARD_FORMAT,
    NO_FP8,
    Fp8,
    cpu_fp8_error,
    fp8_max,
    history_scales,
    layer_scales,
    quantize,
    scale_from_amax,
    updated_history,
)

# XLA:CPU at --xla_cpu_max_isa=SSE4_2 with the suite's fast code generation cannot link E5M2's conversions
pytestmark = pytest.mark.skipif(
    cpu_fp8_error() is not None, reason=f"XLA:CPU cannot compile FP8 here: {cpu_fp8_error()}"
)

E4M3 = (2.0**-4, 2.0**-10)  # (relative rounding u, absolute subnormal rounding a / s)
E5M2 = (2.0**-3, 2.0**-17)
U32 = 2.0**-24
U16 = 2.0**-9  # bf16


def _bound(a, a_fmt, b, b_fmt, out_u):
    """The elementwise bound of the module docstring for the FP8 GEMM a @ b (float64 numpy [N, K], [K, M])."""
    (ua, aa), (ub, ab) = a_fmt, b_fmt
    sa = np.max(np.abs(a)) / fp8_max(FORWARD_FORMAT if a_fmt == E4M3 else BACKWARD_FORMAT)
    sb = np.max(np.abs(b)) / fp8_max(FORWARD_FORMAT if b_fmt == E4M3 else BACKWARD_FORMAT)
    quant = (ua * np.abs(a) + aa * sa) @ ((1 + ub) * np.abs(b) + ab * sb) + np.abs(a) @ (ub * np.abs(b) + ab * sb)
    magnitude = np.abs(a) @ np.abs(b) + quant
    return quant + a.shape[1] * U32 * magnitude + 2 * out_u * magnitude


def _heavy_tailed(key, shape, scale):
    """Normal values with a few outliers 30x larger, in bf16 (the amax then sits well above most values)."""
    k1, k2 = jax.random.split(key)
    x = jax.random.normal(k1, shape) * jnp.where(jax.random.uniform(k2, shape) < 0.01, 30.0, 1.0)
    return (scale * x).astype(jnp.bfloat16)


def test_fp8_gemm_and_its_gradients_are_within_the_quantisation_bound_of_bf16():
    k = jax.random.split(jax.random.key(0), 3)
    x = _heavy_tailed(k[0], (64, 128), 1.0)
    w = (0.02 * jax.random.normal(k[1], (128, 96))).astype(jnp.float32)
    g = _heavy_tailed(k[2], (64, 96), 1e-3)
    fp8 = Fp8(active=True)
    y8, vjp8 = jax.vjp(lambda x, w: fp8.matmul(x, w, "column", False), x, w)
    dx8, dw8 = vjp8(g)
    y16, vjp16 = jax.vjp(lambda x, w: x @ w.astype(jnp.bfloat16), x, w)
    dx16, dw16 = vjp16(g)
    assert y8.dtype == dx8.dtype == jnp.bfloat16 and dw8.dtype == jnp.float32

    x64, w64, g64 = (np.asarray(v, np.float64) for v in (x, w, g))
    w16 = np.asarray(w.astype(jnp.bfloat16), np.float64)  # what the bf16 GEMM multiplies
    cases = {
        "y = x w": (y8, y16, x64 @ w16, _bound(x64, E4M3, w64, E4M3, U16), x64, w16),
        "dx = g w^T": (dx8, dx16, g64 @ w16.T, _bound(g64, E5M2, w64.T, E4M3, U16), g64, w16.T),
        "dw = x^T g": (dw8, dw16, x64.T @ g64, _bound(x64.T, E4M3, g64, E5M2, U32), x64.T, g64),
    }
    for name, (got8, got16, exact, bound, a, b) in cases.items():
        err8 = np.abs(np.asarray(got8, np.float64) - exact)
        assert np.all(err8 <= bound), f"{name}: FP8 error {np.max(err8 / bound):.3g}x its bound"
        # the bound is not vacuous: FP8's rounding shows (a tenth of the bound is reached somewhere)
        assert np.max(err8 / bound) > 0.1, f"{name}: FP8 error {np.max(err8 / bound):.3g} of its bound"
        magnitude = np.abs(a) @ np.abs(b)
        bound16 = a.shape[1] * U32 * magnitude + U16 * magnitude
        gap = np.abs(np.asarray(got8, np.float64) - np.asarray(got16, np.float64))
        assert np.all(gap <= bound + bound16), f"{name}: FP8 against bf16 {np.max(gap / (bound + bound16)):.3g}x"


def test_scales_of_zero_inf_and_nan_tensors():
    # amax 0: scale 1, and every element quantises to 0 (not NaN)
    assert float(scale_from_amax(jnp.float32(0.0), FORWARD_FORMAT)) == 1.0
    zeros = jnp.zeros((4, 8), jnp.float32)
    assert np.all(np.asarray(Fp8(active=True).matmul(zeros, jnp.ones((8, 2)), "column", False)) == 0)
    # amax inf or NaN: the scale is not finite, so the step's loss is not and the update is skipped
    for bad in (jnp.inf, jnp.nan):
        assert not np.isfinite(float(scale_from_amax(jnp.float32(bad), BACKWARD_FORMAT)))
    # the largest magnitude lands on the format's largest value; margin 1 leaves a factor 2 of headroom
    x = jnp.array([1.0, -3.5, 0.25], jnp.float32)
    for margin, top in ((0, 448.0), (1, 224.0)):
        q = quantize(x, scale_from_amax(jnp.max(jnp.abs(x)), FORWARD_FORMAT, margin), FORWARD_FORMAT)
        assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == top


def test_delayed_scaling_history_and_scales():
    """The history takes each step's amaxes in front and drops the oldest, except an inf or NaN amax (its operand's
    history stays); the scales come from the window's max or its newest entry, 0 (no history) where that is 0."""
    history = jnp.zeros((2, 3, 3), jnp.float32)  # [sites, operands, window]
    history = updated_history(history, jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 6.0]]))
    history = updated_history(history, jnp.array([[0.5, jnp.inf, 8.0], [jnp.nan, 1.0, 2.0]]))
    np.testing.assert_array_equal(history[0], [[0.5, 1.0, 0.0], [2.0, 0.0, 0.0], [8.0, 3.0, 0.0]])
    np.testing.assert_array_equal(history[1], [[4.0, 0.0, 0.0], [1.0, 0.0, 0.0], [2.0, 6.0, 0.0]])
    e4, e5 = fp8_max(FORWARD_FORMAT), fp8_max(BACKWARD_FORMAT)
    np.testing.assert_allclose(history_scales(history, "max", 0)[0], [1.0 / e4, 2.0 / e4, 8.0 / e5], rtol=1e-7)
    np.testing.assert_allclose(history_scales(history, "most_recent", 1)[0], [1.0 / e4, 4.0 / e4, 16.0 / e5])
    assert float(history_scales(jnp.zeros((3, 4)), "max", 0)[1]) == 0.0  # no history: current scaling's scale


def test_delayed_gemm_scales_from_the_history_and_returns_its_amaxes():
    """Inside `layer_scales` a delayed-scaling GEMM quantises with the given scales (x saturates at 448 * s_x
    where it exceeds the history's range), falls back to the current amax where a scale is 0, and returns the
    amaxes it saw as its probe's cotangent (none for an all-zero output gradient)."""
    fp8 = Fp8(active=True, delayed=True)
    x = jnp.array([[4.0, -1.0]], jnp.float32)
    w = jnp.array([[1.0], [2.0]], jnp.float32)

    def gemm(x, w, scales, probes):
        with layer_scales(scales, probes):
            return fp8.matmul(x, w, "column", False)

    scales = jnp.array([[1.0 / 448, 2.0 / 448, 0.0]], jnp.float32)  # x saturates at 1.0, w exact, g: current
    y, vjp = jax.vjp(gemm, x, w, scales, jnp.zeros((1, 3)))
    np.testing.assert_allclose(float(y[0, 0]), 1.0 * 1.0 - 1.0 * 2.0, rtol=1e-6)  # x clipped to [1, -1]
    _, _, d_scales, d_probes = vjp(jnp.ones_like(y) * 3.0)
    np.testing.assert_array_equal(d_probes, [[4.0, 2.0, 3.0]])
    np.testing.assert_array_equal(d_scales, np.zeros((1, 3)))
    assert not np.any(np.asarray(vjp(jnp.zeros_like(y))[3]))  # a tick without a microbatch sends nothing
    # an inf in a tensor makes its scale, and so the output, NaN (the step is then skipped)
    assert np.isnan(float(gemm(x.at[0, 0].set(jnp.inf), w, scales, jnp.zeros((1, 3)))[0, 0]))


def test_bad_split_is_refused():
    with pytest.raises(ValueError, match="split must be 'column' or 'row'"):
        Fp8(active=True).matmul(jnp.ones((2, 4)), jnp.ones((4, 2)), "rows", False)
    assert not NO_FP8.active


def test_the_plan_refuses_fp8_on_a100_and_tpu():
    """Before any device work: an NVIDIA GPU below compute capability 8.9 (A100: XLA would upcast the GEMMs) and a
    TPU are refused, naming the fix; an H100 passes."""
    from types import SimpleNamespace

    import numpy as np

    from jaxpar.config import ConfigError, load_config
    from jaxpar.training.plan import _check_fp8

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_config(os.path.join(root, "configs", "tiny.yaml"), ["precision.fp8.enabled=true"], validate=False)

    def mesh(kind: str, capability: str):
        device = SimpleNamespace(device_kind=kind, compute_capability=capability)
        return SimpleNamespace(devices=np.array([device], dtype=object))

    with pytest.raises(
        ConfigError, match=r"needs FP8 tensor cores .*NVIDIA A100-SXM4-80GB has compute capability 8\.0"
    ):
        _check_fp8(cfg, mesh("NVIDIA A100-SXM4-80GB", "8.0"), "gpu")
    with pytest.raises(ConfigError, match="on TPU they are not supported; set precision.fp8.enabled=false"):
        _check_fp8(cfg, mesh("TPU v5 lite", ""), "tpu")
    _check_fp8(cfg, mesh("NVIDIA H100 80GB HBM3", "9.0"), "gpu")


def test_delayed_scaling_needs_a_family_gemm_count_it_can_use():
    """A family registered with an `fp8_gemm_sites` that is not a function is refused at registration; one
    whose count is not a positive int, when delayed scaling asks for it (`build_plan` turns it into a ConfigError)."""
    import dataclasses

    from jaxpar.config.schema import ModelConfig
    from jaxpar.model.registry import register_model
    from jaxpar.training.fp8_history import gemm_sites

    with pytest.raises(TypeError, match="fp8_gemm_sites must be callable"):
        register_model("fp8_sites_int", lambda cfg, rngs: None, fp8_gemm_sites=3)
    register_model("fp8_sites_zero", lambda cfg, rngs: None, fp8_gemm_sites=lambda m: 0, replace=True)
    with pytest.raises(ValueError, match="must give a positive int"):
        gemm_sites(dataclasses.replace(ModelConfig(), name="fp8_sites_zero"))
    assert gemm_sites(ModelConfig()) == 7  # llama: q, k, v, o, gate, up, down
