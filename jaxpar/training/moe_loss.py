"""The mixture-of-experts auxiliary losses and metrics of the train step, from the router statistics of
`jaxpar.model.moe` (stacked over the U MoE blocks by `Llama.run_blocks_with_stats`).

How the auxiliary losses are normalised so that every layout computes the single-device value: the step sums
each microbatch's loss over its rows and divides by the global count of valid tokens (`jaxpar.training.loss`).
The load-balancing loss is defined per sequence (f_i and P_i over the sequence's own tokens: the capacity group
too), and each sequence enters with the weight of its valid tokens, sum_t loss_mask. So

    moe_aux_loss = sum over sequences of (valid tokens * aux) / (valid tokens of the global batch)

is additive over rows: any split of the rows over data, fsdp and microbatches sums to the same numerator, and
the denominator is the step's. Tensor ranks all see every token of their rows and compute it identically (it is
counted once, like the loss). The router z-loss is per token, weighted by loss_mask like the cross-entropy.
Both are summed over the U MoE blocks in the training loss:

    loss = cross-entropy + aux_loss_weight * sum_u aux_u + z_loss_weight * sum_u z_u,

and reported as their means over the U blocks (`moe_metrics`).

DeepSeek-V3's sequence-wise balance loss (technical report, arXiv 2412.19437, section 2.1.2, eq. 17-20) is
L_Bal = alpha * sum_i f_i P_i per sequence, f_i = E / (k T) * (tokens of the sequence choosing i), P_i the mean
over its T tokens of the normalised affinities s'_i (sigmoid gating, `jaxpar.model.moe.route`): that sum is each
sequence's aux (E times the fraction of its assignments times P_i). So aux_loss_weight is the paper's alpha for
one MoE block, the loss sums the blocks' terms (alpha per layer, as the paper's per-layer balance loss), and
the sequences enter weighted by their valid tokens: for sequences without padding, the mean over the global
batch's sequences. DeepSeek-V3 sets alpha = 0.0001 (section 4.2), so model.moe.aux_loss_weight=0.0001.

Inside pipeline stages (`jaxpar.parallel.pipeline`, `StageParts.blocks_loss`) each stage computes the sums of its
own MoE units for each microbatch: the weighted terms enter the loss there, scaled by 1 / global tokens like the
head's loss, so the backward of each stage carries their gradient through its own routers and into its input
gradient. The scalar sums add over stages (psum over `pipeline`, as the loss); each stage fills its units' rows
of "load" [U, E] in model order (with virtual stages, from its chunks: model chunk j*p + s in chunk j of stage s)
and leaves the others zero, so the same psum gives the whole model's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.config.schema import MoEConfig

# The per-microbatch sums the step accumulates (all fp32): "aux" and "z" are token-weighted (divided by the
# global token count like the loss), "load" [U, E] and "dropped" are raw assignment counts.
MEAN_KEYS = ("aux", "z")
# The balancing biases' spread under sigmoid gating (`jaxpar.training.router_bias.spread`, a train step metric).
BIAS_SPREAD = "moe_router_bias_spread"
# The MoE metrics of the train step and the metrics rows: `moe_metrics`' and, with sigmoid gating, BIAS_SPREAD.
MOE_METRICS = ("moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "moe_load_max_mean", BIAS_SPREAD)


def moe_sums(stats: dict, mask_BT: jax.Array) -> dict:
    """One microbatch's sums from the stacked router statistics (leading U) and its loss_mask [b, T].

    Returns {"aux": sum_u sum_rows valid_r * aux_{u,r}, "z": sum_u sum_tokens mask * z, "load": [U, E]
    assignments per expert, "dropped": assignments dropped for capacity}, fp32.
    """
    mask = mask_BT.astype(jnp.float32)
    return {
        "aux": jnp.sum(stats["aux_B"] * jnp.sum(mask, axis=-1)),
        "z": jnp.sum(stats["z_BT"] * mask),
        "load": stats["load_E"],
        "dropped": jnp.sum(stats["dropped"]),
    }


def moe_loss_terms(sums: dict, moe: MoEConfig) -> jax.Array:
    """The weighted auxiliary terms added to the microbatch's summed loss: aux_loss_weight * aux +
    z_loss_weight * z (fp32 scalar)."""
    return moe.aux_loss_weight * sums["aux"] + moe.z_loss_weight * sums["z"]


def zero_sums(n_units: int, num_experts: int) -> dict:
    """The accumulator of `moe_sums` before the first microbatch."""
    zero = jnp.zeros((), jnp.float32)
    return {"aux": zero, "z": zero, "load": jnp.zeros((n_units, num_experts), jnp.float32), "dropped": zero}


def moe_metrics(sums: dict) -> dict:
    """Metrics from the step's global sums ("aux" and "z" already divided by the global token count):

    moe_aux_loss: load-balancing loss, mean over MoE blocks (1.0 = balanced, E = every token on one expert);
    moe_z_loss: router z-loss, mean over MoE blocks;
    moe_dropped_fraction: dropped / all (token, expert) assignments of the step, over all MoE blocks;
    moe_load_max_mean: tokens of the busiest expert / mean tokens per expert, mean over MoE blocks (1.0 =
      balanced).
    """
    load = sums["load"]
    units = load.shape[0]
    return {
        "moe_aux_loss": sums["aux"] / units,
        "moe_z_loss": sums["z"] / units,
        "moe_dropped_fraction": sums["dropped"] / jnp.maximum(jnp.sum(load), 1.0),
        "moe_load_max_mean": jnp.mean(jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9)),
    }
