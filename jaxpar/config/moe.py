"""Checks of the `model.moe` section (`jaxpar.config.schema.MoEConfig`) against the rest of the config and the
resolved mesh. Called by `jaxpar.config.validate.validate_config`."""

from __future__ import annotations

import math

from jaxpar.config.errors import ConfigError
from jaxpar.config.mesh_axes import DATA_PARALLEL_AXES
from jaxpar.config.schema import Config

ROUTINGS = ("dropless", "capacity")


def check_moe(cfg: Config, shape: dict[str, int], sequence_parallel: bool) -> None:
    """Ranges of the `model.moe` keys and the layouts MoE does not run on yet.

    Args:
      cfg: the config.
      shape: the resolved mesh shape {data, fsdp, tensor, pipeline}.
      sequence_parallel: whether the run resolves `tensor.sequence_parallel` to on.

    Raises:
      ConfigError: a key out of range, `model.moe.every` not dividing `model.n_layers`, `model.moe.expert_axes`
        naming an axis other than data and fsdp or one twice, or an expert-parallel size ep (the product of those
        axes' sizes) not dividing `model.moe.num_experts`, a model family other
        than the built-in llama, or MoE with mesh.pipeline > 1 or with sequence parallelism (not supported yet;
        the message names the fix).
    """
    moe, m = cfg.model.moe, cfg.model
    if moe.num_experts == 0:
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
    axes = moe.expert_axes
    for axis in axes:
        if axis not in DATA_PARALLEL_AXES:
            raise ConfigError(
                f"model.moe.expert_axes={list(axes)}: {axis!r} is not one of {', '.join(DATA_PARALLEL_AXES)} (the "
                f"axes that split the batch); name those, e.g. [fsdp]"
            )
    if len(set(axes)) != len(axes):
        raise ConfigError(f"model.moe.expert_axes={list(axes)} names an axis twice; name each once")
    ep = math.prod(shape[a] for a in axes)
    if moe.num_experts % ep:
        raise ConfigError(
            f"model.moe.num_experts={moe.num_experts} must be divisible by the expert-parallel size {ep} (the "
            f"product of mesh.{' x mesh.'.join(axes)}, model.moe.expert_axes={list(axes)}); change the experts, "
            f"the mesh or the expert axes"
        )
    if m.name != "llama":
        raise ConfigError(
            f"model.moe is read by the built-in llama family only, not by model.name={m.name!r}; remove the "
            f"model.moe section or set model.name=llama"
        )
    if shape["pipeline"] > 1:
        raise ConfigError(
            f"model.moe with mesh.pipeline={shape['pipeline']} is not supported yet (the pipeline stages do not "
            f"carry the MoE auxiliary losses); set mesh.pipeline=1 and use data, fsdp or tensor"
        )
    if sequence_parallel:
        raise ConfigError(
            "model.moe with tensor.sequence_parallel=true is not supported yet (the router sees the block input "
            "before the tensor all-gather); set tensor.sequence_parallel=false (its default with model.moe)"
        )
    d_expert = moe.d_expert or m.d_ff
    tp = shape["tensor"]
    if tp > 1 and d_expert % tp:
        raise ConfigError(
            f"the experts' hidden width {d_expert} (model.moe.d_expert, or model.d_ff when 0) must be divisible "
            f"by mesh.tensor={tp}; change it or lower mesh.tensor"
        )
