"""The step plan: everything static about the train step of one config on one mesh, derived once, with no device
work (`build_plan`).

The plan is where the config's platform-dependent choices are made, once, from the mesh's devices (their
`platform`, so a step compiled ahead of time for GPUs on a CPU host, `jaxpar.analysis.gpu.deviceless`, is planned
as on the GPUs): `precision.compute_dtype: auto` (`jaxpar.config.precision.resolve_compute_dtype`) and
`model.attention` (`jaxpar.config.attention.resolve_attention`). Everything downstream (the step, the loop, the
saved config) reads the plan's resolved values.

Shape letters: B here the rows of the global batch (`train.global_batch_size`), split over data x fsdp.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config.attention import resolve_attention
from jaxpar.config.errors import ConfigError
from jaxpar.config.mesh_axes import CONTEXT, PIPELINE, TENSOR, TOKEN_AXES
from jaxpar.config.mesh_shape import resolve_mesh_shape
from jaxpar.config.moe import check_moe, resolve_all_to_all, without_expert_axes
from jaxpar.config.precision import (
    PrecisionLayout,
    check_fp8_capability,
    precision_layout,
    resolve_compute_dtype,
)
from jaxpar.config.schema import Config, ModelConfig
from jaxpar.config.validate import check_context, sequence_parallel
from jaxpar.model import ModelDef, init_params, model_def
from jaxpar.parallel.context import ContextParallel
from jaxpar.parallel.fp8 import NO_FP8, Fp8, cpu_fp8_error
from jaxpar.parallel.layer_split import stored_rows
from jaxpar.parallel.mesh import MESH_AXES
from jaxpar.parallel.sharding import activation_spec, dim_axes, named, opt_state_specs, param_specs
from jaxpar.parallel.tensor import TensorParallel
from jaxpar.training import fp8_history
from jaxpar.training.fp8_history import gemm_sites
from jaxpar.training.loss import LossFn, VocabParallelLoss, check_loss_fn, cross_entropy
from jaxpar.training.optimizer import (
    build_optimizer,
    check_weight_decay_exclude,
    learning_rate_schedule,
    nonfinite_state,
    schedule_count,
)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Everything static about the step on one mesh: model structure, optimizer, precision, specs and shardings.

    Attributes:
      cfg: the config, with `precision.compute_dtype` resolved for `platform` (never `auto`): what a run saves
        as its config.yaml.
      mdef: the model, with `model.attention` resolved for `platform` and `model.moe.expert_axes` cut to the
        mesh axes of size > 1.
      logical: the parameters' logical axes (`jaxpar.model.ModelDef.logical_axes`).
      tx: the optimizer (`build_plan`'s `optimizer`, else the config's AdamW).
      schedule: what the `learning_rate` metric reports: a schedule (count -> rate), a constant rate, or None
        (no such metric).
      platform: the mesh's devices' platform ("cpu", "gpu", "tpu"), from which the precision and attention
        were resolved.
      layout: what `precision.layout` means (`jaxpar.config.precision.PrecisionLayout`).
      compute_dtype, reduce_dtype, param_dtype: jnp dtypes of activations and gathered weights, of the gradient
        reductions, and of the working parameters and the step's gradients.
      specs: PartitionSpec trees for "params", "grads" and "opt_state" (also used for the fp32 master copy);
        the optimizer state's own specs are in `state_shardings["opt_state"]`.
      state_shardings: NamedSharding tree matching `jaxpar.training.state.init_state`'s output.
      batch_sharding: NamedSharding of each [B, T] batch array (rows over data x fsdp).
      loss_fn: the training loss (`jaxpar.training.loss`; default `cross_entropy`).
    """

    cfg: Config
    mesh: Mesh
    mdef: ModelDef
    logical: dict
    tx: optax.GradientTransformation
    schedule: optax.Schedule | float | None
    platform: str
    layout: PrecisionLayout
    compute_dtype: Any
    reduce_dtype: Any
    param_dtype: Any
    specs: dict
    state_shardings: dict
    batch_sharding: NamedSharding
    loss_fn: LossFn = cross_entropy

    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(self.mesh.shape)

    @property
    def context(self) -> ContextParallel:
        """Context parallelism over the `context` axis (`jaxpar.parallel.context`; inactive at size 1)."""
        return ContextParallel(size=self.mesh_shape[CONTEXT], strategy=self.cfg.context.strategy)

    @property
    def fp8(self) -> Fp8:
        """FP8 GEMMs in the dense layers (`precision.fp8`, `jaxpar.parallel.fp8`): their activations' scales
        max-reduced over the token axes of size > 1; inactive when off."""
        fp8 = self.cfg.precision.fp8
        if not fp8.enabled:
            return NO_FP8
        shape = self.mesh_shape
        axes = tuple(a for a in TOKEN_AXES if shape[a] > 1)
        return Fp8(active=True, token_axes=axes, margin=fp8.margin, delayed=fp8.scaling == "delayed")

    @property
    def stack_rows(self) -> int:
        """Rows the layer stack is stored with: `model`'s stack depth rounded up to a multiple of mesh.pipeline
        (`jaxpar.parallel.layer_split.stored_rows`; zero rows after the last layer when the stages do not
        divide it)."""
        return stored_rows(self.cfg.model.stack_depth, self.mesh_shape[PIPELINE])

    @property
    def tensor_parallel(self) -> TensorParallel:
        size = self.mesh_shape[TENSOR]
        sp = sequence_parallel(self.cfg, size)
        return TensorParallel(size=size, sequence_parallel=sp, context=self.context, fp8=self.fp8)

    @functools.cached_property
    def global_mdef(self) -> ModelDef:
        """The model for use on global arrays outside the step's shard_map (sampling, a compiler-partitioned
        baseline): `mdef` without expert parallelism, whose all-to-alls need the shard_map's axes. Same
        parameters."""
        return model_def(without_expert_axes(self.mdef.cfg)) if self.expert_axes else self.mdef

    @property
    def expert_axes(self) -> tuple[str, ...]:
        """The mesh axes of size > 1 the experts are split over (`model.moe.expert_axes` in mesh order; () without
        expert parallelism)."""
        return self.mdef.cfg.moe.expert_axes

    @property
    def attention(self) -> str:
        """The attention implementation the step runs, `xla` or `cudnn` (`model.attention` resolved)."""
        return self.mdef.cfg.attention

    @property
    def has_master(self) -> bool:
        """Whether the state keeps an fp32 master copy of the parameters (the `16p` layout)."""
        return self.layout.master


def build_plan(
    cfg: Config,
    mesh: Mesh,
    *,
    loss_fn: LossFn | None = None,
    optimizer: optax.GradientTransformation | None = None,
    learning_rate: optax.Schedule | float | None = None,
) -> StepPlan:
    """Derives model structure, precision, optimizer and every sharding for `cfg` on `mesh` (no device work).

    Args:
      cfg: the run config.
      mesh: the device mesh (`jaxpar.parallel.mesh.build_mesh`); its devices' platform resolves
        `precision.compute_dtype: auto` and `model.attention: auto` (module docstring).
      loss_fn: the training loss, a `jaxpar.training.loss.VocabParallelLoss` or a plain function
        `(logits [b, T, V], batch) -> summed fp32 loss` (see `jaxpar.training.loss` for how each sees the logits
        under tensor parallelism and how the step normalises). Default: next-token cross-entropy.
      optimizer: any `optax.GradientTransformation` (e.g. `optax.lion`, `optax.adafactor`,
        `optax.multi_transform`), used as given: then the `optimizer.*` config keys other than `zero_stage` are
        not read (learning rate, schedule, clipping, weight decay are the transformation's own). Wrap it in
        `jaxpar.training.optimizer.skip_nonfinite` to skip and count non-finite updates as the default does; only
        then does the step report `bad_steps_in_a_row` and `skipped_steps`. Its state is sharded by
        `jaxpar.parallel.sharding.opt_state_specs`: parameter-shaped leaves as the parameters' optimizer state (over
        `data` too from ZeRO-1), everything else (counts, Adafactor's factored statistics) replicated.
        Default: the config's AdamW with its schedule, clipping and the non-finite skip.
      learning_rate: only with `optimizer`: what the `learning_rate` metric reports. A schedule (count ->
        rate, the one the optimizer was given) is read at the optimizer's own update count, which needs
        exactly one `optax.ScaleByScheduleState` in its state (an optax optimizer given a callable learning
        rate keeps one); a number is reported as is. Either reads 0.0 on an update a `skip_nonfinite` wrapper
        skipped. None (the default with `optimizer`): no `learning_rate` metric.

    Raises:
      ConfigError: a mesh that is not the config's; `model.attention=cudnn` where cuDNN cannot run; a parameter
        width the mesh does not divide; `mesh.pipeline > 1` on CPU with jax's persistent compilation cache on
        (`_check_compilation_cache` says why); with the default optimizer, an `optimizer.weight_decay_exclude`
        pattern that matches no parameter name (`jaxpar.training.optimizer.check_weight_decay_exclude`);
        `precision.fp8.enabled` where FP8 GEMMs cannot run (`_check_fp8`).
      TypeError: `optimizer` is not an `optax.GradientTransformation`; `loss_fn` fails on abstract inputs or
        returns no real scalar (`jaxpar.training.loss.check_loss_fn`).
      ValueError: `learning_rate` without `optimizer`; a schedule `learning_rate` with an optimizer state that
        holds no or several schedule states; an optimizer state with nested `skip_nonfinite` wrappers.
    """
    shape = _check_mesh(cfg, mesh)
    check_moe(cfg, shape)
    check_context(cfg, shape[CONTEXT], shape[TENSOR], shape[PIPELINE])
    platform = mesh.devices.flat[0].platform
    _check_compilation_cache(mesh, platform)
    cfg = _resolved_precision(cfg, platform)
    _check_fp8(cfg, mesh, platform)
    mdef = model_def(_resolved_model(cfg, mesh, platform))
    if shape[CONTEXT] > 1 and not mdef.takes_positions:
        raise ConfigError(
            f"mesh.context={shape[CONTEXT]}: the run_blocks of model {cfg.model.name!r} takes no positions_BT, which "
            f"context parallelism passes (each device's slice of the rotary positions; its attention must run "
            f"through tp.context, jaxpar.model.interface); set mesh.context=1, or add them"
        )
    logical = mdef.logical_axes()
    specs = {
        kind: param_specs(logical, kind, cfg.optimizer.zero_stage, mdef.cfg.moe.expert_axes)
        for kind in ("params", "grads", "opt_state")
    }
    tx, schedule = _optimizer(cfg, logical, optimizer, learning_rate)
    if loss_fn is None:
        loss_fn = cross_entropy
    else:
        check_loss_fn(loss_fn, cfg.data.seq_len, cfg.model.vocab_size)
        if cfg.pipeline.vocab_parallel and not isinstance(loss_fn, VocabParallelLoss):
            raise ConfigError(
                "pipeline.vocab_parallel splits the logits over the stages, and this loss_fn takes the full logits: "
                "give a jaxpar.training.loss.VocabParallelLoss, or set pipeline.vocab_parallel=false"
            )
    layout = precision_layout(cfg.precision.layout)
    state_specs = _state_specs(cfg, tx, schedule, logical, specs, layout, dict(mesh.shape))
    return StepPlan(
        cfg=cfg,
        mesh=mesh,
        mdef=mdef,
        logical=logical,
        tx=tx,
        schedule=schedule,
        platform=platform,
        layout=layout,
        compute_dtype=jnp.dtype(cfg.precision.compute_dtype),
        reduce_dtype=jnp.dtype(cfg.precision.reduce_dtype),
        param_dtype=jnp.dtype(layout.param_dtype),
        specs=specs,
        state_shardings=named(mesh, state_specs),
        batch_sharding=NamedSharding(mesh, activation_spec("batch", "seq")),
        loss_fn=loss_fn,
    )


def _check_fp8(cfg: Config, mesh: Mesh, platform: str) -> None:
    """Refuses `precision.fp8.enabled` where FP8 GEMMs cannot run: an NVIDIA GPU without FP8 tensor cores
    (compute capability below `FP8_MIN_CAPABILITY`, e.g. A100: XLA would run the GEMMs upcast, slower than bf16),
    a TPU (not supported), or an XLA:CPU that cannot compile FP8 conversions (`jaxpar.parallel.fp8.cpu_fp8_error`);
    and delayed scaling for a model family that does not say how many GEMMs a layer runs. Before any device work
    but the CPU's probe."""
    if not cfg.precision.fp8.enabled:
        return
    if cfg.precision.fp8.scaling == "delayed":
        try:
            gemm_sites(cfg.model)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    device = mesh.devices.flat[0]
    if platform == "gpu":
        capability = device_capability(device)
        if capability is not None:
            check_fp8_capability(device.device_kind, capability)
    elif platform == "tpu":
        raise ConfigError(
            "precision.fp8.enabled=true: FP8 GEMMs are built for NVIDIA GPUs with FP8 tensor cores (and run on CPU "
            "for tests); on TPU they are not supported; set precision.fp8.enabled=false"
        )
    elif platform == "cpu":
        error = cpu_fp8_error()
        if error is not None:
            raise ConfigError(
                f"precision.fp8.enabled=true: XLA:CPU here cannot compile FP8 conversions ({error}; it converts "
                f"E5M2 through half precision, whose routines it cannot link for a CPU without F16C, as under "
                f"--xla_cpu_max_isa=SSE4_2 with --xla_backend_optimization_level=0); run on a GPU, drop those "
                f"XLA_FLAGS, or set precision.fp8.enabled=false"
            )


def device_capability(device) -> tuple[int, int] | None:
    """An NVIDIA GPU's compute capability (major, minor) from its jax device (a compile-only one too:
    `jaxpar.analysis.gpu.deviceless`), or None for a device without one (CPU, TPU)."""
    capability = getattr(device, "compute_capability", None)
    if capability is None:
        return None
    major, minor = (int(v) for v in str(capability).split(".")[:2])
    return major, minor


def _check_compilation_cache(mesh: Mesh, platform: str) -> None:
    """Refuses a pipelined step on CPU while jax's persistent compilation cache is on: XLA:CPU runs a pipelined
    train step that it loads back from that cache with its devices' collectives out of step, and the second step
    never finishes (XLA aborts after its 40 s rendezvous timeout: "Termination timeout for all gather ... only 1
    of them arrived"). Seen every time, in the process that wrote the entry and in a new one; a step without
    `pipeline` loads from the cache and runs bitwise as compiled. Checked before any device work."""
    stages = mesh.shape[PIPELINE]
    settings = jax.config.values
    if platform != "cpu" or stages == 1 or not settings["jax_enable_compilation_cache"]:
        return
    cache_dir = settings["jax_compilation_cache_dir"]
    if cache_dir:
        raise ConfigError(
            f"mesh.pipeline={stages} on CPU with jax's persistent compilation cache on "
            f"(jax_compilation_cache_dir={cache_dir!r}): XLA:CPU deadlocks in the collectives of a pipelined step "
            "loaded from that cache; unset JAX_COMPILATION_CACHE_DIR (or set JAX_ENABLE_COMPILATION_CACHE=false) "
            "for pipelined runs on CPU"
        )


def _resolved_precision(cfg: Config, platform: str) -> Config:
    """`cfg` with `precision.compute_dtype` resolved for `platform` (`auto` -> float32 on cpu, bfloat16 on an
    accelerator; `jaxpar.config.precision.resolve_compute_dtype`); `cfg` itself when it names a dtype."""
    dtype = resolve_compute_dtype(cfg.precision.compute_dtype, platform)
    if dtype == cfg.precision.compute_dtype:
        return cfg
    return dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, compute_dtype=dtype))


def _check_mesh(cfg: Config, mesh: Mesh) -> dict[str, int]:
    """The config's mesh shape ({axis: size}), checked to be `mesh`'s.

    Raises:
      ConfigError: the mesh has other axes, or other sizes than the config resolves to on its device count.
    """
    if set(mesh.axis_names) != set(MESH_AXES):
        raise ConfigError(
            f"the mesh's axes are {mesh.axis_names}; build it with jaxpar.build_mesh(cfg), which names {MESH_AXES}"
        )
    given = ", ".join(f"{a}={mesh.shape[a]}" for a in MESH_AXES)
    fix = "build it with jaxpar.build_mesh(cfg, devices)"
    try:
        wanted = resolve_mesh_shape(cfg, mesh.size)
    except ConfigError as e:
        raise ConfigError(f"the mesh ({given}) is not the config's: {e}; {fix}") from e
    if any(wanted[a] != mesh.shape[a] for a in MESH_AXES):
        raise ConfigError(
            f"the mesh ({given}) is not the config's ({', '.join(f'mesh.{a}={wanted[a]}' for a in MESH_AXES)}); {fix}"
        )
    return wanted


def _resolved_model(cfg: Config, mesh: Mesh, platform: str) -> ModelConfig:
    """`cfg.model` with `model.attention` resolved for `platform` (`auto` -> cudnn on NVIDIA GPUs, xla elsewhere;
    `jaxpar.config.attention`) at the resolved compute dtype, so the model never asks the default backend.
    `model.moe.expert_axes` keeps the axes of size > 1, in mesh order (the order of the experts' shards and of
    the all-to-all's ranks); `model.moe.all_to_all` is resolved for `platform` (`auto` -> ragged on GPU and TPU,
    emulated elsewhere; `jaxpar.config.moe.resolve_all_to_all`).

    Raises:
      ConfigError: `model.attention=cudnn` on devices or with a dtype or head width cuDNN does not take;
        `model.moe.all_to_all=ragged` on a platform without a ragged all-to-all.
    """
    try:
        m = cfg.model
        attention = resolve_attention(
            m.attention,
            platform,
            cfg.precision.compute_dtype,
            m.kernel_head_width,
            m.attention_softcap,
            device_capability(mesh.devices.flat[0]),
        )
    except ValueError as e:
        raise ConfigError(str(e)) from e
    moe = cfg.model.moe
    experts = tuple(a for a in MESH_AXES if a in moe.expert_axes and mesh.shape[a] > 1)
    moe = dataclasses.replace(
        moe, expert_axes=experts if moe.enabled else (), all_to_all=resolve_all_to_all(moe.all_to_all, platform)
    )
    return dataclasses.replace(cfg.model, attention=attention, moe=moe)


def _optimizer(
    cfg: Config,
    logical: dict,
    optimizer: optax.GradientTransformation | None,
    learning_rate: optax.Schedule | float | None,
) -> tuple[optax.GradientTransformation, optax.Schedule | float | None]:
    """(the optimizer, what the `learning_rate` metric reports): the config's AdamW and its schedule, or the
    caller's `optimizer` and `learning_rate` (a number made a float), checked as `build_plan` says.

    Raises:
      TypeError, ValueError: as `build_plan`.
    """
    if optimizer is None:
        if learning_rate is not None:
            raise ValueError(
                "learning_rate is only for a caller's own optimizer; the default AdamW's schedule "
                "comes from the optimizer.* config keys (optimizer.learning_rate, warmup_steps, decay)"
            )
        check_weight_decay_exclude(cfg.optimizer, logical)  # against the model's parameter names
        return build_optimizer(cfg.optimizer, logical, cfg.train.steps), learning_rate_schedule(
            cfg.optimizer, cfg.train.steps
        )
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"optimizer must be an optax.GradientTransformation (e.g. optax.lion(1e-4)), got {type(optimizer).__name__}"
        )
    if learning_rate is not None and not callable(learning_rate):
        try:
            learning_rate = float(learning_rate)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"learning_rate must be a schedule (count -> rate) or a number, got {learning_rate!r}"
            ) from e
    return optimizer, learning_rate


def _state_specs(
    cfg: Config,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule | float | None,
    logical: dict,
    specs: dict,
    layout: PrecisionLayout,
    mesh_shape: dict[str, int],
) -> dict:
    """The PartitionSpec tree of the train state {"step", "params", "opt_state"[, "master"][, "fp8"]}, after checking
    (abstractly, no device work) that the mesh divides every parameter and that the optimizer's state holds what
    the step reads from it.

    Raises:
      ConfigError: from `_check_divisible`. ValueError: nested `skip_nonfinite` wrappers; a schedule with no or
        several schedule counts in the state.
    """
    rows = stored_rows(cfg.model.stack_depth, mesh_shape[PIPELINE])
    abstract_params = jax.eval_shape(lambda: init_params(cfg.model, 0, rows))
    _check_divisible(abstract_params, logical, specs, mesh_shape)
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    nonfinite_state(abstract_opt)  # raises on nested skip wrappers
    if callable(schedule):
        schedule_count(abstract_opt)  # raises unless the state holds exactly one schedule count
    state_specs = {
        "step": P(),
        "params": specs["params"],
        "opt_state": opt_state_specs(abstract_opt, abstract_params, specs["opt_state"]),
    }
    if layout.master:
        state_specs["master"] = specs["opt_state"]
    if fp8_history.delayed_config(cfg):  # the history's rows go with their layers' stage
        state_specs["fp8"] = {fp8_history.HISTORY: P(PIPELINE) if mesh_shape[PIPELINE] > 1 else P()}
    return state_specs


def _check_divisible(abstract_params: dict, logical: dict, specs: dict, mesh_shape: dict[str, int]) -> None:
    """Every parameter dimension splits evenly over the mesh axes its spec puts on it (a model of one's own may
    have widths the config checks do not know of).

    Raises:
      ConfigError: naming the parameter, its logical axis, the size and the mesh axes, and the fix.
    """
    flat = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    for kind in ("params", "opt_state"):  # opt_state: the widest split (over data too from ZeRO-1)
        for (path, leaf), spec, names in zip(
            flat,
            jax.tree.leaves(specs[kind], is_leaf=lambda x: isinstance(x, P)),
            jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple)),
        ):
            for dim, (size, entry) in enumerate(zip(leaf.shape, tuple(spec) + (None,) * leaf.ndim)):
                axes = dim_axes(entry)
                split = math.prod(mesh_shape[a] for a in axes)
                if split > 1 and size % split:
                    where = "/".join(str(getattr(k, "key", k)) for k in path)
                    raise ConfigError(
                        f"parameter {where} has {size} entries along dimension {dim} (logical axis "
                        f"{names[dim]!r}), which {' x '.join(f'{a}={mesh_shape[a]}' for a in axes)} = {split} "
                        f"does not divide ({kind.replace('_', ' ')} sharding at optimizer.zero_stage); change the "
                        f"model's width or the mesh"
                    )
