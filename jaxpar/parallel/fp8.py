"""FP8 GEMMs with per-tensor scales agreed over the mesh axes that split each tensor, for use inside shard_map.

Shape letters: R rows of a GEMM's input (the tokens of a microbatch: B * T, or this device's part of them), I its
input features (contracted), J its output features: y_RJ = x_RI @ w_IJ; O the FP8 GEMMs of one row of a layer
stack (delayed scaling).

The hybrid recipe (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv 2209.05433, sections 3-4;
NVIDIA Transformer Engine's `Format.HYBRID`): the forward GEMM y = x @ w multiplies E4M3 copies of x and w (3
mantissa bits, largest finite 448), the backward's two GEMMs dx = g @ w^T and dw = x^T @ g multiply the E5M2 copy
of the output gradient g (2 mantissa bits, largest finite 57344) with the forward's E4M3 copies (the custom VJP's
residuals, which a remat policy may recompute). Every GEMM
accumulates in fp32 and its result is multiplied by the two operands' scales, then cast to the output dtype.

Per-tensor scaling, current ("just-in-time", Transformer Engine's `Float8CurrentScaling`): a tensor X is stored as
q = round_fp8(clip(X / s, -max, max)) with the dequantising scale s = amax(X) / max * 2^margin, so that its largest
magnitude lands on the format's largest finite value (`margin` > 0 leaves 2^margin of headroom). amax(X) of 0 gives
s = 1 (every element quantises to 0 either way); an amax that is inf or NaN gives a NaN scale, so the step's loss
or gradients are non-finite and the train step skips the update (`jaxpar.training.optimizer.skip_nonfinite`).

Per-tensor scaling, delayed (NVIDIA Transformer Engine's `DelayedScaling` recipe: a window of amaxes, reduced by
max or most recent): inside `layer_scales` each GEMM site quantises with scales taken from the amaxes of earlier
steps (`history_scales`; 0, "no history", falls back to the current amax), saturating what lies beyond them, and
returns the amaxes it saw through the backward (`_fp8_gemm_delayed`); the train step keeps the history
(`jaxpar.training.fp8_history`, `updated_history`).

Amax over the whole tensor. Inside the step's shard_map a device holds a part of each GEMM operand: the
activations' rows are split over the token axes (`data`, `fsdp`, `context`: the batch and the sequence), a
column-parallel weight's output features and a row-parallel weight's input features over `tensor` (Megatron,
`jaxpar.parallel.tensor`), and so are the hidden activations between them and the column-parallel GEMM's output
gradient. Each device's local amax is max-reduced (`jax.lax.pmax`, an all-reduce of one fp32 number) over exactly
the axes that split the operand, so every device quantises with the scale one device would compute from the whole
tensor, and the layouts agree with one device (a per-shard amax quantises each shard differently). Operands
replicated over an axis (the column-parallel input after `TensorParallel.enter`, the row-parallel output's
gradient) reduce over nothing there. The pipeline's stages hold different layers: no reduction over `pipeline`.
The MoE experts' stacked weights are one tensor, split over the expert axes too; the rows dispatched to them are
split over the token axes (each row on one device of them).
A microbatch is the tensor: under gradient accumulation or the pipeline's microbatches each microbatch has its
own scales, so one device compares with the same microbatches.

A delayed-scaling history's amaxes are reduced the same way, so every device appends the same ones.

`Fp8.matmul` (a linear layer), `Fp8.grouped_matmul` (dropless experts) and `Fp8.batched_matmul` (capacity
experts) are the entries; `NO_FP8` (inactive) leaves the caller's own GEMM in place. On CPU the GEMMs run as
XLA:CPU's dots of FP8 operands (for tests, at reference speed); XLA:CPU converts E5M2 through half precision, whose
conversion routines its fast code generation cannot link for a CPU without F16C (`--xla_cpu_max_isa=SSE4_2` with
`--xla_backend_optimization_level=0`): `cpu_fp8_error` says whether this process can.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
from collections.abc import Iterator

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


def _scaled(out: jax.Array, a_scale: jax.Array, b_scale: jax.Array, dtype) -> jax.Array:
    """An FP8 GEMM's result (in `dtype`) times both operands' scales, in fp32, cast to `dtype`."""
    return (out.astype(jnp.float32) * (a_scale * b_scale)).astype(dtype)


# The three GEMMs of a linear layer for each operand shape (`_GEMMS[kind]`: forward, input gradient, weight
# gradient), each gemm(a, b, group_sizes, dtype) of FP8 operands with its result in `dtype` (accumulated in fp32
# by the GEMM). The FP8 operands go to the dot as they are, not dequantised first: XLA's GPU compiler then emits an
# FP8 GEMM (cuBLASLt's `__cublas$lt$matmul$f8`, or a Triton fusion over FP8 operands). A dot of dequantised bf16
# copies becomes FP8 only on cuBLASLt's path and runs in bf16 when the compiler picks Triton. The GEMM's own result
# is in the compute dtype, not fp32, so that a remat policy keeping dot outputs (`model.remat: dots`) keeps as many
# bytes as for a bf16 GEMM.
#   plain     x [R, I] @ w [I, J]
#   grouped   rows grouped by expert, x [R, I] with group g's group_sizes[g] rows @ w [G, I, J] (`ragged_dot`)
#   batched   x [G, R, I] @ w [G, I, J], one GEMM per expert g (capacity routing's fixed slots)
def _dot(dims):
    return lambda a, b, _, dtype: jax.lax.dot_general(a, b, dims, preferred_element_type=dtype)


_RAGGED_WEIGHT_GRAD = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)
_GEMMS = {
    "plain": (
        _dot((((1,), (0,)), ((), ()))),  # [R, I] @ [I, J]
        _dot((((1,), (1,)), ((), ()))),  # [R, J] @ [I, J]^T -> [R, I]
        _dot((((0,), (0,)), ((), ()))),  # [R, I]^T @ [R, J] -> [I, J]
    ),
    "grouped": (
        lambda x, w, sizes, dtype: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=dtype),
        lambda g, w, sizes, dtype: jax.lax.ragged_dot(g, jnp.swapaxes(w, 1, 2), sizes, preferred_element_type=dtype),
        lambda x, g, sizes, dtype: jax.lax.ragged_dot_general(
            x, g, sizes, _RAGGED_WEIGHT_GRAD, preferred_element_type=dtype
        ),
    ),
    "batched": (
        _dot((((2,), (1,)), ((0,), (0,)))),  # [G, R, I] @ [G, I, J]
        _dot((((2,), (2,)), ((0,), (0,)))),  # [G, R, J] @ [G, I, J]^T -> [G, R, I]
        _dot((((1,), (1,)), ((0,), (0,)))),  # [G, R, I]^T @ [G, R, J] -> [G, I, J]
    ),
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fp8_gemm(x: jax.Array, w: jax.Array, sizes: jax.Array, kind: str, axes, margin: int) -> jax.Array:
    return _fp8_gemm_fwd(x, w, sizes, kind, axes, margin)[0]


def _forward(x, w, x_scale, w_scale, sizes, kind):
    """The forward GEMM of both scalings: (y in x's dtype, the residuals the backward reads). The backward needs
    only the FP8 copies (1 byte per element) and their scales; the dtypes ride along as zero-size arrays (a
    residual must be a jax type)."""
    x_q, w_q = quantize(x, x_scale, FORWARD_FORMAT), quantize(w, w_scale, FORWARD_FORMAT)
    y = _scaled(_GEMMS[kind][0](x_q, w_q, sizes, x.dtype), x_scale, w_scale, x.dtype)
    return y, (x_q, x_scale, w_q, w_scale, sizes, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _backward(res, g, g_scale, kind):
    """The backward GEMMs of both scalings from `_forward`'s residuals and the output gradient's scale: (dx, dw)."""
    x_q, x_scale, w_q, w_scale, sizes, x_like, w_like = res
    g_q = quantize(g, g_scale, BACKWARD_FORMAT)
    _, input_grad, weight_grad = _GEMMS[kind]
    dx = _scaled(input_grad(g_q, w_q, sizes, x_like.dtype), g_scale, w_scale, x_like.dtype)
    dw = _scaled(weight_grad(x_q, g_q, sizes, w_like.dtype), x_scale, g_scale, w_like.dtype)
    return dx, dw


def _fp8_gemm_fwd(x, w, sizes, kind, axes, margin):
    x_axes, w_axes, _ = axes
    x_scale = scale_from_amax(global_amax(x, x_axes), FORWARD_FORMAT, margin)
    w_scale = scale_from_amax(global_amax(w, w_axes), FORWARD_FORMAT, margin)
    return _forward(x, w, x_scale, w_scale, sizes, kind)


def _fp8_gemm_bwd(kind, axes, margin, res, g):
    g_scale = scale_from_amax(global_amax(g, axes[2]), BACKWARD_FORMAT, margin)
    return (*_backward(res, g, g_scale, kind), None)


_fp8_gemm.defvjp(_fp8_gemm_fwd, _fp8_gemm_bwd)


# Delayed scaling: the scales [3] = (s_x, s_w, s_g) come in from the history (`history_scales`; 0 for an operand
# without history yet, which is then scaled from its current amax, as under current scaling), and the amaxes
# (a_x, a_w, a_g) the GEMM sees go out as the cotangent of `probe` (zeros [3], the one channel out of a backward;
# the scales get none). The scales depend on the weights' history alone, so a pipeline recomputes the weight's FP8
# copy per microbatch rather than keeping it; the probe is the microbatch's own. A GEMM whose output gradient is
# all zero -- a pipeline tick without a microbatch, whose cotangent the schedule zeroes -- sends zeros, so that
# summing the cotangents over ticks adds only the microbatch's own amaxes
# (`jaxpar.training.fp8_history`).
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _fp8_gemm_delayed(x, w, scales: jax.Array, probe: jax.Array, sizes: jax.Array, kind: str, axes, margin):
    return _fp8_gemm_delayed_fwd(x, w, scales, probe, sizes, kind, axes, margin)[0]


def _delayed_scale(scale: jax.Array, amax: jax.Array, fmt, margin: int) -> jax.Array:
    """The history's scale, or where it has none (0) the current amax's (`scale_from_amax`); NaN where the current
    amax is inf or NaN, as under current scaling (so a tensor holding one makes the step non-finite and the step
    is skipped, instead of its inf saturating to the format's largest value)."""
    return jnp.where(scale > 0, scale, scale_from_amax(amax, fmt, margin)) + 0.0 * amax


def _fp8_gemm_delayed_fwd(x, w, scales, probe, sizes, kind, axes, margin):
    del probe
    x_axes, w_axes, _ = axes
    seen = jnp.stack([global_amax(x, x_axes), global_amax(w, w_axes)])
    x_scale = _delayed_scale(scales[0], seen[0], FORWARD_FORMAT, margin)
    w_scale = _delayed_scale(scales[1], seen[1], FORWARD_FORMAT, margin)
    y, res = _forward(x, w, x_scale, w_scale, sizes, kind)
    return y, (res, scales, seen)


def _fp8_gemm_delayed_bwd(kind, axes, margin, res, g):
    res, scales, seen = res
    amax_g = global_amax(g, axes[2])
    dx, dw = _backward(res, g, _delayed_scale(scales[2], amax_g, BACKWARD_FORMAT, margin), kind)
    d_probe = jnp.where(amax_g > 0, jnp.concatenate([seen, amax_g[None]]), jnp.float32(0.0))
    return dx, dw, jnp.zeros_like(scales), d_probe, None


_fp8_gemm_delayed.defvjp(_fp8_gemm_delayed_fwd, _fp8_gemm_delayed_bwd)

OPERANDS = 3  # a GEMM's scaled operands under delayed scaling: input x, weight w, output gradient g
# A layer row's scales and probes [O, 3] while its blocks run, and the next GEMM site's index (`layer_scales`).
_LAYER_SCALES: contextvars.ContextVar[list | None] = contextvars.ContextVar("jaxpar_fp8_scales", default=None)


@contextlib.contextmanager
def layer_scales(scales_O3: jax.Array, probes_O3: jax.Array) -> Iterator[list]:
    """Within the block, the model's FP8 GEMMs under delayed scaling take their scales from `scales_O3` (fp32
    [O, 3]: per FP8 GEMM of one layer row, in call order, the dequantising scales of x, w and g) and send the
    amaxes they see as the cotangent of `probes_O3` (fp32 [O, 3], zeros), site i the i-th GEMM called.
    `jaxpar.model.stack.scan_layers` enters it for each row. Yields [(scales, probes), sites used]."""
    state = [(scales_O3, probes_O3), 0]
    token = _LAYER_SCALES.set(state)
    try:
        yield state
    finally:
        _LAYER_SCALES.reset(token)


def _site_scales() -> tuple[jax.Array, jax.Array] | None:
    """The next GEMM site's (scales [3], probe [3]) inside `layer_scales`, else None (current scaling)."""
    state = _LAYER_SCALES.get()
    if state is None:
        return None
    (scales, probes), i = state
    if i >= scales.shape[0]:
        raise ValueError(
            f"FP8 delayed scaling: a layer runs more FP8 GEMMs than the {scales.shape[0]} its model family's "
            f"fp8_gemm_sites gives (jaxpar.register_model); make it give the number of column_matmul / row_matmul "
            f"calls one row of the stack makes, or set precision.fp8.scaling=current"
        )
    state[1] = i + 1
    return scales[i], probes[i]


def history_scales(history: jax.Array, amax_compute: str, margin: int) -> jax.Array:
    """Delayed scaling's scales from an amax history [..., 3, W] (fp32; operand x, w, g; newest first): the
    window's amax (`max`, or `most_recent`: entry 0) per operand -> `scale_from_amax` in the operand's format
    (E4M3 for x and w, E5M2 for g) -> [..., 3] fp32. Where that amax is 0 (an empty history: the first step, or
    an operand that has been all zero) the scale is 0, which the GEMM reads as "no history": it scales that
    operand from its current amax instead (a scale of 1 would flush a step's small gradients to zero)."""
    amax = jnp.max(history, axis=-1) if amax_compute == "max" else history[..., 0]
    formats = (FORWARD_FORMAT, FORWARD_FORMAT, BACKWARD_FORMAT)
    scales = [jnp.where(amax[..., k] > 0, scale_from_amax(amax[..., k], f, margin), 0.0) for k, f in enumerate(formats)]
    return jnp.stack(scales, axis=-1)


def updated_history(history: jax.Array, amax: jax.Array) -> jax.Array:
    """The history [..., 3, W] with this step's amaxes [..., 3] in front (the oldest dropped); an amax that is
    inf or NaN is not written (its operand's history stays as it was), so one overflow does not poison W steps
    of scales."""
    rolled = jnp.concatenate([amax[..., None].astype(history.dtype), history[..., :-1]], axis=-1)
    return jnp.where(jnp.isfinite(amax)[..., None], rolled, history)


@dataclasses.dataclass(frozen=True)
class Fp8:
    """FP8 GEMMs for a model's dense layers (module docstring); inactive: the layers keep their own GEMMs.

    Attributes:
      active: whether the GEMMs run in FP8 (`precision.fp8.enabled`).
      token_axes: the mesh axes of size > 1 that split the activations' rows inside the step's shard_map (of
        `data`, `fsdp`, `context`); () on one device or outside a shard_map.
      margin: the scales' headroom, 2^margin (`precision.fp8.margin`).
      delayed: delayed scaling (`precision.fp8.scaling=delayed`): inside `layer_scales` (the train step's
        layers) each GEMM quantises with its site's scales from the history and sends back the amaxes it saw;
        elsewhere (evaluation) with current scaling.
    """

    active: bool = False
    token_axes: tuple[str, ...] = ()
    margin: int = 0
    delayed: bool = False

    def _gemm(self, x: jax.Array, w: jax.Array, sizes: jax.Array, kind: str, axes) -> jax.Array:
        site = _site_scales() if self.delayed else None
        if site is None:
            return _fp8_gemm(x, w, sizes, kind, axes, self.margin)
        return _fp8_gemm_delayed(x, w, *site, sizes, kind, axes, self.margin)

    def _axes(self, split: str, tensor_split: bool, weight_axes: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
        """The mesh axes to max-reduce each operand's amax over: (input, weight, output gradient)."""
        if split not in ("column", "row"):
            raise ValueError(f"split must be 'column' or 'row', not {split!r}")
        tensor = (TENSOR,) if tensor_split else ()
        tokens = self.token_axes
        if split == "column":
            return tokens, weight_axes + tensor, tokens + tensor
        return tokens + tensor, weight_axes + tensor, tokens

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
        axes = self._axes(split, tensor_split, ())
        i = x.shape[-1]
        y = self._gemm(x.reshape(-1, i), w.reshape(i, -1), jnp.zeros((0,), jnp.int32), "plain", axes)
        return y.reshape(x.shape[:-1] + w.shape[1:])

    def grouped_matmul(
        self, x_RI: jax.Array, w_GIJ: jax.Array, sizes_G: jax.Array, split: str, tensor_split: bool, expert_axes
    ) -> jax.Array:
        """Rows grouped by expert through their experts' weights (`jax.lax.ragged_dot`: group g is the next
        sizes_G[g] rows; rows past the groups give zeros) -> [R, J] in x's dtype, in FP8. The G experts' stacked
        weights are one tensor: its amax is max-reduced over `expert_axes` (which split the experts under expert
        parallelism) and `tensor`; `split` and `tensor_split` as for `matmul`.

        Raises:
          ValueError: `split` is neither `column` nor `row`.
        """
        axes = self._axes(split, tensor_split, tuple(expert_axes))
        return self._gemm(x_RI, w_GIJ, sizes_G.astype(jnp.int32), "grouped", axes)

    def batched_matmul(
        self, x_GRI: jax.Array, w_GIJ: jax.Array, split: str, tensor_split: bool, expert_axes
    ) -> jax.Array:
        """One GEMM per expert g, x [G, R, I] @ w [G, I, J] -> [G, R, J] in x's dtype, in FP8, each operand's
        stack one tensor (scales as in `grouped_matmul`).

        Raises:
          ValueError: `split` is neither `column` nor `row`.
        """
        axes = self._axes(split, tensor_split, tuple(expert_axes))
        return self._gemm(x_GRI, w_GIJ, jnp.zeros((0,), jnp.int32), "batched", axes)


NO_FP8 = Fp8()
NO_AXES = Fp8(active=True)  # FP8 GEMMs on one device (no mesh axes to reduce over)


@functools.cache
def cpu_fp8_error() -> str | None:
    """None when XLA:CPU in this process converts bf16 to and from both FP8 formats and multiplies them; else the
    first line of its error (at `--xla_cpu_max_isa=SSE4_2`: "Symbols not found: [ __extendhfsf2 ]", the half
    precision routine E5M2's conversion goes through). Compiles and runs one tiny program on the CPU, once."""

    def probe(x, w, g):
        y, vjp = jax.vjp(lambda x, w: NO_AXES.matmul(x, w, "column", False), x, w)
        return y, vjp(g)

    try:
        cpu = jax.devices("cpu")[0]
        x = jax.device_put(jnp.ones((2, 2), jnp.bfloat16), cpu)
        jax.block_until_ready(jax.jit(probe)(x, x.astype(jnp.float32), x))
    except jax.errors.JaxRuntimeError as e:
        logging.getLogger(__name__).debug("XLA:CPU cannot run FP8: %s", e)
        return str(e).splitlines()[0]
    return None
