"""FP8 delayed scaling in the train step (`precision.fp8.scaling=delayed`): the amax history in the train state,
the scales the step's GEMMs quantise with, and the amaxes they saw, out of the step and into the history.

Shape letters: L the rows of the layer stack (`ModelConfig.stack_depth`, or this stage's share inside the
step's shard_map), O the FP8 GEMMs of one row (`jaxpar.model.registry.ModelFamily.fp8_gemm_sites`), 3 the
operands of each (input x, weight w, output gradient g), W the window (`precision.fp8.amax_history`), M the
step's microbatches (gradient accumulation steps x pipeline microbatches).

Delayed scaling (NVIDIA Transformer Engine's `DelayedScaling` recipe, whose `amax_history_len` and
`amax_compute_algo` the config's `amax_history` and `amax_compute` follow): each operand's scale is taken before
the step from the amaxes of the same tensor in the last W steps (their max, or the most recent,
`precision.fp8.amax_compute`); the amaxes the step sees are appended afterwards. An operand without history (all
W amaxes 0: the first step) is scaled from its current amax, as current scaling would. The history is part of the
train state, `state["fp8"]["amax_history"]` (fp32 [L, O, 3, W], newest first), sharded over `pipeline` with the
layers, so it is checkpointed and restored with them.

How the amaxes come out of the step. The scales enter the layer stack as one more leaf, `FP8_SCALES` (fp32
[L, O, 3]), and with them a leaf of zeros, `FP8_PROBES` (fp32 [L, M, O, 3], one slice per microbatch), beside
the stacked weights, so the pipeline's stage split, chunk order and stage layout move them with their layers.
Microbatch i's blocks read probe slice i (`stack_scales`, from the microbatch's `SLOT`), and each GEMM returns the
amaxes it saw (max-reduced over the mesh axes that split its operands: the same on every device but for
`pipeline`) as the cotangent of its probe (`jaxpar.parallel.fp8`). A microbatch's amaxes thus land in its own
slice, whatever sums the schedules form over ticks and microbatches (a tick without a microbatch sends zeros),
and the step takes their max over M (`seen_amax`): the amax of each tensor over the step's microbatches. The
scales themselves do not depend on the microbatch, so a pipeline stage rebuilds a weight's FP8 copy from the
weight in the backward instead of stashing one per microbatch in flight.

Overflow: an amax that is inf or NaN is not written (`jaxpar.parallel.fp8.updated_history`), and a step whose
update the non-finite skip drops (`jaxpar.training.optimizer.skip_nonfinite`) leaves the whole history as it was.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from jaxpar.model.interface import STACK_ATTRIBUTE
from jaxpar.model.registry import model_family
from jaxpar.model.stack import fp8_stack_scales
from jaxpar.parallel.fp8 import OPERANDS, history_scales, updated_history

FP8_SCALES = "fp8_scales"  # the layer stack's leaf of delayed scales inside the step, fp32 [L, O, 3]
FP8_PROBES = "fp8_probes"  # ... and of amax probes (zeros; their cotangents are the amaxes), fp32 [L, M, O, 3]
SLOT = "fp8_slot"  # a microbatch's index among the step's M (int32 scalar), beside its token arrays
HISTORY = "amax_history"  # state["fp8"][HISTORY]


def delayed_config(cfg) -> bool:
    """Whether config `cfg`'s step runs FP8 with delayed scaling (and its train state holds a history)."""
    fp8 = cfg.precision.fp8
    return fp8.enabled and fp8.scaling == "delayed"


def gemm_sites(model_cfg) -> int:
    """O: the FP8 GEMMs one row of the model's layer stack runs (its family's `fp8_gemm_sites`).

    Raises:
      ValueError: the family does not say (registered without `fp8_gemm_sites`), or says something other than a
        positive int."""
    family = model_family(model_cfg.name)
    if family.fp8_gemm_sites is None:
        raise ValueError(
            f"precision.fp8.scaling=delayed keeps a history per GEMM of a layer, and model {model_cfg.name!r} was "
            f"registered without fp8_gemm_sites (jaxpar.register_model(..., fp8_gemm_sites=...)); register it, or "
            f"set precision.fp8.scaling=current"
        )
    sites = family.fp8_gemm_sites(model_cfg)
    if not isinstance(sites, int) or isinstance(sites, bool) or sites < 1:
        raise ValueError(
            f"model {model_cfg.name!r}'s fp8_gemm_sites gave {sites!r}; it must give a positive int: the number of "
            f"FP8 GEMMs (column_matmul / row_matmul calls with the step's tp) one row of its layer stack runs"
        )
    return sites


def history_shape(cfg) -> tuple[int, int, int, int]:
    """(L, O, 3, W) of the amax history for config `cfg` (`Config`)."""
    return (cfg.model.stack_depth, gemm_sites(cfg.model), OPERANDS, cfg.precision.fp8.amax_history)


def history_bytes(cfg) -> int:
    """Bytes per device of the amax history: L * O * 3 * W fp32 numbers over the `pipeline` stages (replicated
    over the other mesh axes); 0 without delayed scaling."""
    if not delayed_config(cfg):
        return 0
    return 4 * math.prod(history_shape(cfg)) // cfg.mesh.pipeline


def initial_history(cfg) -> dict:
    """`state["fp8"]` at step 0: an empty history (all 0: scales of 1 until the first step's amaxes are in)."""
    return {HISTORY: jnp.zeros(history_shape(cfg), jnp.float32)}


def step_scales(cfg, history: jax.Array) -> jax.Array:
    """The scales [L, O, 3] this step quantises with, from the history [L, O, 3, W]
    (`jaxpar.parallel.fp8.history_scales`)."""
    fp8 = cfg.precision.fp8
    return history_scales(history, fp8.amax_compute, fp8.margin)


def with_scales(params: dict, scales_LO3: jax.Array, m: int) -> dict:
    """`params` with the scales `FP8_SCALES` [L, O, 3] and the amax probes `FP8_PROBES` (zeros [L, M, O, 3]) as
    leaves of the layer stack."""
    stack = params[STACK_ATTRIBUTE]
    probes = jnp.zeros((scales_LO3.shape[0], m, *scales_LO3.shape[1:]), jnp.float32)
    return {**params, STACK_ATTRIBUTE: {**stack, FP8_SCALES: scales_LO3, FP8_PROBES: probes}}


def split_scales(layers: dict) -> tuple[dict, tuple[jax.Array, jax.Array] | None]:
    """(the layer stack's tree without `FP8_SCALES` and `FP8_PROBES`, (those two leaves) or None)."""
    if FP8_SCALES not in layers:
        return layers, None
    rest = {k: a for k, a in layers.items() if k not in (FP8_SCALES, FP8_PROBES)}
    return rest, (layers[FP8_SCALES], layers[FP8_PROBES])


@contextlib.contextmanager
def stack_scales(fp8: tuple[jax.Array, jax.Array] | None, mb: dict) -> Iterator[None]:
    """Within the block, the layer stack's FP8 GEMMs quantise with the scales of `fp8` = (scales [L, O, 3],
    probes [L, M, O, 3]) and send their amaxes to microbatch `mb`'s slice of the probes (at its `SLOT`;
    `jaxpar.model.stack.fp8_stack_scales`). Nothing when `fp8` is None.

    Raises:
      ValueError: the microbatch carries no `SLOT`; the model's blocks do not run through `scan_layers`."""
    if fp8 is None:
        yield
        return
    if SLOT not in mb:
        raise ValueError(f"FP8 delayed scaling: a microbatch without its {SLOT!r} index among the step's")
    scales, probes = fp8
    probe = jax.lax.dynamic_index_in_dim(probes, mb[SLOT], axis=1, keepdims=False)
    with fp8_stack_scales(scales, probe) as read:
        yield
    if not read[1]:
        raise ValueError(
            "precision.fp8.scaling=delayed needs the model's blocks to run through jaxpar.model.scan_layers (which "
            "hands each layer its scales); set precision.fp8.scaling=current"
        )


def seen_amax(probes_grad_LMO3: jax.Array) -> jax.Array:
    """The amaxes [L, O, 3] the step's GEMMs saw: the max over the M microbatches of the probes' cotangents."""
    return jnp.max(probes_grad_LMO3.astype(jnp.float32), axis=1)


def next_history(state_fp8: dict, amax_LO3: jax.Array, applied: jax.Array) -> dict:
    """`state["fp8"]` after a step: the amaxes appended (`jaxpar.parallel.fp8.updated_history`: inf or NaN ones
    not written) where the step's update was `applied` (bool scalar), else unchanged."""
    history = state_fp8[HISTORY]
    return {HISTORY: jnp.where(applied, updated_history(history, amax_LO3), history)}
