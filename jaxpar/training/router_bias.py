"""DeepSeek-V3's auxiliary-loss-free load balancing (technical report, arXiv 2412.19437, section 2.1.2): the
per-expert bias b [E] of each MoE block that sigmoid gating adds to the affinities for the top-k choice
(`jaxpar.model.moe.route`), moved after every train step against the step's expert load:

    b_i <- b_i + gamma * sign(mean_j load_j - load_i)        (gamma = model.moe.bias_update_rate)

so an overloaded expert's bias drops by gamma, an underloaded one's rises by gamma, and one exactly at the mean
keeps it. load_i counts the assignments (token, choice) routed to expert i over the step's whole global batch:
every data, fsdp and context rank's rows and every microbatch (the step's MoE sums, `jaxpar.training.moe_loss`,
"load" [U, E], U the MoE blocks of the layer stack).

Where the bias lives: a parameter of the MoE block, `MoE.router_bias` (fp32 zeros at init, logical axes None), so
it is stacked with its block (leading `layers` dimension: [U, E]), placed on its block's pipeline stage (and moved
with its layers by every pipeline layout), replicated over every other axis (data, fsdp, tensor and the expert
axes: the router is never split), checkpointed and restored with the parameters, and kept fp32 in the 16p
layout's master copy and in its parameter copy too (`cast_params`). It is not trained by gradient: the router reads
it through `jax.lax.stop_gradient` and only for the top-k indices, so its gradient is zero, and the train step
(`jaxpar.training.step.make_train_step`) overwrites whatever the optimizer made of it (weight decay, say) with
`next_params`: the rule above applied to the bias from before the step. The load is the global sum the step already
makes (psum over the token axes and pipeline), the same on every device, and the update runs on the replicated bias
outside the shard_map, so every data rank holds the same bias after every step. A step whose update the non-finite
skip drops (`jaxpar.training.optimizer.skip_nonfinite`) leaves the bias as it was.

This path is simpler than FP8 delayed scaling's separate train-state entry (`jaxpar.training.fp8_history`),
which must enter the layer stack inside the step because its amaxes come out as cotangents; the bias needs
nothing from the backward pass, only the load the step already returns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.config.schema import MoEConfig
from jaxpar.training.moe_loss import BIAS_SPREAD

BIAS = "router_bias"  # the MoE block's parameter name (`jaxpar.model.moe.MoE.router_bias`)
SPREAD_METRIC = BIAS_SPREAD  # the train step's metric (`spread`)


def has_bias(moe: MoEConfig) -> bool:
    """Whether the model of `model.moe` has balancing biases: experts with sigmoid gating."""
    return moe.enabled and moe.gating == "sigmoid"


def updated_bias(bias_UE: jax.Array, load_UE: jax.Array, rate: float) -> jax.Array:
    """b + rate * sign(mean over experts of load - load) (module docstring), in the bias's dtype.

    Args:
      bias_UE: the biases [U, E] (or [E]).
      load_UE: assignments routed to each expert over the step's global batch, fp32, the bias's shape.
      rate: gamma, `model.moe.bias_update_rate` (>= 0).
    """
    load = load_UE.astype(jnp.float32)
    step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return (bias_UE.astype(jnp.float32) + step).astype(bias_UE.dtype)


def _bias_leaves(params: dict) -> list[tuple[tuple, jax.Array]]:
    return [
        (path, leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        if getattr(path[-1], "key", None) == BIAS
    ]


def next_params(params: dict, before: dict, load_UE: jax.Array, rate: float, applied: jax.Array) -> dict:
    """`params` (the optimizer's update of `before`) with every balancing bias replaced by the rule's update of
    its value in `before` where the step's update was `applied` (bool scalar), else by that value unchanged.

    Args:
      params, before: parameter trees of the same structure (the state's "params", or "master" under 16p).
      load_UE: the step's global expert load, fp32 [U, E] (`jaxpar.training.moe_loss` "load").
      rate: `model.moe.bias_update_rate`.
      applied: whether the optimizer applied this step's update.

    Raises:
      ValueError: a bias whose shape is not the load's (a model family that keeps its MoE blocks outside the
        layer stack).
    """
    old = dict(_bias_leaves(before))
    for path, leaf in old.items():
        stored = leaf.ndim == 2 and leaf.shape[0] > load_UE.shape[0] and leaf.shape[1:] == load_UE.shape[1:]
        if stored:  # the stack's zero rows after its last block (`jaxpar.parallel.layer_split.stored_rows`): no load
            load_UE = jnp.pad(load_UE, [(0, leaf.shape[0] - load_UE.shape[0]), (0, 0)])  # so their bias stays 0
        if leaf.shape != load_UE.shape:
            where = "/".join(str(getattr(k, "key", k)) for k in path)
            raise ValueError(
                f"model.moe.gating=sigmoid: the balancing bias {where} has shape {leaf.shape}, the step's expert "
                f"load {load_UE.shape} ([MoE blocks of the layer stack, experts]); keep the MoE blocks in the "
                f"stacked layers"
            )

    def replace(path, leaf):
        if path not in old:
            return leaf
        return jnp.where(applied, updated_bias(old[path], load_UE, rate), old[path])

    return jax.tree_util.tree_map_with_path(replace, params)


def cast_params(params: dict, dtype) -> dict:
    """The parameter copy the forward reads: every leaf cast to `dtype` (the 16p layout's bfloat16) but the
    balancing biases, kept fp32: a bias moves by gamma = 0.001 per step and a bfloat16 bias of magnitude 1 would
    round away steps below 0.008 in the choice."""

    def cast(path, leaf):
        return leaf if getattr(path[-1], "key", None) == BIAS else leaf.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


def spread(params: dict, blocks: int | None = None) -> jax.Array:
    """moe_router_bias_spread: max_i b_i - min_i b_i of each MoE block's bias, mean over the blocks (fp32 scalar;
    0 for a model without biases). How far auxiliary-loss-free balancing has pushed the experts apart. `blocks`:
    the stack's MoE blocks, when it is stored with zero rows after them (`jaxpar.parallel.layer_split`)."""
    leaves = [leaf[:blocks].astype(jnp.float32) for _, leaf in _bias_leaves(params)]
    if not leaves:
        return jnp.zeros((), jnp.float32)
    per_block = [jnp.reshape(jnp.max(b, axis=-1) - jnp.min(b, axis=-1), (-1,)) for b in leaves]
    return jnp.mean(jnp.concatenate(per_block))
