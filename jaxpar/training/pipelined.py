"""The step's pipelined parts (`mesh.pipeline > 1`): the plan's model cut into a pipeline stage's parts
(`stage_parts`) and one accumulation step's gradients through the configured schedule (`pipeline_grads`,
`jaxpar.parallel.pipeline`, `jaxpar.parallel.pipeline_1f1b`), inside the step's shard_map.

Shape letters: b rows of one microbatch on this device; T' = T/t under sequence parallelism, else T; U the
model's MoE blocks (`jaxpar.training.moe_loss`); p stages, v virtual stages per device, m microbatches.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.model.flops import row_flops_per_token
from jaxpar.model.interface import STACK_ATTRIBUTE
from jaxpar.model.stack import active_rows
from jaxpar.parallel import layer_split, zero_bubble
from jaxpar.parallel import pipeline as pipeline_lib
from jaxpar.parallel.pipeline_1f1b import one_f_one_b
from jaxpar.parallel.pipeline_zb import zero_bubble_pipeline
from jaxpar.training.forward import (
    edge_gathered,
    embed_tokens,
    gatherer,
    run_blocks,
    split_microbatches,
    split_stack,
)
from jaxpar.training.fp8_history import SLOT, split_scales, stack_scales
from jaxpar.training.loss import LossFn, cross_entropy, summed_loss
from jaxpar.training.moe_loss import moe_loss_terms, moe_sums
from jaxpar.training.plan import StepPlan


def stage_parts(plan: StepPlan, params: dict, loss_fn: LossFn, train: bool = True) -> pipeline_lib.StageParts:
    """The pipeline stage's parts (`jaxpar.parallel.pipeline.StageParts`) for the plan's model: embedding, this
    stage's blocks, and head + summed `loss_fn` (inside the shard_map; `params` are this device's local
    parameters, split by the parts into the layer stack and the edge parameters outside it).

    With `train` and `model.moe` the blocks also return the weighted auxiliary losses of the stage's MoE units
    (`jaxpar.training.moe_loss.moe_loss_terms`) and their sums (`moe_sums`; "load" [n, E] for the n units the
    call runs: U/p, or U/(pv) per chunk with v virtual stages) as `blocks_loss` terms and stats; evaluation
    (`train=False`) reports the cross-entropy alone. Layers in an uneven split's stage layout (with the mask leaf
    `jaxpar.parallel.layer_split.ACTIVE`) skip their padding rows (`jaxpar.model.stack.active_rows`); with
    `pipeline.vocab_parallel` (training) the parts add `head_vocab`, the head on this stage's vocabulary slice.

    Raises (when the blocks run):
      ValueError: an uneven split's layers and a model whose run_blocks does not use `scan_layers`."""
    gather = gatherer(plan)
    tp = plan.tensor_parallel
    layers, edge = split_stack(params)
    layers = split_scales(without_mask(layers))[0]

    def bind(edge_params: dict, layer_params: dict):
        return plan.mdef.bind({**edge_params, STACK_ATTRIBUTE: layer_params})

    moe = plan.cfg.model.moe
    with_moe = train and moe.enabled
    first_dense = plan.cfg.model.first_dense  # dense blocks that run with the embedding, on the first stage

    def run(layer_params, x, mb):
        if not with_moe:
            return run_blocks(bind(edge, layer_params), x, mb, gather, tp)
        h, stats = run_blocks(bind(edge, layer_params), x, mb, gather, tp, with_stats=True)
        sums = moe_sums(stats, mb["loss_mask"])
        return h, moe_loss_terms(sums, moe), sums

    def blocks(layer_params, x, mb):
        layer_params, fp8_scales = split_scales(layer_params)  # FP8 delayed scaling's (`fp8_history`)
        if layer_split.ACTIVE not in layer_params:
            with stack_scales(fp8_scales, mb):
                return run(layer_params, x, mb)
        # an uneven split's stage layout: skip the padding rows (`jaxpar.parallel.layer_split`)
        weights = {k: a for k, a in layer_params.items() if k != layer_split.ACTIVE}
        with active_rows(layer_params[layer_split.ACTIVE]) as read, stack_scales(fp8_scales, mb):
            out = run(weights, x, mb)
        if not read[1]:
            raise ValueError(
                f"an uneven pipeline split needs the model's blocks to run through jaxpar.model.scan_layers (which "
                f"skips the padding rows of the stage layout); model {plan.cfg.model.name!r}'s run_blocks does "
                f"not: run it with the even split (unset pipeline.stage_layers and pipeline.balance_stages)"
            )
        return out

    head_vocab = None
    if train and plan.cfg.pipeline.vocab_parallel:
        p = plan.mesh_shape[pipeline_lib.AXIS]
        tp_v = dataclasses.replace(tp, vocab_stages=p)
        _, edge_axes = split_stack(plan.logical)

        def head_vocab(e, h, mb):
            return summed_loss(loss_fn, bind(vocab_slice(e, edge_axes, p), layers).logits(h, gather, tp_v), mb, tp_v)

    return pipeline_lib.StageParts(
        embed=lambda e, mb: embed_tokens(bind(e, layers), mb, plan.compute_dtype, gather, tp, first_dense),
        blocks=blocks,
        head=lambda e, h, mb: summed_loss(loss_fn, bind(e, layers).logits(h, gather, tp), mb, tp),
        edge_gathered=edge_gathered(plan),
        blocks_loss=with_moe,
        order_collectives=pipeline_lib.needs_collective_order(plan.platform),
        head_vocab=head_vocab,
    )


def vocab_slice(edge: dict, axes: dict, p: int) -> dict:
    """The edge parameters with every leaf that has a `vocab` dimension cut to this stage's 1/p of its local
    (tensor) shard, the stage's slice of the vocabulary-parallel head (`pipeline.vocab_parallel`): stage s keeps
    rows s*n/p .. (s+1)*n/p - 1 of the n the device holds. Inside the shard_map; `axes` are the leaves' logical
    axes (`StepPlan.logical` without the layer stack)."""
    s = jax.lax.axis_index(pipeline_lib.AXIS)

    def cut(a, names):
        if "vocab" not in names:
            return a
        d = names.index("vocab")
        part = a.shape[d] // p
        return jax.lax.dynamic_slice_in_dim(a, s * part, part, axis=d)

    return jax.tree.map(cut, edge, axes, is_leaf=lambda x: isinstance(x, tuple))


def chunk_placement(plan: StepPlan) -> tuple[int, ...] | None:
    """The device of each model chunk under the configured schedule (`jaxpar.parallel.pipeline.chunk_routes`):
    the V of zb-v (`jaxpar.parallel.zero_bubble`), None for the interleaved ring (chunk c on device c mod p)."""
    if plan.cfg.pipeline.schedule != "zb-v":
        return None
    return zero_bubble.v_shape(plan.mesh_shape[pipeline_lib.AXIS])


def stage_layout(plan: StepPlan) -> layer_split.StageLayout | None:
    """The stage layout of the configured uneven split (`jaxpar.parallel.layer_split.stage_layout`: the rows of
    `pipeline.stage_layers`, or the FLOP-balanced split of `pipeline.balance_stages`), None for the even split."""
    cfg = plan.cfg
    params = lambda: nnx.to_pure_dict(plan.mdef.abstract_state)  # noqa: E731
    return layer_split.stage_layout(cfg, plan.mesh_shape[pipeline_lib.AXIS], lambda: row_flops_per_token(cfg, params()))


def without_mask(layers: dict) -> dict:
    """The layer stack's tree without the stage layout's mask leaf (`jaxpar.parallel.layer_split.ACTIVE`)."""
    return {k: a for k, a in layers.items() if k != layer_split.ACTIVE}


def _pipeline_shapes(plan: StepPlan, batch: dict, m: int) -> tuple[dict, tuple[int, ...]]:
    """(microbatches, each leaf [m, b, ...], and the activation shape [b, T', D] passed between stages)."""
    tp = plan.tensor_parallel
    mbs = split_microbatches(batch, m)
    b, seq = mbs["inputs"].shape[1:]
    return mbs, (b, seq // tp.size if tp.sequence_parallel else seq, plan.cfg.model.d_model)


def pipeline_grads(plan: StepPlan, params: dict, batch: dict, loss_scale: jax.Array) -> tuple[dict, jax.Array, dict]:
    """Gradients, scaled loss and MoE sums of one accumulation step's local batch through the configured
    pipeline schedule (`jaxpar.parallel.pipeline_1f1b.one_f_one_b` or `jaxpar.parallel.pipeline.gpipe`), split
    into m = `pipeline.microbatches` microbatches.

    The MoE sums ({} without `model.moe`) are this stage's: its units' "aux", "z" and "dropped", and "load"
    [U, E] in model order with this stage's rows filled and zeros elsewhere, so their sum over `pipeline` is the
    whole model's."""
    m = plan.cfg.pipeline.microbatches
    slot = batch.get(SLOT)  # FP8 delayed scaling: this accumulation step's index; its microbatches' are m times
    batch = {k: a for k, a in batch.items() if k != SLOT}
    mbs, act_shape = _pipeline_shapes(plan, batch, m)
    if slot is not None:
        mbs[SLOT] = slot * m + jnp.arange(m, dtype=jnp.int32)
    name = plan.cfg.pipeline.schedule
    schedules: dict[str, Callable] = {"1f1b": one_f_one_b, "gpipe": pipeline_lib.gpipe}
    # a zero-bubble schedule runs its table (`jaxpar.parallel.pipeline_zb`)
    schedule = schedules.get(name, functools.partial(zero_bubble_pipeline, schedule=name))
    layers, edge = split_stack(params)
    (g_layers, g_edge), loss, stats = schedule(
        stage_parts(plan, params, plan.loss_fn),
        layers,
        edge,
        mbs,
        p=plan.mesh_shape[pipeline_lib.AXIS],
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
        layout = stage_layout(plan)
        if layout is not None:
            sums["load"] = layer_split.rows_in_model_order(stats["load"], layout)
        else:
            sums["load"] = pipeline_lib.chunk_rows_in_model_order(
                stats["load"], plan.mesh_shape[pipeline_lib.AXIS], chunk_placement(plan)
            )
    return {**g_edge, STACK_ATTRIBUTE: without_mask(g_layers)}, loss, sums


def pipelined_eval_loss(plan: StepPlan, params: dict, batch: dict) -> jax.Array:
    """This stage's summed cross-entropy of the local `batch` through the pipeline's forward
    (`jaxpar.parallel.pipeline.forward_loss`), in m = gcd(rows, `pipeline.microbatches`) microbatches: the
    last stage's loss, 0 on the others (inside the shard_map)."""
    rows = batch["inputs"].shape[0]
    m = math.gcd(rows, plan.cfg.pipeline.microbatches)
    mbs, act_shape = _pipeline_shapes(plan, batch, m)
    layers, edge = split_stack(params)  # storage order: evaluation runs the even split
    loss, _ = pipeline_lib.forward_loss(
        stage_parts(plan, params, cross_entropy, train=False),
        layers,
        edge,
        mbs,
        p=plan.mesh_shape[pipeline_lib.AXIS],
        m=m,
        act_shape=act_shape,
        act_dtype=plan.compute_dtype,
    )
    return loss
