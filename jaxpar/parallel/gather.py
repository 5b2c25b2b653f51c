"""All-gather of sharded weights just before use, with a reduce-scatter of their gradients as the transpose.

Runs inside `jax.shard_map`. For a weight stored as shards along `embed` over `fsdp` (and `data` under
ZeRO-3), `gather_weight` all-gathers the full weight in the compute dtype; its custom VJP reduce-scatters the
incoming gradient over the same axes in `reduce_dtype` (fp32 unless configured otherwise) and returns it in the
storage dtype. This is FSDP / ZeRO-3 (Rajbhandari et al. 2019, section 5.3): one all-gather in the forward,
one again in the backward (the gathered weight is not kept, see `GATHERED_WEIGHT`), one reduce-scatter.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.parallel.sharding import PARAM_RULES, gathered_axes, logical_to_spec

GATHERED_WEIGHT = "gathered_weight"  # checkpoint name of all-gathered weights: never saved for backward
ModuleT = TypeVar("ModuleT", bound=nnx.Module)


class Gather(Protocol):
    """`gather(module) -> module`: the same module (same class, same structure) with its parameters ready for
    use on this device, e.g. all-gathered over the axes they are stored sharded on (`module_gatherer`)."""

    def __call__(self, module: ModuleT, /) -> ModuleT: ...


def _live(axes: tuple[str, ...], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    return tuple(a for a in axes if mesh_shape[a] > 1)


def gather_weight(
    x: jax.Array, dims: list[tuple[int, tuple[str, ...]]], compute_dtype: jnp.dtype, reduce_dtype: jnp.dtype
) -> jax.Array:
    """All-gathers local shard `x` along each (dimension, mesh axes) of `dims`; see the module docstring.

    Args:
      x: the local shard, in its storage dtype.
      dims: dimensions to gather and the mesh axes they are split over (major to minor), size-1 axes dropped.
      compute_dtype: dtype of the gathered weight.
      reduce_dtype: dtype of the gradient reduce-scatter.

    Returns:
      The full (along `dims`) weight in `compute_dtype`, tagged `GATHERED_WEIGHT` for rematerialisation.
    """
    storage_dtype = x.dtype

    @jax.custom_vjp
    def gather(shard):
        # all-gather over fsdp (and data under ZeRO-3): fetch the rest of this weight right before use.
        full = shard.astype(compute_dtype)
        for dim, axes in dims:
            full = jax.lax.all_gather(full, axes, axis=dim, tiled=True)
        return full

    def fwd(shard):
        return gather(shard), None

    def bwd(_, grad_full):
        # reduce-scatter over the same axes: sum the gradient contributions of every replica of the batch
        # and keep only this device's shard, in the gradient reduction dtype.
        g = grad_full.astype(reduce_dtype)
        for dim, axes in reversed(dims):
            g = jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
        return (g.astype(storage_dtype),)

    gather.defvjp(fwd, bwd)
    return checkpoint_name(gather(x), GATHERED_WEIGHT)


def module_gatherer(
    mesh_shape: dict[str, int],
    params_zero3: bool,
    compute_dtype: jnp.dtype,
    reduce_dtype: jnp.dtype,
    expert_axes: tuple[str, ...] = (),
) -> Gather:
    """Returns `gather(module) -> module` whose parameters are all-gathered with `gather_weight`.

    Args:
      mesh_shape: mesh axis sizes, e.g. {"data": 2, "fsdp": 4, "tensor": 1, "pipeline": 1}.
      params_zero3: parameters are also sharded over `data` (ZeRO-3).
      compute_dtype: dtype of gathered weights.
      reduce_dtype: dtype of the gradient reduce-scatters.
      expert_axes: the mesh axes experts are split over (`model.moe.expert_axes`): an expert weight's `experts`
        dimension is never gathered, and its `embed` dimension only over the other storage axes
        (`jaxpar.parallel.sharding.logical_to_spec`).
    """

    def gather_variable(var: nnx.Variable) -> nnx.Variable:
        names = tuple(var.get_metadata()["logical_axes"])
        spec = logical_to_spec(names, PARAM_RULES, params_zero3, expert_axes)
        dims = [(d, _live(axes, mesh_shape)) for d, axes in gathered_axes(spec, names)]
        dims = [(d, axes) for d, axes in dims if axes]
        return var.replace(gather_weight(var[...], dims, compute_dtype, reduce_dtype))

    def gather(module: ModuleT) -> ModuleT:
        graphdef, state = nnx.split(module)
        state = jax.tree.map(gather_variable, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        return nnx.merge(graphdef, state)

    return gather
