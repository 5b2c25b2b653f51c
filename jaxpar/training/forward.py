"""The forward of one microbatch inside the step's shard_map: embedding, the layer stack, head and summed loss on
this device's rows (`loss_body`), and the pieces the pipelined forward shares with it (`gatherer`, `run_blocks`).

Shape letters: b rows of one microbatch on this device; T' = T/t under sequence parallelism, else T.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxpar.model.interface import STACK_ATTRIBUTE, takes_segment_ids
from jaxpar.parallel.gather import module_gatherer
from jaxpar.parallel.pipeline import ordered_after
from jaxpar.parallel.sharding import partitioned_over_data, storage_axes
from jaxpar.parallel.tensor import TensorParallel
from jaxpar.training.context_batch import POSITIONS
from jaxpar.training.fp8_history import split_scales, stack_scales
from jaxpar.training.loss import cross_entropy, summed_loss
from jaxpar.training.moe_loss import moe_loss_terms, moe_sums
from jaxpar.training.plan import StepPlan


def gatherer(plan: StepPlan):
    """The plan's weight gatherer (`jaxpar.parallel.gather.module_gatherer`): each module's weights all-gathered
    over fsdp (and data under ZeRO-3) in the compute dtype right before use, their gradients reduce-scattered in
    the reduce dtype."""
    return module_gatherer(
        plan.mesh_shape,
        partitioned_over_data("params", plan.cfg.optimizer.zero_stage),
        plan.compute_dtype,
        plan.reduce_dtype,
        plan.expert_axes,
    )


def edge_gathered(plan: StepPlan) -> bool:
    """Whether the edge parameters (embedding, final norm, head) are stored sharded over a mesh axis of size > 1,
    so that embedding and head all-gather them (`gatherer`) and reduce-scatter their gradients."""
    return any(plan.mesh_shape[a] > 1 for a in storage_axes("params", plan.cfg.optimizer.zero_stage))


def split_stack(params: dict) -> tuple[dict, dict]:
    """(the layer stack `params["blocks"]`, every other top-level entry: the edge parameters)."""
    return params[STACK_ATTRIBUTE], {k: v for k, v in params.items() if k != STACK_ATTRIBUTE}


def split_microbatches(batch: dict, n: int) -> dict:
    """`batch` (leaves [B, ...]) as `n` microbatches (leaves [n, B/n, ...]), in row order."""
    return {k: v.reshape(n, v.shape[0] // n, *v.shape[1:]) for k, v in batch.items()}


def loss_body(plan: StepPlan, train: bool = True) -> Callable:
    """`loss_sum(params, mb)`: one microbatch's summed loss on this device's rows (inside the shard_map): the
    plan's training loss, or with `train=False` the cross-entropy that evaluation reports.

    With `train` it returns (summed loss, MoE sums): with `model.moe` the loss adds the weighted auxiliary losses
    and the sums are `jaxpar.training.moe_loss.moe_sums`; without, {}. Under FP8 delayed scaling the layer stack
    of `params` carries the scales (`jaxpar.training.fp8_history.FP8_SCALES`) and `mb` its slot."""
    gather = gatherer(plan)
    tp = plan.tensor_parallel
    moe = plan.cfg.model.moe
    order_head = edge_gathered(plan)

    def loss_sum(params: dict, mb: dict):
        layers, fp8_scales = split_scales(params[STACK_ATTRIBUTE])  # FP8 delayed scaling's (`fp8_history`)
        params = {**params, STACK_ATTRIBUTE: layers}
        model = plan.mdef.bind(params)
        x = embed_tokens(model, mb, plan.compute_dtype, gather, tp, plan.cfg.model.first_dense)
        with stack_scales(fp8_scales, mb):
            if train and moe.enabled:
                h, stats = run_blocks(model, x, mb, gather, tp, with_stats=True)
            else:
                h, stats = run_blocks(model, x, mb, gather, tp), None
        if order_head:
            # The head's weight all-gathers after the layer loop, and (transposed) their gradients'
            # reduce-scatters before the backward's layer loop, which reads them through the added zero: nothing
            # else would order them against the loop's collectives, and XLA:CPU may then issue them in another
            # order on each device (`jaxpar.parallel.pipeline.ordered_after`).
            layers, edge = split_stack(params)
            model = plan.mdef.bind({**ordered_after(edge, h), STACK_ATTRIBUTE: layers})
        logits = model.logits(h, gather, tp)
        if not train:
            return summed_loss(cross_entropy, logits, mb, tp)
        loss = summed_loss(plan.loss_fn, logits, mb, tp)
        if stats is None:
            return loss, {}
        sums = moe_sums(stats, mb["loss_mask"])
        return loss + moe_loss_terms(sums, moe), sums

    return loss_sum


def embed_tokens(model, mb: dict, dtype, gather, tp: TensorParallel, first_dense: int = 0) -> jax.Array:
    """`model.embed_tokens` of the microbatch's inputs [b, T] -> [b, T', D] in `dtype`; with `first_dense` (the
    built-in llama's `model.moe.first_dense` blocks, which run with the embedding) also the microbatch's
    packed-document `segment_ids` and context parallelism's rotary `positions`, as `run_blocks` passes them."""
    if not first_dense:
        return model.embed_tokens(mb["inputs"], dtype, gather, tp)
    return model.embed_tokens(mb["inputs"], dtype, gather, tp, mb.get("segment_ids"), mb.get(POSITIONS))


def run_blocks(model, x_BTD: jax.Array, mb: dict, gather, tp: TensorParallel, with_stats: bool = False):
    """`model.run_blocks` on activations [b, T', D], with the microbatch's packed-document `segment_ids` (int32
    [b, T]) when it has them (a model that takes none is never passed any), and under context parallelism its
    rotary `positions` (int32 [b, T/c], `jaxpar.training.context_batch`) as `positions_BT`. With `with_stats`
    (the built-in llama with `model.moe`): `model.run_blocks_with_stats`, returning (activations, router
    statistics).

    Raises:
      ValueError: the microbatch has segment ids and the model's run_blocks takes none.
    """
    kwargs = {"positions_BT": mb[POSITIONS]} if POSITIONS in mb else {}
    run = model.run_blocks_with_stats if with_stats else model.run_blocks
    if "segment_ids" in mb:
        if not takes_segment_ids(model):
            raise ValueError(
                f"the batches carry segment_ids (packed documents) but {type(model).__name__}.run_blocks takes "
                f"none: give it a fourth parameter segment_ids_BT (jaxpar.model.interface), or yield batches "
                f"without segment_ids"
            )
        return run(x_BTD, gather, tp, mb["segment_ids"], **kwargs)
    return run(x_BTD, gather, tp, **kwargs)
