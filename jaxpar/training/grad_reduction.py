"""The step's gradient reductions inside the shard_map, after the accumulation loop (`jaxpar.training.step`).

Two of them, run in this order on the summed microbatch gradients:
  * `reduce_replicated`: an all-reduce of the gradients of parameters replicated over an axis whose ranks saw
    different work, where no other collective of the step reduces them;
  * `reduce_over_data`: the one data-parallel reduction, once per step: an all-reduce (`psum`) when gradients
    stay replicated over `data` (ZeRO-0/1), a reduce-scatter (`psum_scatter`) when they end partitioned
    (ZeRO-2); under ZeRO-3 the gather's transpose (`jaxpar.parallel.gather`) already did it.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxpar.config.mesh_axes import CONTEXT, DATA, FSDP, PIPELINE, TENSOR
from jaxpar.parallel.sharding import gathered_axes, spec_axes
from jaxpar.training.plan import StepPlan


def reduce_replicated(plan: StepPlan, grads: dict) -> dict:
    """All-reduce the gradients of parameters replicated over an axis whose ranks saw different work, where no
    other collective of the step reduces them.

    * tensor, with sequence parallelism: parameters not split over tensor (norm scales, row-parallel biases, a
      position table) saw only this rank's slice of the sequence (without it, every rank computed the full
      gradient);
    * pipeline: the embedding, final norm and head are used by the first or last stage only; the other stages
      hold zeros;
    * context: every parameter is replicated over it, and each rank saw its own slice of every sequence;
    * fsdp, and data from ZeRO-2 on: the batch rows are split over them, and a parameter's gather transpose
      (`jaxpar.parallel.gather`) or the data reduce-scatter (`reduce_over_data`) sums its gradient over them
      only along its `embed` dimension. A parameter without one (e.g. a column-parallel bias, logical axes
      ("mlp",)) is replicated there, so it is summed here. (Over data at ZeRO-0/1 `reduce_over_data`
      all-reduces every gradient.)
    Experts split over an axis (`model.moe.expert_axes`) have it in their spec and are not summed over it: the
    all-to-all's transpose already brought each expert the gradient of every token routed to it.
    """
    shape = plan.mesh_shape
    axes = []
    if plan.tensor_parallel.sequence_parallel:
        axes.append(TENSOR)
    if shape[PIPELINE] > 1:
        axes.append(PIPELINE)
    if shape[CONTEXT] > 1:
        axes.append(CONTEXT)
    if shape[FSDP] > 1:
        axes.append(FSDP)
    if shape[DATA] > 1 and plan.cfg.optimizer.zero_stage >= 2:
        axes.append(DATA)
    if not axes:
        return grads

    def reduce(g, spec):
        # psum over the axes this parameter is replicated on: sum the ranks' partial gradients.
        missing = tuple(a for a in axes if a not in spec_axes(spec))
        return jax.lax.psum(g, missing) if missing else g

    return jax.tree.map(reduce, grads, plan.specs["grads"], is_leaf=lambda x: isinstance(x, P))


def reduce_over_data(plan: StepPlan, grads: dict) -> dict:
    """The one data-parallel gradient reduction of the step (module docstring); `grads` unchanged with
    `mesh.data` = 1 or at ZeRO-3."""
    zero = plan.cfg.optimizer.zero_stage
    if plan.mesh_shape[DATA] == 1 or zero == 3:
        return grads
    specs = jax.tree.leaves(plan.specs["grads"], is_leaf=lambda x: isinstance(x, P))
    names = jax.tree.leaves(plan.logical, is_leaf=lambda x: isinstance(x, tuple))
    leaves, treedef = jax.tree.flatten(grads)
    if zero in (0, 1):
        # all-reduce over data: every replica keeps the whole (fsdp-sharded) gradient. Experts split over data
        # (expert parallelism) are not replicas: the all-to-all's transpose brought them every token's part.
        def all_reduce(g, spec):
            return g if DATA in spec_axes(spec) else jax.lax.psum(g, DATA)

        return jax.tree.unflatten(treedef, [all_reduce(g, s) for g, s in zip(leaves, specs, strict=True)])

    # ZeRO-2, reduce-scatter over data: each replica keeps 1/data of the gradient, along the dimension its
    # optimizer state is partitioned on. A parameter with no such dimension was all-reduced by
    # `reduce_replicated` (or is an expert split over data: complete already).
    def scatter(g, spec, logical):
        split = [d for d, a in gathered_axes(spec, logical) if DATA in a]
        return jax.lax.psum_scatter(g, DATA, scatter_dimension=split[0], tiled=True) if split else g

    return jax.tree.unflatten(treedef, [scatter(g, s, n) for g, s, n in zip(leaves, specs, names, strict=True)])
