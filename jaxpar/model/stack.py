"""The stacked layer axis every jaxpar model shares: blocks created with `nnx.vmap`, run with `jax.lax.scan`.

Shape letters: B batch, T sequence (T/t under sequence parallelism), D model width, L layers.

Every parameter of a model's `blocks` has a leading `layers` dimension of size L. Compile time does not grow with
depth, and the pipeline splits the stack into stages by sharding that dimension over the `pipeline` mesh axis:
inside the train step each stage's module holds L / pipeline layers and `scan_layers` runs just those.

Parallelism enters through one hook: `gather(module) -> module`, applied to each layer right before it runs. On
one device it is the identity; inside the train step's `shard_map` it all-gathers the layer's fsdp-sharded
weights (`jaxpar.parallel.gather`), and its transpose reduce-scatters their gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from jaxpar.config.mesh_axes import STORAGE_AXES
from jaxpar.parallel.tensor import NO_TENSOR_PARALLEL, TensorParallel

Gather = Callable[[nnx.Module], nnx.Module]
# Checkpoint names of the activations the `names` remat policy keeps: the inputs of the row-parallel projections
# (tag them with `jax.ad_checkpoint.checkpoint_name` in a model's blocks).
ATTENTION_CONTEXT = "attention_context"
MLP_HIDDEN = "mlp_hidden"


def no_gather(module: nnx.Module) -> nnx.Module:
    """The `Gather` of one device: the module as it is."""
    return module


def _is_weight_gather(params: dict) -> bool:
    """Whether a custom-VJP call is `jaxpar.parallel.gather.gather_weight`: its body all-gathers over fsdp/data."""
    for eqn in params["call_jaxpr"].jaxpr.eqns if "call_jaxpr" in params else ():
        if eqn.primitive.name == "all_gather":
            axes = eqn.params["axis_name"]
            if set((axes,) if isinstance(axes, str) else axes) & set(STORAGE_AXES):
                return True
    return False


def _save_dots_and_tensor_collectives(prim, *avals, **params) -> bool:
    """Saves matmul outputs and the outputs of the tensor-parallel collectives (custom VJPs over `tensor`), so the
    backward recomputes neither a matmul nor a tensor collective; never saves an all-gathered weight."""
    if prim.name == "custom_vjp_call":
        return not _is_weight_gather(params)
    return jax.checkpoint_policies.dots_saveable(prim, *avals, **params)


REMAT_POLICIES = {
    # Every matmul output and tensor-collective output is saved, so neither is recomputed; elementwise ops
    # (norms, rotary, gates) are recomputed, and so are the all-gathered weights: they are re-gathered in the
    # backward instead of being kept, which is what FSDP / ZeRO-3 do. (A "save everything except the gathered
    # weights" policy keeps them anyway: a cast or reshape of a gathered weight is saveable.)
    "none": _save_dots_and_tensor_collectives,
    # Recompute the whole block in the backward from its input.
    "full": jax.checkpoint_policies.nothing_saveable,
    # Save matmul outputs without batch dimensions, recompute the rest.
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Save only the named activations (ATTENTION_CONTEXT and MLP_HIDDEN, the inputs of the row-parallel
    # projections): the backward recomputes the rest of the block but not the attention itself.
    "names": jax.checkpoint_policies.save_only_these_names(ATTENTION_CONTEXT, MLP_HIDDEN),
}


def stack_layers(n_layers: int, make_layer: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs) -> nnx.Module:
    """Creates `n_layers` layers as one module whose every parameter has a leading `layers` dimension.

    Args:
      n_layers: L, the stack's depth.
      make_layer: builds one layer from its own `nnx.Rngs` (each layer draws different initial values).
      rngs: the model's generator; split L ways.
    """

    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(layer_rngs: nnx.Rngs) -> nnx.Module:
        return make_layer(layer_rngs)

    return make(rngs)


def scan_layers(
    layers: nnx.Module,
    x_BTD: jax.Array,
    remat: str,
    gather: Gather = no_gather,
    tp: TensorParallel = NO_TENSOR_PARALLEL,
    segment_ids_BT: jax.Array | None = None,
) -> jax.Array:
    """Runs a stack made by `stack_layers` over activations [B, T, D]: x = layer(x, tp) for each layer in order,
    or x = layer(x, tp, segment_ids_BT) when packed-document segment ids (int32 [B, T]) are given.

    Each layer is gathered (`gather`) inside the scan body and checkpointed with `REMAT_POLICIES[remat]`.

    Raises:
      KeyError: `remat` is not one of `REMAT_POLICIES`.
    """
    graphdef, stacked = nnx.split(layers)

    extra = () if segment_ids_BT is None else (segment_ids_BT,)

    def body(x, layer_state):
        layer = gather(nnx.merge(graphdef, layer_state))
        return layer(x, tp, *extra), None

    body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
    x_BTD, _ = jax.lax.scan(body, x_BTD, stacked)
    return x_BTD
