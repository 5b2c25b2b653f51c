"""FP8 GEMMs with per-tensor scales agreed over the mesh axes that split each tensor, for use inside shard_map.

Shape letters: R rows of a GEMM's input (the tokens of a microbatch: B * T, or this device's part of them), I its
input features (contracted), J its output features: y_RJ = x_RI @ w_IJ.

The hybrid recipe (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv 2209.05433, sections 3-4;
NVIDIA Transformer Engine's `Format.HYBRID`): the forward GEMM y = x @ w multiplies E4M3 copies of x and w (3
mantissa bits, largest finite 448), the backward's two GEMMs dx = g @ w^T and dw = x^T @ g multiply the E5M2 copy
of the output gradient g (2 mantissa bits, largest finite 57344) with the saved E4M3 copies. Every GEMM
accumulates in fp32 and its result is multiplied by the two operands' scales, then cast to the output dtype.

Per-tensor scaling, current ("just-in-time", Transformer Engine's `Float8CurrentScaling`): a tensor X is stored as
q = round_fp8(clip(X / s, -max, max)) with the dequantising scale s = amax(X) / max * 2^margin, so that its largest
magnitude lands on the format's largest finite value (`margin` > 0 leaves 2^margin of headroom). amax(X) of 0 gives
s = 1 (every element quantises to 0 either way); an amax that is inf or NaN gives a NaN scale, so the step's loss
or gradients are non-finite and the train step skips the update (`train.skip_nonfinite`).

Amax over the whole tensor. Inside the step's shard_map a device holds a part of each GEMM operand: the
activations' rows are split over the token axes (`data`, `fsdp`, `context`: the batch and the sequence), a
column-parallel weight's output features and a row-parallel weight's input features over `tensor` (Megatron,
`jaxpar.parallel.tensor`), and so are the hidden activations between them and the column-parallel GEMM's output
gradient. Each device's local amax is max-reduced (`jax.lax.pmax`, an all-reduce of one fp32 number) over exactly
the axes that split the operand, so every device quantises with the scale one device would compute from the whole
tensor, and the layouts agree with one device (a per-shard amax quantises each shard differently). Operands
replicated over an axis (the column-parallel input after `TensorParallel.enter`, the row-parallel output's
gradient) reduce over nothing there. The pipeline's stages hold different layers: no reduction over `pipeline`.
A microbatch is the tensor: under gradient accumulation or the pipeline's microbatches each microbatch has its
own scales, so one device compares with the same microbatches.

`Fp8.matmul` is the one entry; `NO_FP8` (inactive) leaves the caller's own GEMM in place. On CPU the GEMMs run
as XLA:CPU's dots of FP8 operands (for tests, at reference speed); XLA:CPU converts E5M2 through half precision,
whose conversion routines it cannot link for a CPU without F16C (`--xla_cpu_max_isa=SSE4_2`): `cpu_fp8_error`
says whether this machine can.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp

from jaxpar.config.mesh_axes import TENSOR

FORWARD_FORMAT = jnp.float8_e4m3fn  # activations and weights (3 mantissa bits, max 448)
BACKWARD_FORMAT = jnp.float8_e5m2  # output gradients (2 mantissa bits, max 57344)


def fp8_max(fmt) -> float:
    """The largest finite value of the FP8 format `fmt` (448 for E4M3, 57344 for E5M2)."""
    return float(jnp.finfo(fmt).max)


def scale_from_amax(amax: jax.Array, fmt, margin: int = 0) -> jax.Array:
    """The dequantising scale s = amax / max(fmt) * 2^margin (fp32 scalar); 1 where amax is 0 (module docstring).

    inf or NaN amax propagate: the scale is then not finite."""
    amax = amax.astype(jnp.float32)
    scale = amax * jnp.float32(2.0**margin / fp8_max(fmt))
    return jnp.where(amax == 0, jnp.float32(1.0), scale)


def quantize(x: jax.Array, scale: jax.Array, fmt) -> jax.Array:
    """x / scale rounded to the FP8 format `fmt` (round to nearest even), saturating at +-max(fmt); in fp32 first."""
    limit = jnp.float32(fp8_max(fmt))
    return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(fmt)


def global_amax(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """max |x| over the whole tensor: this device's part, max-reduced over the mesh `axes` that split it (fp32
    scalar, the same on every device of those axes). No gradient flows through it."""
    amax = jnp.max(jnp.abs(jax.lax.stop_gradient(x))).astype(jnp.float32)
    return jax.lax.pmax(amax, axes) if axes else amax


def _scaled_dot(a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array, dims, dtype) -> jax.Array:
    """An FP8 GEMM: dot_general of the FP8 operands (accumulated in fp32 by the GEMM, its result rounded to
    `dtype`), times both scales in fp32, cast to `dtype`. The GEMM's own result is in `dtype`, not fp32: a remat
    policy that keeps dot outputs (`model.remat: dots`) then keeps as many bytes as for a bf16 GEMM.

    The FP8 operands go to the dot as they are (not dequantised first): XLA's GPU compiler then emits an FP8 GEMM
    (a cuBLASLt `__cublas$lt$matmul$f8` call, or a Triton GEMM fusion over FP8 operands). A dot of dequantised
    bf16 copies is rewritten to FP8 by cuBLASLt's pattern only, and runs in bf16 when the compiler picks Triton.
    """
    out = jax.lax.dot_general(a, b, dims, preferred_element_type=dtype)
    return (out.astype(jnp.float32) * (a_scale * b_scale)).astype(dtype)


_RI_IJ = (((1,), (0,)), ((), ()))  # [R, I] @ [I, J]
_RJ_IJ_T = (((1,), (1,)), ((), ()))  # [R, J] @ [I, J]^T -> [R, I]
_RI_T_RJ = (((0,), (0,)), ((), ()))  # [R, I]^T @ [R, J] -> [I, J]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _fp8_matmul(x_RI: jax.Array, w_IJ: jax.Array, axes: tuple[tuple[str, ...], ...], margin: int) -> jax.Array:
    return _fp8_matmul_fwd(x_RI, w_IJ, axes, margin)[0]


def _fp8_matmul_fwd(x_RI, w_IJ, axes, margin):
    x_axes, w_axes, _ = axes
    x_scale = scale_from_amax(global_amax(x_RI, x_axes), FORWARD_FORMAT, margin)
    w_scale = scale_from_amax(global_amax(w_IJ, w_axes), FORWARD_FORMAT, margin)
    x_q, w_q = quantize(x_RI, x_scale, FORWARD_FORMAT), quantize(w_IJ, w_scale, FORWARD_FORMAT)
    y = _scaled_dot(x_q, x_scale, w_q, w_scale, _RI_IJ, x_RI.dtype)
    # the backward needs only the FP8 copies (1 byte per element) and their scales; the dtypes ride along as
    # zero-size arrays (a residual must be a jax type)
    return y, (x_q, x_scale, w_q, w_scale, jnp.zeros((0,), x_RI.dtype), jnp.zeros((0,), w_IJ.dtype))


def _fp8_matmul_bwd(axes, margin, res, g_RJ):
    x_q, x_scale, w_q, w_scale, x_like, w_like = res
    g_scale = scale_from_amax(global_amax(g_RJ, axes[2]), BACKWARD_FORMAT, margin)
    g_q = quantize(g_RJ, g_scale, BACKWARD_FORMAT)
    dx = _scaled_dot(g_q, g_scale, w_q, w_scale, _RJ_IJ_T, x_like.dtype)
    dw = _scaled_dot(x_q, x_scale, g_q, g_scale, _RI_T_RJ, w_like.dtype)
    return dx, dw


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


@dataclasses.dataclass(frozen=True)
class Fp8:
    """FP8 GEMMs for a model's dense layers (module docstring); inactive: the layers keep their own GEMMs.

    Attributes:
      active: whether the GEMMs run in FP8 (`precision.fp8.enabled`).
      token_axes: the mesh axes of size > 1 that split the activations' rows inside the step's shard_map (of
        `data`, `fsdp`, `context`); () on one device or outside a shard_map.
      margin: the scales' headroom, 2^margin (`precision.fp8.margin`).
    """

    active: bool = False
    token_axes: tuple[str, ...] = ()
    margin: int = 0

    def matmul(self, x: jax.Array, w: jax.Array, split: str, tensor_split: bool) -> jax.Array:
        """x [..., I] @ w [I, ...] -> [..., J...] in x's dtype, as an FP8 GEMM with scales agreed over the mesh.

        x's leading dimensions are its rows (tokens); w's trailing dimensions its output features. `split` says
        which operands `tensor` splits when `tensor_split` (tensor parallelism is on): `column` (a
        column-parallel GEMM: w's output features, and so the output and its gradient) or `row` (row-parallel:
        x's features and w's input features; the output is a partial sum whose gradient every rank shares).
        w may be fp32 or bf16: it is quantised from its own dtype and its gradient is returned in it.

        Raises:
          ValueError: `split` is neither `column` nor `row`.
        """
        if split not in ("column", "row"):
            raise ValueError(f"split must be 'column' or 'row', not {split!r}")
        tensor = (TENSOR,) if tensor_split else ()
        tokens = self.token_axes
        if split == "column":
            axes = (tokens, tensor, tokens + tensor)  # x, w, the output's gradient
        else:
            axes = (tokens + tensor, tensor, tokens)
        k = x.shape[-1]
        out_shape = x.shape[:-1] + w.shape[1:]
        y = _fp8_matmul(x.reshape(-1, k), w.reshape(k, -1), axes, self.margin)
        return y.reshape(out_shape)


NO_FP8 = Fp8()


@functools.cache
def cpu_fp8_error() -> str | None:
    """None when XLA:CPU in this process converts bf16 to and from both FP8 formats and multiplies them; else the
    first line of its error (at `--xla_cpu_max_isa=SSE4_2`: "Symbols not found: [ __extendhfsf2 ]", the half
    precision routine E5M2's conversion goes through). Compiles and runs one tiny program on the CPU, once."""

    def probe(x, w, g):
        y, vjp = jax.vjp(lambda x, w: _fp8_matmul(x, w, ((), (), ()), 0), x, w)
        return y, vjp(g)

    try:
        cpu = jax.devices("cpu")[0]
        x = jax.device_put(jnp.ones((2, 2), jnp.bfloat16), cpu)
        jax.block_until_ready(jax.jit(probe)(x, x.astype(jnp.float32), x))
    except jax.errors.JaxRuntimeError as e:
        logging.getLogger(__name__).debug("XLA:CPU cannot run FP8: %s", e)
        return str(e).splitlines()[0]
    return None
