"""The train step: forward/backward inside one `jax.shard_map` over the whole mesh, optax update outside it.

Shape letters: G global batch (sequences), A gradient-accumulation microbatches, b microbatch rows per device,
T sequence length.

Inside the shard_map every collective is explicit:
  * fsdp (and data under ZeRO-3): each module's weights are all-gathered right before use and their gradients
    reduce-scattered by the gather's transpose (`jaxpar.parallel.gather`);
  * data: the accumulated gradients are reduced once per step, after all microbatches: an all-reduce (`psum`)
    when gradients stay replicated over `data` (ZeRO-0/1), a reduce-scatter (`psum_scatter`) when they end
    partitioned (ZeRO-2); under ZeRO-3 the gather's transpose already did it.
The optimizer update then runs on global arrays with fixed `NamedSharding`s; it is elementwise, so the compiler
adds only the all-gather of updated parameters that ZeRO-1/2 need.

The loss is the mean cross-entropy over every valid (mask = 1) token of the global batch: each microbatch's
summed loss is divided by the global count of valid tokens, so accumulation over any split is exact and an
all-masked microbatch contributes zero (no NaN). A caller's own loss (`build_plan(..., loss_fn=...)`, see
`jaxpar.training.loss`) replaces the cross-entropy's per-microbatch sum under the same normalisation; a caller's own
optax optimizer (`build_plan(..., optimizer=...)`) replaces the default AdamW.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config.attention import resolve_attention
from jaxpar.config.errors import ConfigError
from jaxpar.config.moe import check_moe, without_expert_axes
from jaxpar.config.precision import resolve_compute_dtype
from jaxpar.config.schema import Config, ModelConfig
from jaxpar.config.validate import resolve_mesh_shape, sequence_parallel
from jaxpar.model import ModelDef, init_params, model_def
from jaxpar.model.interface import STACK_ATTRIBUTE, takes_segment_ids
from jaxpar.parallel import pipeline as pipeline_lib
from jaxpar.parallel.gather import module_gatherer
from jaxpar.parallel.mesh import DATA_PARALLEL_AXES, MESH_AXES
from jaxpar.parallel.sharding import (
    activation_spec,
    dim_axes,
    gathered_axes,
    named,
    opt_state_specs,
    param_specs,
    partitioned_over_data,
    spec_axes,
    storage_axes,
)
from jaxpar.parallel.tensor import AXIS as TENSOR_AXIS
from jaxpar.parallel.tensor import TensorParallel
from jaxpar.training.loss import LossFn, check_loss_fn, cross_entropy, summed_loss
from jaxpar.training.moe_loss import MEAN_KEYS, moe_loss_terms, moe_metrics, moe_sums, zero_sums
from jaxpar.training.optimizer import (
    applied_learning_rate,
    build_optimizer,
    learning_rate_schedule,
    nonfinite_state,
    schedule_count,
)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def compute_dtype(cfg: Config) -> jnp.dtype:
    """`precision.compute_dtype`, with `auto` = bfloat16 on GPU/TPU and float32 on CPU
    (`jaxpar.config.precision.resolve_compute_dtype` on jax's default backend)."""
    return _DTYPES[resolve_compute_dtype(cfg.precision.compute_dtype, jax.default_backend())]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Everything static about the step on one mesh: model structure, optimizer, specs and shardings.

    Attributes:
      tx: the optimizer (`build_plan`'s `optimizer`, else the config's AdamW).
      schedule: what the `learning_rate` metric reports: a schedule (count -> rate), a constant rate, or None
        (no such metric).
      specs: PartitionSpec trees for "params", "grads" and "opt_state" (also used for the fp32 master copy);
        the optimizer state's own specs are in `state_shardings["opt_state"]`.
      state_shardings: NamedSharding tree matching `init_state`'s output.
      batch_sharding: NamedSharding of each [G, T] batch array (rows over data x fsdp).
      loss_fn: the training loss (`jaxpar.training.loss`; default `cross_entropy`).
    """

    cfg: Config
    mesh: Mesh
    mdef: ModelDef
    logical: dict
    tx: optax.GradientTransformation
    schedule: optax.Schedule | float | None
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
    def tensor_parallel(self) -> TensorParallel:
        size = self.mesh_shape["tensor"]
        return TensorParallel(size=size, sequence_parallel=sequence_parallel(self.cfg, size))

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
    def has_master(self) -> bool:
        return self.cfg.precision.layout == "16p"


def build_plan(
    cfg: Config,
    mesh: Mesh,
    *,
    loss_fn: LossFn | None = None,
    optimizer: optax.GradientTransformation | None = None,
    learning_rate: optax.Schedule | float | None = None,
) -> StepPlan:
    """Derives model structure, optimizer and every sharding for `cfg` on `mesh` (no device work).

    Args:
      cfg: the run config.
      mesh: the device mesh (`jaxpar.parallel.mesh.build_mesh`).
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
      TypeError: `optimizer` is not an `optax.GradientTransformation`; `loss_fn` fails on abstract inputs or
        returns no real scalar (`jaxpar.training.loss.check_loss_fn`).
      ValueError: `learning_rate` without `optimizer`; a schedule `learning_rate` with an optimizer state that
        holds no or several schedule states; an optimizer state with nested `skip_nonfinite` wrappers.
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
    check_moe(cfg, wanted)
    mdef = model_def(_resolved_model(cfg, mesh))
    logical = mdef.logical_axes()
    zero = cfg.optimizer.zero_stage
    experts = mdef.cfg.moe.expert_axes
    specs = {kind: param_specs(logical, kind, zero, experts) for kind in ("params", "grads", "opt_state")}
    if optimizer is None:
        if learning_rate is not None:
            raise ValueError(
                "learning_rate is only for a caller's own optimizer; the default AdamW's schedule "
                "comes from the optimizer.* config keys (optimizer.learning_rate, warmup_steps, decay)"
            )
        tx = build_optimizer(cfg.optimizer, logical, cfg.train.steps)
        schedule = learning_rate_schedule(cfg.optimizer, cfg.train.steps)
    else:
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(
                f"optimizer must be an optax.GradientTransformation (e.g. optax.lion(1e-4)), got "
                f"{type(optimizer).__name__}"
            )
        if learning_rate is not None and not callable(learning_rate):
            try:
                learning_rate = float(learning_rate)
            except (TypeError, ValueError) as e:
                raise TypeError(
                    f"learning_rate must be a schedule (count -> rate) or a number, got {learning_rate!r}"
                ) from e
        tx, schedule = optimizer, learning_rate
    if loss_fn is None:
        loss_fn = cross_entropy
    else:
        check_loss_fn(loss_fn, cfg.data.seq_len, cfg.model.vocab_size)
    param_dtype = jnp.bfloat16 if cfg.precision.layout == "16p" else jnp.float32
    abstract_params = jax.eval_shape(lambda: init_params(cfg.model, 0))
    _check_divisible(abstract_params, logical, specs, dict(mesh.shape))
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    nonfinite_state(abstract_opt)  # raises on nested skip wrappers
    if callable(schedule):
        schedule_count(abstract_opt)  # raises unless the state holds exactly one schedule count
    state_specs = {
        "step": P(),
        "params": specs["params"],
        "opt_state": opt_state_specs(abstract_opt, abstract_params, specs["opt_state"]),
    }
    if cfg.precision.layout == "16p":
        state_specs["master"] = specs["opt_state"]
    return StepPlan(
        cfg=cfg,
        mesh=mesh,
        mdef=mdef,
        logical=logical,
        tx=tx,
        schedule=schedule,
        compute_dtype=compute_dtype(cfg),
        reduce_dtype=_DTYPES[cfg.precision.reduce_dtype],
        param_dtype=param_dtype,
        specs=specs,
        state_shardings=named(mesh, state_specs),
        batch_sharding=NamedSharding(mesh, activation_spec("batch", "seq")),
        loss_fn=loss_fn,
    )


def _resolved_model(cfg: Config, mesh: Mesh) -> ModelConfig:
    """`cfg.model` with `model.attention` resolved for the mesh's devices (`auto` -> cudnn on NVIDIA GPUs, xla
    elsewhere; `jaxpar.config.attention`), so the model never asks the default backend: a step compiled ahead of
    time for GPUs on a CPU host (`jaxpar.analysis.gpu.deviceless`) gets the GPU's kernel. `model.moe.expert_axes` keeps
    the axes of size > 1, in mesh order (the order of the experts' shards and of the all-to-all's ranks).

    Raises:
      ConfigError: `model.attention=cudnn` on devices or with a dtype or head width cuDNN does not take.
    """
    platform = mesh.devices.flat[0].platform
    dtype = resolve_compute_dtype(cfg.precision.compute_dtype, platform)
    try:
        attention = resolve_attention(cfg.model.attention, platform, dtype, cfg.model.head_width)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    moe = cfg.model.moe
    experts = tuple(a for a in MESH_AXES if a in moe.expert_axes and mesh.shape[a] > 1)
    return dataclasses.replace(
        cfg.model, attention=attention, moe=dataclasses.replace(moe, expert_axes=experts if moe.enabled else ())
    )


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


def init_state(plan: StepPlan, seed: int = 0, *, params: dict | None = None) -> dict:
    """Creates the sharded train state {"step", "params", "opt_state"[, "master"]} directly on the mesh.

    Args:
      plan: the step plan.
      seed: initialises the parameters (identical for every mesh layout, see `jaxpar.model.init_params`).
      params: start from these parameters instead (fp32 or the parameter dtype, any sharding, e.g. a restored
        run's: `jaxpar.restore`), with a fresh optimizer state of `plan.tx` at step 0: how a script continues a
        run with another optimizer. Resharded onto the plan's layout; the seed is not used.

    Raises:
      ValueError: `params` is not shaped like the plan's model's parameters.
    """
    if params is None:
        return jax.jit(_state_initializer(plan, seed), out_shardings=plan.state_shardings)()
    want = jax.eval_shape(lambda: init_params(plan.cfg.model, 0))
    _check_params_fit(params, want, plan.cfg.model.name)
    fp32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return jax.jit(lambda p: _fill_state(plan, p), out_shardings=plan.state_shardings)(fp32)


def _check_params_fit(params, want: dict, model_name: str) -> None:
    """`params` has `want`'s paths and shapes, with floating-point leaves; raises ValueError naming the first
    difference."""

    def flat(tree) -> dict:
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {"/".join(str(getattr(k, "key", k)) for k in path): x for path, x in leaves}

    got, expected = flat(params), flat(want)
    fix = "give the parameters of a run with the same model.* settings (e.g. jaxpar.restore(...).params)"
    for path in sorted(set(got) | set(expected)):
        if path not in got or path not in expected:
            what = "missing" if path not in got else "not a parameter of the model"
            raise ValueError(f"params do not fit model {model_name!r}: {path} is {what}; {fix}")
        shape, dtype = tuple(np.shape(got[path])), getattr(got[path], "dtype", None)
        if shape != expected[path].shape or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"params do not fit model {model_name!r}: {path} is {dtype} {shape}, the model's is floating-point "
                f"{expected[path].shape}; {fix}"
            )


def _fill_state(plan: StepPlan, params: dict) -> dict:
    """The train state at step 0 around fp32 `params`."""
    state = {"step": jnp.zeros((), jnp.int32)}
    if plan.has_master:
        state["master"] = params
        state["params"] = jax.tree.map(lambda p: p.astype(plan.param_dtype), params)
    else:
        state["params"] = params
    state["opt_state"] = plan.tx.init(params)
    return state


def _state_initializer(plan: StepPlan, seed: int) -> Callable[[], dict]:
    return lambda: _fill_state(plan, init_params(plan.cfg.model, seed))


def _split_microbatches(batch: dict, n: int) -> dict:
    return {k: v.reshape(n, v.shape[0] // n, *v.shape[1:]) for k, v in batch.items()}


def _loss_body(plan: StepPlan, train: bool = True) -> Callable:
    """`loss_sum(params, mb)`: one microbatch's summed loss on this device's rows (inside the shard_map): the
    plan's training loss, or with `train=False` the cross-entropy that evaluation reports.

    With `train` it returns (summed loss, MoE sums): with `model.moe` the loss adds the weighted auxiliary losses
    and the sums are `jaxpar.training.moe_loss.moe_sums`; without, {}."""
    gather = module_gatherer(
        plan.mesh_shape,
        partitioned_over_data("params", plan.cfg.optimizer.zero_stage),
        plan.compute_dtype,
        plan.reduce_dtype,
        plan.expert_axes,
    )

    tp = plan.tensor_parallel
    moe = plan.cfg.model.moe

    def loss_sum(params: dict, mb: dict):
        model = plan.mdef.bind(params)
        x = model.embed_tokens(mb["inputs"], plan.compute_dtype, gather, tp)
        if train and moe.enabled:
            h, stats = run_blocks(model, x, mb, gather, tp, with_stats=True)
        else:
            h, stats = run_blocks(model, x, mb, gather, tp), None
        logits = model.logits(h, gather, tp)
        if not train:
            return summed_loss(cross_entropy, logits, mb, tp)
        loss = summed_loss(plan.loss_fn, logits, mb, tp)
        if stats is None:
            return loss, {}
        sums = moe_sums(stats, mb["loss_mask"])
        return loss + moe_loss_terms(sums, moe), sums

    return loss_sum


def run_blocks(model, x_BTD: jax.Array, mb: dict, gather, tp: TensorParallel, with_stats: bool = False):
    """`model.run_blocks` on activations [b, T', D], with the microbatch's packed-document `segment_ids` (int32
    [b, T]) when it has them (a model that takes none is never passed any). With `with_stats` (the built-in
    llama with `model.moe`): `model.run_blocks_with_stats`, returning (activations, router statistics).

    Raises:
      ValueError: the microbatch has segment ids and the model's run_blocks takes none.
    """
    if "segment_ids" in mb:
        if not takes_segment_ids(model):
            raise ValueError(
                f"the batches carry segment_ids (packed documents) but {type(model).__name__}.run_blocks takes "
                f"none: give it a fourth parameter segment_ids_BT (jaxpar.model.interface), or yield batches "
                f"without segment_ids"
            )
        if with_stats:
            return model.run_blocks_with_stats(x_BTD, gather, tp, mb["segment_ids"])
        return model.run_blocks(x_BTD, gather, tp, mb["segment_ids"])
    if with_stats:
        return model.run_blocks_with_stats(x_BTD, gather, tp)
    return model.run_blocks(x_BTD, gather, tp)


def _reduce_replicated(plan: StepPlan, grads: dict) -> dict:
    """All-reduce the gradients of parameters replicated over an axis whose ranks saw different work, where no
    other collective of the step reduces them.

    * tensor, with sequence parallelism: parameters not split over tensor (norm scales, row-parallel biases, a
      position table) saw only this rank's slice of the sequence (without it, every rank computed the full
      gradient);
    * pipeline: the embedding, final norm and head are used by the first or last stage only; the other stages
      hold zeros;
    * fsdp, and data from ZeRO-2 on: the batch rows are split over them, and a parameter's gather transpose
      (`jaxpar.parallel.gather`) or the data reduce-scatter (`_reduce_over_data`) sums its gradient over them
      only along its `embed` dimension. A parameter without one (e.g. a column-parallel bias, logical axes
      ("mlp",)) is replicated there, so it is summed here. (Over data at ZeRO-0/1 `_reduce_over_data`
      all-reduces every gradient.)
    Experts split over an axis (`model.moe.expert_axes`) have it in their spec and are not summed over it: the
    all-to-all's transpose already brought each expert the gradient of every token routed to it.
    """
    shape = plan.mesh_shape
    axes = []
    if plan.tensor_parallel.sequence_parallel:
        axes.append(TENSOR_AXIS)
    if shape["pipeline"] > 1:
        axes.append(pipeline_lib.AXIS)
    if shape["fsdp"] > 1:
        axes.append("fsdp")
    if shape["data"] > 1 and plan.cfg.optimizer.zero_stage >= 2:
        axes.append("data")
    if not axes:
        return grads

    def reduce(g, spec):
        # psum over the axes this parameter is replicated on: sum the ranks' partial gradients.
        missing = tuple(a for a in axes if a not in spec_axes(spec))
        return jax.lax.psum(g, missing) if missing else g

    return jax.tree.map(reduce, grads, plan.specs["grads"], is_leaf=lambda x: isinstance(x, P))


def _reduce_over_data(plan: StepPlan, grads: dict) -> dict:
    """The one data-parallel gradient reduction of the step (see the module docstring)."""
    zero = plan.cfg.optimizer.zero_stage
    if plan.mesh_shape["data"] == 1 or zero == 3:
        return grads
    specs = jax.tree.leaves(plan.specs["grads"], is_leaf=lambda x: isinstance(x, P))
    names = jax.tree.leaves(plan.logical, is_leaf=lambda x: isinstance(x, tuple))
    leaves, treedef = jax.tree.flatten(grads)
    if zero in (0, 1):
        # all-reduce over data: every replica keeps the whole (fsdp-sharded) gradient. Experts split over data
        # (expert parallelism) are not replicas: the all-to-all's transpose brought them every token's part.
        def all_reduce(g, spec):
            return g if "data" in spec_axes(spec) else jax.lax.psum(g, "data")

        return treedef.unflatten([all_reduce(g, s) for g, s in zip(leaves, specs, strict=True)])

    # ZeRO-2, reduce-scatter over data: each replica keeps 1/data of the gradient, along the dimension its
    # optimizer state is partitioned on. A parameter with no such dimension was all-reduced by
    # `_reduce_replicated` (or is an expert split over data: complete already).
    def scatter(g, spec, logical):
        split = [d for d, a in gathered_axes(spec, logical) if "data" in a]
        return jax.lax.psum_scatter(g, "data", scatter_dimension=split[0], tiled=True) if split else g

    return treedef.unflatten([scatter(g, s, n) for g, s, n in zip(leaves, specs, names, strict=True)])


def _stage_parts(plan: StepPlan, params: dict, loss_fn: LossFn, train: bool = True) -> pipeline_lib.StageParts:
    """The pipeline stage's parts (`jaxpar.parallel.pipeline.StageParts`) for the plan's model: embedding, this
    stage's blocks, and head + summed `loss_fn` (inside the shard_map; `params` are this device's local
    parameters, split by the parts into the layer stack and the edge parameters outside it).

    With `train` and `model.moe` the blocks also return the weighted auxiliary losses of the stage's MoE units
    (`jaxpar.training.moe_loss.moe_loss_terms`) and their sums (`moe_sums`; "load" [n, E] for the n units the
    call runs: U/p, or U/(pv) per chunk with v virtual stages) as `blocks_loss` terms and stats; evaluation
    (`train=False`) reports the cross-entropy alone."""
    gather = module_gatherer(
        plan.mesh_shape,
        partitioned_over_data("params", plan.cfg.optimizer.zero_stage),
        plan.compute_dtype,
        plan.reduce_dtype,
        plan.expert_axes,
    )
    tp = plan.tensor_parallel
    layers, edge = split_stack(params)

    def bind(edge_params: dict, layer_params: dict):
        return plan.mdef.bind({**edge_params, STACK_ATTRIBUTE: layer_params})

    moe = plan.cfg.model.moe
    with_moe = train and moe.enabled

    def blocks(layer_params, x, mb):
        if not with_moe:
            return run_blocks(bind(edge, layer_params), x, mb, gather, tp)
        h, stats = run_blocks(bind(edge, layer_params), x, mb, gather, tp, with_stats=True)
        sums = moe_sums(stats, mb["loss_mask"])
        return h, moe_loss_terms(sums, moe), sums

    storage = storage_axes("params", plan.cfg.optimizer.zero_stage)
    return pipeline_lib.StageParts(
        embed=lambda e, mb: bind(e, layers).embed_tokens(mb["inputs"], plan.compute_dtype, gather, tp),
        blocks=blocks,
        head=lambda e, h, mb: summed_loss(loss_fn, bind(e, layers).logits(h, gather, tp), mb, tp),
        edge_gathered=any(plan.mesh_shape[a] > 1 for a in storage),
        blocks_loss=with_moe,
    )


def split_stack(params: dict) -> tuple[dict, dict]:
    """(the layer stack `params["blocks"]`, every other top-level entry: the edge parameters)."""
    return params[STACK_ATTRIBUTE], {k: v for k, v in params.items() if k != STACK_ATTRIBUTE}


def _pipeline_shapes(plan: StepPlan, batch: dict, m: int) -> tuple[dict, tuple[int, ...]]:
    """(microbatches, each leaf [m, b, ...], and the activation shape [b, T', D] passed between stages)."""
    tp = plan.tensor_parallel
    mbs = _split_microbatches(batch, m)
    b, seq = mbs["inputs"].shape[1:]
    return mbs, (b, seq // tp.size if tp.sequence_parallel else seq, plan.cfg.model.d_model)


def _pipeline_grads(plan: StepPlan, params: dict, batch: dict, loss_scale: jax.Array) -> tuple[dict, jax.Array, dict]:
    """Gradients, scaled loss and MoE sums of one accumulation step's local batch through the configured
    pipeline schedule (`jaxpar.parallel.pipeline`), split into `pipeline.microbatches` microbatches.

    The MoE sums ({} without `model.moe`) are this stage's: its units' "aux", "z" and "dropped", and "load"
    [U, E] in model order with this stage's rows filled and zeros elsewhere, so their sum over `pipeline` is the
    whole model's."""
    m = plan.cfg.pipeline.microbatches
    mbs, act_shape = _pipeline_shapes(plan, batch, m)
    schedule = pipeline_lib.one_f_one_b if plan.cfg.pipeline.schedule == "1f1b" else pipeline_lib.gpipe
    layers, edge = split_stack(params)
    (g_layers, g_edge), loss, stats = schedule(
        _stage_parts(plan, params, plan.loss_fn),
        layers,
        edge,
        mbs,
        p=plan.mesh_shape["pipeline"],
        m=m,
        act_shape=act_shape,
        act_dtype=plan.compute_dtype,
        loss_scale=loss_scale,
        recompute=plan.cfg.pipeline.recompute,
        virtual_stages=plan.cfg.pipeline.virtual_stages,
    )
    # The stats are per model chunk (leaves [v, ...]): the scalar sums add up, the per-unit expert loads
    # [v, U/(pv), E] go to their units' rows in model order.
    sums = {k: jnp.sum(a, axis=0) for k, a in stats.items() if k != "load"}
    if "load" in stats:
        sums["load"] = pipeline_lib.chunk_rows_in_model_order(stats["load"], plan.mesh_shape["pipeline"])
    return {**g_edge, STACK_ATTRIBUTE: g_layers}, loss, sums


def make_grad_fn(plan: StepPlan) -> Callable:
    """Returns `grad_fn(params, batch) -> (grads, loss_sum, n_tokens)` as one shard_map over the mesh.

    Args (of the returned function):
      params: parameter tree sharded as `plan.specs["params"]`.
      batch: {"inputs", "targets": int32 [G, T], "loss_mask": float32 [G, T]} and optionally "segment_ids": int32
        [G, T] (packed documents: attention stays within each, `jaxpar.model.attention`), sharded as
        `plan.batch_sharding`.

    Returns:
      grads of the global token-mean loss, sharded as `plan.specs["grads"]`, in the parameter dtype;
      loss_sum: the plan's summed loss (default: token cross-entropy) over the global batch divided by n_tokens
        (so: the mean), fp32;
      n_tokens: global count of valid tokens (sum of loss_mask), fp32.
    """
    grad_fn = _grad_fn_with_moe(plan)
    return lambda params, batch: grad_fn(params, batch)[:3]


def _grad_fn_with_moe(plan: StepPlan) -> Callable:
    """`make_grad_fn`'s function with a fourth output: the global MoE sums (`jaxpar.training.moe_loss`; "aux"
    and "z" divided by the global token count), or {} without `model.moe`."""
    loss_sum = _loss_body(plan)
    moe = plan.cfg.model.moe
    stages, pipe_mb = plan.mesh_shape["pipeline"], plan.cfg.pipeline.microbatches
    # Without a pipeline its microbatches are just more gradient accumulation.
    accum = plan.cfg.train.grad_accum_steps * (pipe_mb if stages == 1 else 1)
    loss_axes = DATA_PARALLEL_AXES + ((pipeline_lib.AXIS,) if stages > 1 else ())

    virtual = plan.cfg.pipeline.virtual_stages if stages > 1 else 1

    def body(params, batch):
        # psum over the batch-splitting axes: the global count of valid tokens normalises every microbatch.
        n_tokens = jax.lax.psum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), DATA_PARALLEL_AXES)
        denom = jnp.maximum(n_tokens, 1.0)
        # Interleaved 1F1B takes the stage's layers in chunk order, once per step (parameters stay in model
        # order: checkpoints do not depend on the schedule); the gradients go back after the accumulation loop.
        staged = params
        if virtual > 1:
            staged = {**params, STACK_ATTRIBUTE: pipeline_lib.to_chunk_order(params[STACK_ATTRIBUTE], stages, virtual)}

        def scaled(p, mb):
            loss, sums = loss_sum(p, mb)
            return loss / denom, sums

        def micro(carry, mb):
            g_acc, l_acc, s_acc = carry
            if stages > 1:
                g, loss, sums = _pipeline_grads(plan, staged, mb, 1.0 / denom)
            else:
                (loss, sums), g = jax.value_and_grad(scaled, has_aux=True)(params, mb)
            g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
            s_acc = jax.tree.map(lambda a, b: a + b, s_acc, sums)
            return (g_acc, l_acc + loss, s_acc), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        sums0 = zero_sums(plan.cfg.model.stack_depth, moe.num_experts) if moe.enabled else {}
        carry0 = (zeros, jnp.zeros((), jnp.float32), sums0)
        (grads, loss, sums), _ = jax.lax.scan(micro, carry0, _split_microbatches(batch, accum))
        grads = jax.tree.map(lambda g: g.astype(plan.reduce_dtype), grads)
        if virtual > 1:
            layers, edge = split_stack(grads)
            layers = pipeline_lib.from_chunk_order(layers, stages, virtual)
            # the edge gradients' reductions after the permutes (one collective order on every device)
            grads = {**pipeline_lib.ordered_after(edge, layers), STACK_ATTRIBUTE: layers}
        grads = _reduce_replicated(plan, grads)
        grads = _reduce_over_data(plan, grads)
        grads = jax.tree.map(lambda g: g.astype(plan.param_dtype), grads)
        # psum over the batch-splitting axes (each device summed only its own rows) and over pipeline (only
        # the last stage computed a loss).
        loss = jax.lax.psum(loss, loss_axes)
        # MoE sums: each device summed its own rows (tensor ranks alike: counted once, like the loss) and, with
        # a pipeline, its own stage's MoE units (psum over pipeline, like the loss); the token-weighted ones are
        # normalised like the loss.
        sums = {k: jax.lax.psum(v / denom if k in MEAN_KEYS else v, loss_axes) for k, v in sums.items()}
        return grads, loss, n_tokens, sums

    return jax.shard_map(
        body,
        mesh=plan.mesh,
        # one spec for every batch array: the three of `jaxpar.data.batch` and an optional "segment_ids"
        in_specs=(plan.specs["params"], plan.batch_sharding.spec),
        out_specs=(plan.specs["grads"], P(), P(), P()),
        check_vma=False,
    )


def make_train_step(plan: StepPlan) -> Callable:
    """Returns the jitted `train_step(state, batch) -> (state, metrics)`; the input state is donated.

    metrics: {"loss": token-mean loss (nats for the cross-entropy), "grad_norm": global L2 norm before clipping,
              "learning_rate": the rate this step's update applied, from the optimizer's own update count
              (`jaxpar.training.optimizer.applied_learning_rate`; 0.0 when the update was skipped),
              "tokens": valid tokens in the batch} (fp32 scalars),
             "bad_steps_in_a_row" and "skipped_steps" (int32): updates skipped for non-finite gradients,
             consecutive up to this step and in total.
    With `model.moe` the loss adds the weighted auxiliary losses, and the metrics add moe_aux_loss,
    moe_z_loss, moe_dropped_fraction and moe_load_max_mean (`jaxpar.training.moe_loss.moe_metrics`).
    "learning_rate" is left out when `plan.schedule` is None (a caller's optimizer without a `learning_rate`
    given to `build_plan`); "bad_steps_in_a_row" and "skipped_steps" are left out when the optimizer state holds
    no `jaxpar.training.optimizer.skip_nonfinite` wrapper (such an optimizer applies every update, finite or not).
    The default optimizer reports all of them.
    """
    grad_fn = _grad_fn_with_moe(plan)

    def train_step(state, batch):
        grads, loss, n_tokens, sums = grad_fn(state["params"], batch)
        grads32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        grad_norm = optax.tree.norm(grads32)
        target = state["master"] if plan.has_master else state["params"]
        updates, opt_state = plan.tx.update(grads32, state["opt_state"], target)
        target = optax.apply_updates(target, updates)
        new = {"step": state["step"] + 1, "opt_state": opt_state}
        if plan.has_master:
            new["master"] = target
            new["params"] = jax.tree.map(lambda p: p.astype(plan.param_dtype), target)
        else:
            new["params"] = target
        metrics = {"loss": loss, "grad_norm": grad_norm}
        skip = nonfinite_state(opt_state)
        if callable(plan.schedule):
            # Not plan.schedule(state["step"]): a skipped update does not advance the optimizer's count.
            metrics["learning_rate"] = applied_learning_rate(plan.schedule, state["opt_state"], opt_state)
        elif plan.schedule is not None:
            rate = jnp.float32(plan.schedule)
            metrics["learning_rate"] = rate if skip is None else jnp.where(skip.last_finite, rate, 0.0)
        metrics["tokens"] = n_tokens
        if sums:
            metrics.update(moe_metrics(sums))
        if skip is not None:
            metrics["bad_steps_in_a_row"] = skip.notfinite_count
            metrics["skipped_steps"] = skip.total_notfinite
        return new, metrics

    replicated = NamedSharding(plan.mesh, P())
    return jax.jit(
        train_step,
        in_shardings=(plan.state_shardings, plan.batch_sharding),  # every batch array, segment_ids included
        out_shardings=(plan.state_shardings, replicated),
        donate_argnums=0,
        keep_unused=True,
    )  # the whole state is an argument, even a flag the update only writes


def make_eval_step(plan: StepPlan) -> Callable:
    """Returns jitted `eval_step(params, batch) -> (loss_sum, n_tokens)`: summed token loss (fp32 nats) and
    valid-token count of a global batch, for a token-mean over several batches. Always the cross-entropy,
    whatever the plan's training loss (`jaxpar.training.loss`).

    With `mesh.pipeline > 1` the forward runs through the pipeline stages (`jaxpar.parallel.pipeline.
    forward_loss`: each device keeps its own stage's layers), with each device's rows split into
    gcd(rows, pipeline.microbatches) microbatches."""
    loss_sum = _loss_body(plan, train=False)
    stages = plan.mesh_shape["pipeline"]

    def pipelined_loss_sum(params, batch):
        rows = batch["inputs"].shape[0]
        m = math.gcd(rows, plan.cfg.pipeline.microbatches)
        mbs, act_shape = _pipeline_shapes(plan, batch, m)
        layers, edge = split_stack(params)
        loss, _ = pipeline_lib.forward_loss(
            _stage_parts(plan, params, cross_entropy, train=False),
            layers,
            edge,
            mbs,
            p=stages,
            m=m,
            act_shape=act_shape,
            act_dtype=plan.compute_dtype,
        )
        return loss

    def body(params, batch):
        # psum over the batch-splitting axes: each device saw only its own rows (and over pipeline: only the
        # last stage computed a loss).
        if stages > 1:
            total = jax.lax.psum(pipelined_loss_sum(params, batch), DATA_PARALLEL_AXES + (pipeline_lib.AXIS,))
        else:
            total = jax.lax.psum(loss_sum(params, batch), DATA_PARALLEL_AXES)
        count = jax.lax.psum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), DATA_PARALLEL_AXES)
        return total, count

    # one spec for every batch array: the three of `jaxpar.data.batch` and an optional "segment_ids"
    fn = jax.shard_map(
        body,
        mesh=plan.mesh,
        in_specs=(plan.specs["params"], plan.batch_sharding.spec),
        out_specs=(P(), P()),
        check_vma=False,
    )
    return jax.jit(fn)


def abstract_state(plan: StepPlan) -> dict:
    """`init_state`'s output as ShapeDtypeStructs carrying their shardings (a restore target; no device work)."""
    shapes = jax.eval_shape(_state_initializer(plan, 0))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, plan.state_shardings)
