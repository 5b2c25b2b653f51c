"""Checks of the `model.moe` section (`jaxpar.config.schema.MoEConfig`) against the rest of the config and the
resolved mesh. Called by `jaxpar.config.validate.validate_config`."""

from __future__ import annotations

import dataclasses
import logging
import math

from jaxpar.config.checks import check_choice, check_positive
from jaxpar.config.errors import ConfigError
from jaxpar.config.keys import example
from jaxpar.config.mesh_axes import CONTEXT, DATA_PARALLEL_AXES, PIPELINE, TENSOR
from jaxpar.config.schema import Config, ModelConfig, MoEConfig

log = logging.getLogger(__name__)

ROUTINGS = ("dropless", "capacity")
GATINGS = ("softmax", "sigmoid")  # model.moe.gating (`jaxpar.model.moe.route`)
EXPERT_AXES = DATA_PARALLEL_AXES  # the mesh axes experts may be split over: those that split the batch
ALL_TO_ALLS = ("auto", "ragged", "emulated")  # model.moe.all_to_all (`jaxpar.parallel.ragged`)
RAGGED_PLATFORMS = ("gpu", "tpu")  # the backends with a ragged all-to-all (XLA:CPU has none)


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


def _check_ranges(moe: MoEConfig) -> None:
    """The `model.moe` keys' own ranges and choices."""
    if moe.num_experts < 0 or moe.num_experts == 1:
        raise ConfigError(
            f"model.moe.num_experts={moe.num_experts} must be 0 (dense model) or at least 2; "
            f"{example('model.moe.num_experts')} (dense) or model.moe.num_experts=8"
        )
    check_positive("model.moe.top_k", moe.top_k)
    check_positive("model.moe.d_expert", moe.d_expert, allow_zero=True)  # 0: model.d_ff
    check_positive("model.moe.shared_experts", moe.shared_experts, allow_zero=True)
    check_positive("model.moe.every", moe.every)
    check_positive("model.moe.first_dense", moe.first_dense, allow_zero=True)
    check_choice("model.moe.routing", moe.routing, ROUTINGS)
    check_positive("model.moe.capacity_factor", moe.capacity_factor)
    check_positive("model.moe.receive_factor", moe.receive_factor, allow_zero=True)
    check_choice("model.moe.all_to_all", moe.all_to_all, ALL_TO_ALLS)
    check_positive("model.moe.aux_loss_weight", moe.aux_loss_weight, allow_zero=True)
    check_positive("model.moe.z_loss_weight", moe.z_loss_weight, allow_zero=True)
    check_choice("model.moe.gating", moe.gating, GATINGS)
    check_positive("model.moe.routed_scale", moe.routed_scale)
    check_positive("model.moe.bias_update_rate", moe.bias_update_rate, allow_zero=True)
    check_positive("model.moe.expert_groups", moe.expert_groups)
    check_positive("model.moe.group_top_k", moe.group_top_k, allow_zero=True)


def _check_gating(moe: MoEConfig) -> None:
    """The keys of DeepSeek-V3's routing (`jaxpar.model.moe.route`): those only sigmoid gating gives a meaning,
    and the expert groups of node-limited routing."""
    if moe.gating == "sigmoid" and moe.z_loss_weight > 0:
        raise ConfigError(
            f"model.moe.z_loss_weight={moe.z_loss_weight} with model.moe.gating=sigmoid: the router z-loss "
            f"penalises the softmax's log-partition, which sigmoid gates do not have; set model.moe.z_loss_weight=0 "
            f"(DeepSeek-V3 balances with model.moe.bias_update_rate and a small model.moe.aux_loss_weight)"
        )
    groups, chosen = moe.expert_groups, moe.group_top_k
    if moe.num_experts % groups:
        raise ConfigError(
            f"model.moe.expert_groups={groups} must divide model.moe.num_experts={moe.num_experts} (each group "
            f"holds num_experts / expert_groups experts); change one of them, or model.moe.expert_groups=1"
        )
    if chosen > groups:
        raise ConfigError(
            f"model.moe.group_top_k={chosen} must be at most model.moe.expert_groups={groups} (the groups a token "
            f"may route to; DeepSeek-V3: 4 of 8); lower it, or 0 for every group"
        )
    if chosen and moe.top_k > chosen * (moe.num_experts // groups):
        raise ConfigError(
            f"model.moe.top_k={moe.top_k} experts do not fit in model.moe.group_top_k={chosen} groups of "
            f"{moe.num_experts // groups} experts; raise model.moe.group_top_k or lower model.moe.top_k"
        )
    if moe.gating != "sigmoid" and moe.bias_update_rate > 0:
        raise ConfigError(
            f"model.moe.bias_update_rate={moe.bias_update_rate} with model.moe.gating={moe.gating}: the balancing "
            f"bias is DeepSeek-V3's, added to sigmoid affinities; set model.moe.gating=sigmoid or "
            f"model.moe.bias_update_rate=0"
        )


def _warn_receive_factor(moe: MoEConfig, shape: dict[str, int]) -> None:
    """A warning when `model.moe.receive_factor` is set where it sizes nothing: it is the receive buffer of
    dropless routing's all-to-all over expert axes of size > 1."""
    if moe.receive_factor and (
        not moe.enabled or moe.routing != "dropless" or expert_parallel_size(moe.expert_axes, shape) == 1
    ):
        log.warning(
            "model.moe.receive_factor=%s has no effect: it sizes the receive buffer of dropless routing's "
            "all-to-all over model.moe.expert_axes (here num_experts=%d, routing=%s, expert_axes=%s)",
            moe.receive_factor,
            moe.num_experts,
            moe.routing,
            list(moe.expert_axes),
        )


def resolve_all_to_all(all_to_all: str, platform: str) -> str:
    """The transport `model.moe.all_to_all` means on `platform` (`gpu`, `tpu`, `cpu`, as `jax.default_backend()`
    names them): `ragged` or `emulated` (`jaxpar.parallel.ragged`). `auto` is ragged on `RAGGED_PLATFORMS`, else
    emulated.

    Raises:
      ConfigError: `ragged` on a platform without a ragged all-to-all (the message names the fix).
    """
    if all_to_all == "auto":
        return "ragged" if platform in RAGGED_PLATFORMS else "emulated"
    if all_to_all == "ragged" and platform not in RAGGED_PLATFORMS:
        raise ConfigError(
            f"model.moe.all_to_all=ragged needs a backend with a ragged all-to-all (GPU, TPU) and this step runs on "
            f"{platform} (XLA:CPU has none); set model.moe.all_to_all=auto (ragged on GPU and TPU, emulated "
            f"elsewhere) or emulated"
        )
    return all_to_all


def check_moe(cfg: Config, shape: dict[str, int]) -> None:
    """Ranges of the `model.moe` keys and how they fit the mesh.

    Args:
      cfg: the config.
      shape: the resolved mesh shape {data, fsdp, tensor, pipeline, context}.

    Raises:
      ConfigError: a key out of range, `model.moe.every` not dividing `model.n_layers`, MoE units
        (n_layers / every) that do not split evenly into the pipeline's mesh.pipeline * pipeline.virtual_stages
        model chunks, or `model.moe.expert_axes` naming another axis than data or fsdp, an axis twice, or axes
        whose sizes' product does not divide num_experts, or capacity routing with mesh.context > 1, or a
        z-loss weight with sigmoid gating or a balancing-bias rate without it, or expert groups that do not
        divide num_experts or hold fewer than top_k experts in group_top_k groups; the message names the fix. (A
        model family without MoE support is refused when its model is built: `jaxpar.model.interface.check_model`.)
    """
    moe, m = cfg.model.moe, cfg.model
    _check_ranges(moe)  # also for a dense model: a value out of range is never meant
    check_expert_axes(moe.expert_axes, moe.num_experts, shape)
    _warn_receive_factor(moe, shape)
    if moe.num_experts == 0:
        if moe.expert_axes:
            log.warning(
                "model.moe.expert_axes=%s has no effect: model.moe.num_experts=0 makes the model dense",
                list(moe.expert_axes),
            )
        return
    _check_gating(moe)
    if moe.top_k > moe.num_experts:
        raise ConfigError(
            f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.num_experts={moe.num_experts}; lower "
            f"model.moe.top_k or raise model.moe.num_experts"
        )
    if moe.first_dense >= m.n_layers:
        raise ConfigError(
            f"model.moe.first_dense={moe.first_dense} leaves no MoE block of model.n_layers={m.n_layers}; lower "
            f"it (DeepSeek-V3: 3 of 61) or set model.moe.num_experts=0 for a dense model"
        )
    if moe.first_dense and cfg.precision.fp8.enabled and cfg.precision.fp8.scaling == "delayed":
        raise ConfigError(
            f"model.moe.first_dense={moe.first_dense} with precision.fp8.scaling=delayed: delayed scales are kept "
            f"per row of the layer stack, and the first dense blocks run before it; use "
            f"precision.fp8.scaling=current or model.moe.first_dense=0"
        )
    stacked = m.stacked_layers
    first = f"model.n_layers - model.moe.first_dense = {m.n_layers} - {moe.first_dense} = {stacked}"
    stack = first if moe.first_dense else f"model.n_layers={m.n_layers}"
    if stacked % moe.every:
        raise ConfigError(
            f"model.moe.every={moe.every} must divide {stack} (the layer stack's unit is a group of `every` blocks "
            f"whose last one is MoE); change one of them"
        )
    stages, v = shape[PIPELINE], cfg.pipeline.virtual_stages
    units = stacked // moe.every
    uneven = bool(cfg.pipeline.stage_layers or cfg.pipeline.balance_stages)
    # an uneven split stores the units over the stages with zero rows where they do not divide them
    # (`jaxpar.parallel.layer_split.stored_rows`); the chunks' own counts are checked there
    if stages > 1 and not uneven and units % (stages * v):
        if moe.first_dense:
            what = f"(model.n_layers - model.moe.first_dense) / model.moe.every = ({m.n_layers} - {moe.first_dense})"
        else:
            what = f"model.n_layers / model.moe.every = {m.n_layers}"
        raise ConfigError(
            f"{what} / {moe.every} = {units} MoE units (the layer stack's depth: each "
            f"unit is `every` blocks whose last one is MoE) must be divisible by mesh.pipeline * "
            f"pipeline.virtual_stages = {stages} * {v} = {stages * v} (each stage holds whole units); change "
            f"model.n_layers, model.moe.every, model.moe.first_dense, mesh.pipeline or pipeline.virtual_stages, or "
            f"set pipeline.balance_stages=true (stages of unequal depth)"
        )
    if moe.routing == "capacity" and shape.get(CONTEXT, 1) > 1:
        raise ConfigError(
            f"model.moe.routing=capacity with mesh.context={shape[CONTEXT]}: capacity routing fills each expert's "
            f"queue in sequence order over the whole sequence, and context parallelism splits the sequence over "
            f"devices (not supported yet); use model.moe.routing=dropless, or mesh.context=1"
        )
    d_expert = moe.d_expert or m.d_ff
    tp = shape[TENSOR]
    if tp > 1 and d_expert % tp:
        raise ConfigError(
            f"the experts' hidden width {d_expert} (model.moe.d_expert, or model.d_ff when 0) must be divisible "
            f"by mesh.tensor={tp}; change it or lower mesh.tensor"
        )
