"""Checks of the `model.moe` section (`jaxpar.config.schema.MoEConfig`) against the rest of the config and the
resolved mesh. Called by `jaxpar.config.validate.validate_config`."""

from __future__ import annotations

import dataclasses
import logging
import math

from jaxpar.config.errors import ConfigError
from jaxpar.config.mesh_axes import DATA_PARALLEL_AXES, PIPELINE, TENSOR
from jaxpar.config.schema import Config, ModelConfig

log = logging.getLogger(__name__)

ROUTINGS = ("dropless", "capacity")
EXPERT_AXES = DATA_PARALLEL_AXES  # the mesh axes experts may be split over: those that split the batch


def without_expert_axes(model: ModelConfig) -> ModelConfig:
    """`model` with `moe.expert_axes` cleared: what the parameters are, whatever devices the experts sit on
    (a checkpoint restores onto other expert axes as onto another mesh)."""
    return dataclasses.replace(model, moe=dataclasses.replace(model.moe, expert_axes=()))


def expert_parallel_size(expert_axes: tuple[str, ...], shape: dict[str, int]) -> int:
    """ep: the product of the sizes of `model.moe.expert_axes` on the mesh `shape` (1 without expert parallelism)."""
    return math.prod(shape[a] for a in expert_axes)


def check_expert_axes(expert_axes: tuple[str, ...], num_experts: int, shape: dict[str, int]) -> None:
    """`model.moe.expert_axes` names distinct axes among `EXPERT_AXES` whose sizes' product divides num_experts
    (not checked for a dense model, num_experts = 0).

    Raises:
      ConfigError: naming the key and the fix.
    """
    for axis in expert_axes:
        if axis not in EXPERT_AXES:
            raise ConfigError(
                f"model.moe.expert_axes names {axis!r}; experts are split over the axes that split the batch, "
                f"{' and '.join(EXPERT_AXES)} (e.g. model.moe.expert_axes=[fsdp]); tensor splits each expert's "
                f"hidden width and pipeline splits the layers"
            )
    if len(set(expert_axes)) != len(expert_axes):
        raise ConfigError(f"model.moe.expert_axes={list(expert_axes)} names an axis twice; name each once")
    if num_experts == 0:
        return
    ep = expert_parallel_size(expert_axes, shape)
    if num_experts % ep:
        sizes = " x ".join(f"mesh.{a}={shape[a]}" for a in expert_axes)
        raise ConfigError(
            f"model.moe.num_experts={num_experts} does not split over model.moe.expert_axes={list(expert_axes)} "
            f"({sizes} = {ep} expert-parallel ranks); make the expert count a multiple of {ep} or change the axes"
        )


def check_moe(cfg: Config, shape: dict[str, int]) -> None:
    """Ranges of the `model.moe` keys and how they fit the mesh.

    Args:
      cfg: the config.
      shape: the resolved mesh shape {data, fsdp, tensor, pipeline}.

    Raises:
      ConfigError: a key out of range, `model.moe.every` not dividing `model.n_layers`, MoE units
        (n_layers / every) that do not split evenly into the pipeline's mesh.pipeline * pipeline.virtual_stages
        model chunks, or `model.moe.expert_axes` naming another axis than data or fsdp, an axis twice, or axes
        whose sizes' product does not divide num_experts; the message names the fix. (A model family without
        MoE support is refused when its model is built: `jaxpar.model.interface.check_model`.)
    """
    moe, m = cfg.model.moe, cfg.model
    check_expert_axes(moe.expert_axes, moe.num_experts, shape)
    if moe.num_experts == 0:
        if moe.expert_axes:
            log.warning(
                "model.moe.expert_axes=%s has no effect: model.moe.num_experts=0 makes the model dense",
                list(moe.expert_axes),
            )
        return
    if moe.num_experts < 2:
        raise ConfigError(f"model.moe.num_experts={moe.num_experts} must be 0 (dense model) or at least 2; change it")
    if not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.num_experts={moe.num_experts}")
    for key in ("d_expert", "shared_experts"):
        if getattr(moe, key) < 0:
            raise ConfigError(f"model.moe.{key}={getattr(moe, key)} must be >= 0")
    if moe.every < 1 or m.n_layers % moe.every:
        raise ConfigError(
            f"model.moe.every={moe.every} must be >= 1 and divide model.n_layers={m.n_layers} (the layer stack's "
            f"unit is a group of `every` blocks whose last one is MoE); change one of them"
        )
    if moe.routing not in ROUTINGS:
        raise ConfigError(f"model.moe.routing={moe.routing!r} is not one of {', '.join(ROUTINGS)}")
    for key in ("capacity_factor", "aux_loss_weight", "z_loss_weight"):
        value = getattr(moe, key)
        if value != value or value in (float("inf"), float("-inf")) or value < 0:
            raise ConfigError(f"model.moe.{key}={value} must be a finite number >= 0")
    if moe.capacity_factor == 0:
        raise ConfigError("model.moe.capacity_factor must be > 0 (1.25 is common)")
    stages, v = shape[PIPELINE], cfg.pipeline.virtual_stages
    units = m.n_layers // moe.every
    if stages > 1 and units % (stages * v):
        raise ConfigError(
            f"model.n_layers / model.moe.every = {m.n_layers} / {moe.every} = {units} MoE units (the layer "
            f"stack's depth: each unit is `every` blocks whose last one is MoE) must be divisible by mesh.pipeline "
            f"* pipeline.virtual_stages = {stages} * {v} = {stages * v} (each stage holds whole units); change "
            f"model.n_layers, model.moe.every, mesh.pipeline or pipeline.virtual_stages"
        )
    d_expert = moe.d_expert or m.d_ff
    tp = shape[TENSOR]
    if tp > 1 and d_expert % tp:
        raise ConfigError(
            f"the experts' hidden width {d_expert} (model.moe.d_expert, or model.d_ff when 0) must be divisible "
            f"by mesh.tensor={tp}; change it or lower mesh.tensor"
        )
