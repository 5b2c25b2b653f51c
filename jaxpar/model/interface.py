"""What jaxpar needs from a model: the `LanguageModel` interface, and the check that a model follows it.

Shape letters: B batch, T sequence (T/t under sequence parallelism), D model width (`ModelConfig.d_model`),
V vocabulary (V/t: this tensor rank's shard), L layers, t tensor-parallel size.

A model is any Flax NNX module with

* parameters only: every variable is an `nnx.Param` carrying `logical_axes`, one name per dimension from the
  keys of `jaxpar.parallel.sharding.PARAM_RULES` (embed, vocab, heads, kv, mlp, experts) or None (a dimension never
  sharded, e.g. a position table's rows). `embed` is the dimension fsdp and ZeRO shard; vocab, heads and mlp are split
  over `tensor`, so the model's code must work on those shards (build it from `jaxpar.model.layers` and
  `jaxpar.parallel.tensor`'s column/row-parallel ops, which read their widths from the weights they hold);
* a `blocks` attribute: its layers stacked on a leading dimension of size `ModelConfig.n_layers`
  (`jaxpar.model.stack.stack_layers`). That dimension gets the logical name `layers` and is split over
  `pipeline` into stages; nothing outside `blocks` may have it;
* three methods, the parts a pipeline stage runs (the first stage embeds, every stage runs its blocks, the last
  computes the logits and the loss), each taking the `gather` hook (all-gathers fsdp-sharded weights: apply it to
  every submodule right before use) and the `TensorParallel` context `tp`:
    embed_tokens(tokens [B, T] int32, dtype, gather, tp) -> activations [B, T or T/t, D] in `dtype`
    run_blocks(x [B, T or T/t, D], gather, tp[, segment_ids]) -> [B, T or T/t, D] (this module's layers: a
      stage's share). A batch of packed documents carries `segment_ids` int32 [B, T] (whole sequence, also under
      sequence parallelism); the step passes them as the fourth argument, and only then, so a model without
      document masking need not take it. `jaxpar.model.attention.dot_product_attention` honours them.
      Under context parallelism (`mesh.context` > 1) T is this device's slice of each sequence, and run_blocks
      must take a keyword `positions_BT` (int32 [B, T]: the slice's rotary positions, which the step computes
      from the whole sequence) and run attention through `tp.context` (`jaxpar.parallel.context`), as
      `jaxpar.model.layers.Attention` does.
    logits(x [B, T or T/t, D], gather, tp) -> [B, T, V/t]
  and `__call__(tokens, dtype, gather, tp)` = logits(run_blocks(embed_tokens(...))).
* with `model.moe` (num_experts > 0), a fourth method, used instead of run_blocks in training:
    run_blocks_with_stats(x, gather, tp[, segment_ids]) -> (x, router statistics)
  whose statistics are those of the `jaxpar.model.moe.MoE` layers the blocks hold, stacked on a leading
  dimension of size `ModelConfig.stack_depth` (`scan_layers(..., with_aux=True)` stacks what each layer returns
  beside its output). With `model.moe.every` > 1 the stack's unit is a group of `every` blocks (`stack_depth` =
  n_layers / every); a model may instead require every = 1.

Activations between the parts are [B, T, D] in the compute dtype, or [B, T/t, D] with sequence parallelism
(`tp.sequence_parallel`: the embedding's `tp.exit` reduce-scatters over the sequence; `tp.sequence_start`
gives this rank's first position).
"""

from __future__ import annotations

import inspect
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config.schema import STACK_ATTRIBUTE  # noqa: F401  (re-exported: the attribute holding the layer stack)
from jaxpar.model.stack import Gather
from jaxpar.parallel.sharding import PARAM_RULES
from jaxpar.parallel.tensor import TensorParallel

LAYERS_AXIS = "layers"  # the logical name of its leading dimension
PARTS = ("embed_tokens", "run_blocks", "logits")
MOE_PART = "run_blocks_with_stats"  # the part a model with model.moe adds


@runtime_checkable
class LanguageModel(Protocol):
    """The interface of a jaxpar model (module docstring)."""

    blocks: nnx.Module

    def embed_tokens(self, tokens_BT: jax.Array, dtype: jnp.dtype, gather: Gather, tp: TensorParallel) -> jax.Array: ...

    def run_blocks(
        self, x_BTD: jax.Array, gather: Gather, tp: TensorParallel, segment_ids_BT: jax.Array | None = None
    ) -> jax.Array: ...

    def logits(self, x_BTD: jax.Array, gather: Gather, tp: TensorParallel) -> jax.Array: ...

    def __call__(self, tokens_BT: jax.Array, dtype: jnp.dtype, gather: Gather, tp: TensorParallel) -> jax.Array: ...


def _path(path) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def takes_segment_ids(model: LanguageModel) -> bool:
    """Whether `model.run_blocks` takes packed-document segment ids: a fourth positional parameter, or *args."""
    try:
        params = list(inspect.signature(model.run_blocks).parameters.values())
    except (TypeError, ValueError):  # a callable without a signature: trust it
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 4 or any(p.kind == p.VAR_POSITIONAL for p in params)


def takes_positions(model: LanguageModel) -> bool:
    """Whether `model.run_blocks` takes the rotary positions context parallelism passes: a parameter named
    `positions_BT`. **kwargs does not count: a model that swallowed them would attend within its slice alone and
    train wrong without a word."""
    try:
        params = inspect.signature(model.run_blocks).parameters
    except (TypeError, ValueError):  # a callable without a signature: trust it
        return True
    return "positions_BT" in params


def check_model(model: LanguageModel, name: str, n_layers: int, moe: bool = False) -> None:
    """Checks that `model` (abstract is enough: `nnx.eval_shape`) follows the interface.

    Args:
      model: the built module.
      name: its family's name, for the messages.
      n_layers: `ModelConfig.stack_depth`, the depth the stack must have.
      moe: the config has `model.moe` on (the model must provide `run_blocks_with_stats`).

    Raises:
      TypeError: a missing part or `blocks` (or `run_blocks_with_stats` with `moe`), a variable that is not an
        `nnx.Param`, or a parameter without well-formed `logical_axes`.
      ValueError: a logical axis name jaxpar does not shard by, or a `blocks` parameter whose leading dimension
        is not `n_layers`.
    """
    where = f"model {name!r} ({type(model).__name__})"
    missing = [part for part in PARTS if not callable(getattr(model, part, None))]
    if missing:
        raise TypeError(
            f"{where} lacks {', '.join(missing)}: a jaxpar model has embed_tokens, run_blocks and "
            f"logits (see jaxpar.model.interface)"
        )
    if moe and not callable(getattr(model, MOE_PART, None)):
        raise TypeError(
            f"{where} has no {MOE_PART}, which model.moe needs (the router statistics of its MoE layers for the "
            f"auxiliary losses, see jaxpar.model.interface); add it, or set model.moe.num_experts=0"
        )
    if not isinstance(getattr(model, STACK_ATTRIBUTE, None), nnx.Module):
        raise TypeError(
            f"{where} has no `{STACK_ATTRIBUTE}` module: stack its layers with "
            f"jaxpar.model.stack.stack_layers and keep them in `{STACK_ATTRIBUTE}`"
        )
    allowed = sorted(k for k in PARAM_RULES if k != LAYERS_AXIS)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        at = _path(path)
        if not isinstance(var, nnx.Param):
            raise TypeError(
                f"{where}: {at} is an {type(var).__name__}; jaxpar trains modules whose state is "
                f"nnx.Param only (no RNG or batch-statistics state: draw randomness outside)"
            )
        axes = var.get_metadata().get("logical_axes")
        shape = tuple(var.get_value().shape)
        stacked = str(getattr(path[0], "key", path[0])) == STACK_ATTRIBUTE
        if stacked and (not shape or shape[0] != n_layers):
            raise ValueError(
                f"{where}: parameter {at} of shape {shape} has no leading layers dimension of "
                f"model.n_layers={n_layers}; create the layers with stack_layers"
            )
        per_layer = shape[1:] if stacked else shape
        if not isinstance(axes, tuple | list) or len(axes) != len(per_layer):
            raise TypeError(
                f"{where}: parameter {at} of shape {per_layer}{' per layer' if stacked else ''} needs "
                f"logical_axes, one name per dimension, e.g. nnx.Param(value, logical_axes=('embed', "
                f"'mlp')); got {axes!r}"
            )
        bad = [a for a in axes if a is not None and a not in allowed]
        if bad:
            raise ValueError(
                f"{where}: parameter {at} has logical axes {tuple(axes)}; names must be None or one "
                f"of {allowed} ({LAYERS_AXIS!r} is added to the stacked `{STACK_ATTRIBUTE}`)"
            )
