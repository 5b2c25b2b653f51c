"""The train step: forward/backward inside one `jax.shard_map` over the whole mesh, optax update outside it.

Shape letters: B the rows of the global batch (`train.global_batch_size`) at the step's interface; M the step's
microbatches (`train.grad_accum_steps`, times `pipeline.microbatches` without a pipeline, whose microbatches are
then more accumulation).

Inside the shard_map every collective is explicit:
  * fsdp (and data under ZeRO-3): each module's weights are all-gathered right before use and their gradients
    reduce-scattered by the gather's transpose (`jaxpar.parallel.gather`);
  * data: the accumulated gradients are reduced once per step, after all microbatches: an all-reduce (`psum`)
    when gradients stay replicated over `data` (ZeRO-0/1), a reduce-scatter (`psum_scatter`) when they end
    partitioned (ZeRO-2); under ZeRO-3 the gather's transpose already did it (`jaxpar.training.grad_reduction`).
The optimizer update then runs on global arrays with fixed `NamedSharding`s; it is elementwise, so the compiler
adds only the all-gather of updated parameters that ZeRO-1/2 need.

The loss is the mean cross-entropy over every valid (mask = 1) token of the global batch: each microbatch's
summed loss is divided by the global count of valid tokens, so accumulation over any split is exact and an
all-masked microbatch contributes zero (no NaN). A caller's own loss (`build_plan(..., loss_fn=...)`, see
`jaxpar.training.loss`) replaces the cross-entropy's per-microbatch sum under the same normalisation; a caller's own
optax optimizer (`build_plan(..., optimizer=...)`) replaces the default AdamW.

The parts, each in its own module of `jaxpar.training`: the plan (`plan`: `StepPlan`, `build_plan`), the state
(`state`: `init_state`, `abstract_state`), one microbatch's forward (`forward`), the gradient reductions
(`grad_reduction`) and the pipelined forward and backward (`pipelined`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config.mesh_axes import TOKEN_AXES
from jaxpar.model.interface import STACK_ATTRIBUTE
from jaxpar.parallel import layer_split
from jaxpar.parallel import pipeline as pipeline_lib
from jaxpar.training import fp8_history, router_bias
from jaxpar.training.context_batch import context_batch
from jaxpar.training.forward import loss_body, split_microbatches, split_stack
from jaxpar.training.grad_reduction import reduce_over_data, reduce_replicated
from jaxpar.training.moe_loss import MEAN_KEYS, moe_metrics, zero_sums
from jaxpar.training.optimizer import applied_learning_rate, nonfinite_state
from jaxpar.training.pipelined import (
    chunk_placement,
    pipeline_grads,
    pipelined_eval_loss,
    stage_layout,
    without_mask,
)
from jaxpar.training.plan import StepPlan


def make_grad_fn(plan: StepPlan) -> Callable:
    """Returns `grad_fn(params, batch[, fp8_scales]) -> (grads, loss_sum, n_tokens)` as one shard_map over the mesh.

    Args (of the returned function):
      params: parameter tree sharded as `plan.specs["params"]`.
      batch: {"inputs", "targets": int32 [B, T], "loss_mask": float32 [B, T]} and optionally "segment_ids": int32
        [B, T] (packed documents: attention stays within each, `jaxpar.model.attention`), sharded as
        `plan.batch_sharding`.
      fp8_scales: under FP8 delayed scaling (only then), the scales the GEMMs quantise with, fp32 [L, O, 3]
        (`jaxpar.training.fp8_history.step_scales` of a history).

    Returns:
      grads of the global token-mean loss, sharded as `plan.specs["grads"]`, in the parameter dtype;
      loss_sum: the plan's summed loss (default: token cross-entropy) over the global batch divided by n_tokens
        (so: the mean), fp32;
      n_tokens: global count of valid tokens (sum of loss_mask), fp32.
    """
    grad_fn = _grad_fn_with_moe(plan)
    return lambda params, batch, *fp8_scales: grad_fn(params, batch, *fp8_scales)[:3]


def _grad_fn_with_moe(plan: StepPlan) -> Callable:
    """`make_grad_fn`'s function with a fourth output: the global MoE sums (`jaxpar.training.moe_loss`; "aux"
    and "z" divided by the global token count), or {} without `model.moe`; and under FP8 delayed scaling a
    fifth: the amaxes the GEMMs saw, fp32 [L, O, 3] (`jaxpar.training.fp8_history.seen_amax`)."""
    accumulate = _accumulated_grads(plan)
    stages = plan.mesh_shape[pipeline_lib.AXIS]
    loss_axes = TOKEN_AXES + ((pipeline_lib.AXIS,) if stages > 1 else ())
    virtual = plan.cfg.pipeline.virtual_stages if stages > 1 else 1
    delayed = fp8_history.delayed_config(plan.cfg)
    stack_spec = P(pipeline_lib.AXIS) if stages > 1 else P()  # the history's rows go with their layers

    def body(params, batch, *fp8_scales):
        if delayed:  # the scales and per-microbatch amax probes beside the layers (`jaxpar.training.fp8_history`)
            params = fp8_history.with_scales(params, fp8_scales[0], _step_microbatches(plan))
        batch = context_batch(batch, plan.context)  # the load-balanced slices (jaxpar.training.context_batch)
        # psum over the token-splitting axes: the global count of valid tokens normalises every microbatch.
        n_tokens = jax.lax.psum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), TOKEN_AXES)
        denom = jnp.maximum(n_tokens, 1.0)
        batch = pipeline_lib.ordered_after(batch, n_tokens)  # the accumulation loop after this psum
        # Interleaved 1F1B takes the stage's layers in chunk order, once per step (parameters stay in model
        # order: checkpoints do not depend on the schedule); the gradients go back after the accumulation loop.
        staged = params
        layout = stage_layout(plan) if stages > 1 else None
        if layout is not None:  # an uneven split: the stage layout (`jaxpar.parallel.layer_split`)
            staged = {**params, STACK_ATTRIBUTE: layer_split.to_stage_layout(params[STACK_ATTRIBUTE], layout)}
        elif virtual > 1:
            placement = chunk_placement(plan)
            staged = {
                **params,
                STACK_ATTRIBUTE: pipeline_lib.to_chunk_order(params[STACK_ATTRIBUTE], stages, virtual, placement),
            }
        grads, loss, sums = _after_every_reduction(accumulate(params, staged, batch, denom))
        # the probes' cotangents (the amaxes seen) stay fp32 and take no part in the gradients' reductions; the
        # scales' (zeros) are dropped
        layers, fp8 = fp8_history.split_scales(grads[STACK_ATTRIBUTE])
        seen = None if fp8 is None else fp8[1]
        grads = jax.tree.map(lambda g: g.astype(plan.reduce_dtype), {**grads, STACK_ATTRIBUTE: layers})
        if layout is not None or virtual > 1:
            layers, edge = split_stack(grads)
            if seen is not None:
                layers = {**layers, fp8_history.FP8_PROBES: seen}
            if layout is not None:
                layers = layer_split.from_stage_layout(layers, layout)
            else:
                layers = pipeline_lib.from_chunk_order(layers, stages, virtual, placement)
            if seen is not None:
                seen = layers.pop(fp8_history.FP8_PROBES)
            # the edge gradients' reductions after the permutes (one collective order on every device)
            grads = {**pipeline_lib.ordered_after(edge, layers), STACK_ATTRIBUTE: layers}
        grads = reduce_replicated(plan, grads)
        grads = reduce_over_data(plan, grads)
        grads = jax.tree.map(lambda g: g.astype(plan.param_dtype), grads)
        grads = _after_every_reduction(grads)
        # psum over the token-splitting axes (each device summed only its own tokens) and over pipeline (only
        # the last stage computed a loss).
        loss = jax.lax.psum(loss, loss_axes)
        # MoE sums: each device summed its own tokens (tensor ranks alike: counted once, like the loss) and, with
        # a pipeline, its own stage's MoE units (psum over pipeline, like the loss); the token-weighted ones are
        # normalised like the loss.
        sums = {k: jax.lax.psum(v / denom if k in MEAN_KEYS else v, loss_axes) for k, v in sums.items()}
        if seen is None:
            return grads, loss, n_tokens, sums
        # the same on every device of a stage: each GEMM's amaxes are max-reduced over the axes splitting it
        return grads, loss, n_tokens, sums, fp8_history.seen_amax(seen)

    return jax.shard_map(
        body,
        mesh=plan.mesh,
        # one spec for every batch array: the three of `jaxpar.data.batch` and an optional "segment_ids"
        in_specs=(plan.specs["params"], plan.batch_sharding.spec, *((stack_spec,) if delayed else ())),
        out_specs=(plan.specs["grads"], P(), P(), P(), *((stack_spec,) if delayed else ())),
        check_vma=False,
    )


def _step_microbatches(plan: StepPlan) -> int:
    """M: the microbatches of one step, gradient accumulation steps x pipeline microbatches."""
    return plan.cfg.train.grad_accum_steps * plan.cfg.pipeline.microbatches


def _after_every_reduction(tree):
    """`tree` unchanged in value, each leaf computed after every leaf (`pipeline.ordered_after`): whatever reads
    one of them starts after the collectives that made all of them.

    Why: XLA may move a loop's last collectives out of the loop (the pipeline's embedding-gradient cond, with a
    reduce-scatter over data), and the collectives that follow (the reductions of the other gradients, the
    loss psum, the optimizer's compiler-inserted global norm) could then start while they run, in another order
    on each device (`jaxpar.analysis.hlo.collective_order`). Across processes XLA:CPU's collectives then mixed
    up the messages of the two: about one step in 40 of a 2-process data x tensor x pipeline step under load
    updated some weights of a process by up to 8% of their size.
    """
    return pipeline_lib.ordered_after(tree, tree)


def _accumulated_grads(plan: StepPlan) -> Callable:
    """`accumulate(params, staged, batch, denom) -> (grads, loss, sums)` inside the shard_map: the fp32 sums over
    the step's M microbatches of this device's rows of the gradients, of the loss divided by `denom` (the global
    token count) and of the MoE sums ({} without `model.moe`). Without a pipeline each microbatch is a
    `jax.value_and_grad` of the forward (`jaxpar.training.forward.loss_body`) on `params`; with one, a run of
    the pipeline schedule on `staged` (the layers in the schedule's order, `jaxpar.training.pipelined`)."""
    loss_sum = loss_body(plan)
    moe = plan.cfg.model.moe
    delayed = fp8_history.delayed_config(plan.cfg)
    stages, pipe_mb = plan.mesh_shape[pipeline_lib.AXIS], plan.cfg.pipeline.microbatches
    # Without a pipeline its microbatches are just more gradient accumulation.
    accum = plan.cfg.train.grad_accum_steps * (pipe_mb if stages == 1 else 1)

    def accumulate(params, staged, batch, denom):
        def scaled(p, mb):
            loss, sums = loss_sum(p, mb)
            return loss / denom, sums

        def micro(carry, xs):
            g_acc, l_acc, s_acc = carry
            mb, slot = xs
            if delayed:  # this microbatch's slot among the step's (a pipeline's: its first one's / m)
                mb = {**mb, fp8_history.SLOT: slot}
            if stages > 1:
                g, loss, sums = pipeline_grads(plan, staged, mb, 1.0 / denom)
            else:
                (loss, sums), g = jax.value_and_grad(scaled, has_aux=True)(params, mb)
            g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
            s_acc = jax.tree.map(lambda a, b: a + b, s_acc, sums)
            return (g_acc, l_acc + loss, s_acc), None

        # the gradients' shapes: the layers' as the schedule runs them (an uneven split's stage layout)
        shaped = {**staged, STACK_ATTRIBUTE: without_mask(staged[STACK_ATTRIBUTE])} if stages > 1 else params
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), shaped)
        sums0 = zero_sums(plan.cfg.model.stack_depth, moe.num_experts) if moe.enabled else {}
        carry0 = (zeros, jnp.zeros((), jnp.float32), sums0)
        xs = (split_microbatches(batch, accum), jnp.arange(accum, dtype=jnp.int32))
        (grads, loss, sums), _ = jax.lax.scan(micro, carry0, xs)
        return grads, loss, sums

    return accumulate


def make_train_step(plan: StepPlan) -> jax.stages.Wrapped:
    """Returns the jitted `train_step(state, batch) -> (state, metrics)`; the input state is donated.

    metrics: {"loss": token-mean loss (nats for the cross-entropy), "grad_norm": global L2 norm before clipping,
              "learning_rate": the rate this step's update applied, from the optimizer's own update count
              (`jaxpar.training.optimizer.applied_learning_rate`; 0.0 when the update was skipped),
              "tokens": valid tokens in the batch} (fp32 scalars),
             "bad_steps_in_a_row" and "skipped_steps" (int32): updates skipped for non-finite gradients,
             consecutive up to this step and in total.
    With `model.moe` the loss adds the weighted auxiliary losses, and the metrics add moe_aux_loss,
    moe_z_loss, moe_dropped_fraction and moe_load_max_mean (`jaxpar.training.moe_loss.moe_metrics`); with sigmoid
    gating the step also moves the balancing biases (`jaxpar.training.router_bias`) and reports
    moe_router_bias_spread.
    "learning_rate" is left out when `plan.schedule` is None (a caller's optimizer without a `learning_rate`
    given to `build_plan`); "bad_steps_in_a_row" and "skipped_steps" are left out when the optimizer state holds
    no `jaxpar.training.optimizer.skip_nonfinite` wrapper (such an optimizer applies every update, finite or not).
    The default optimizer reports all of them.
    """
    grad_fn = _grad_fn_with_moe(plan)
    delayed = fp8_history.delayed_config(plan.cfg)
    moe = plan.cfg.model.moe
    biased = router_bias.has_bias(moe)

    def train_step(state, batch):
        fp8_scales = (fp8_history.step_scales(plan.cfg, state["fp8"][fp8_history.HISTORY]),) if delayed else ()
        grads, loss, n_tokens, sums, *seen = grad_fn(state["params"], batch, *fp8_scales)
        grads32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        grad_norm = optax.tree.norm(grads32)
        target = state["master"] if plan.has_master else state["params"]
        # the optimizer's update (a cond with collectives under ZeRO) after the norm's and the loss's all-reduces
        grads32 = pipeline_lib.ordered_after(grads32, (grad_norm, loss, n_tokens, sums))
        updates, opt_state = plan.tx.update(grads32, state["opt_state"], target)
        target = optax.apply_updates(target, updates)
        skip = nonfinite_state(opt_state)
        applied = skip.last_finite if skip is not None else jnp.bool_(True)
        if biased:  # the balancing biases follow the step's global load, not the optimizer (`router_bias`)
            before = state["master"] if plan.has_master else state["params"]
            target = router_bias.next_params(target, before, sums["load"], moe.bias_update_rate, applied)
        new = {"step": state["step"] + 1, "opt_state": opt_state}
        if plan.has_master:
            new["master"] = target
            new["params"] = router_bias.cast_params(target, plan.param_dtype)  # biases stay fp32
        else:
            new["params"] = target
        metrics = {"loss": loss, "grad_norm": grad_norm, **_rate_metrics(plan, state["opt_state"], opt_state)}
        metrics["tokens"] = n_tokens
        if sums:
            metrics.update(moe_metrics(sums))
        if biased:
            metrics[router_bias.SPREAD_METRIC] = router_bias.spread(target, plan.cfg.model.stack_depth)
        if skip is not None:
            metrics["bad_steps_in_a_row"] = skip.notfinite_count
            metrics["skipped_steps"] = skip.total_notfinite
        if delayed:  # the amaxes into the history, unless the update was skipped
            new["fp8"] = fp8_history.next_history(state["fp8"], seen[0], applied)
        return new, metrics

    replicated = NamedSharding(plan.mesh, P())
    return jax.jit(
        train_step,
        in_shardings=(plan.state_shardings, plan.batch_sharding),  # every batch array, segment_ids included
        out_shardings=(plan.state_shardings, replicated),
        donate_argnums=0,
        keep_unused=True,
    )  # the whole state is an argument, even a flag the update only writes


def _rate_metrics(plan: StepPlan, old_opt_state, opt_state) -> dict:
    """{"learning_rate": the rate this step's update applied} (module docstring of `make_train_step`), or {}
    when `plan.schedule` is None."""
    if callable(plan.schedule):
        # Not plan.schedule(state["step"]): a skipped update does not advance the optimizer's count.
        return {"learning_rate": applied_learning_rate(plan.schedule, old_opt_state, opt_state)}
    if plan.schedule is None:
        return {}
    rate, skip = jnp.float32(plan.schedule), nonfinite_state(opt_state)
    return {"learning_rate": rate if skip is None else jnp.where(skip.last_finite, rate, 0.0)}


def make_eval_step(plan: StepPlan) -> jax.stages.Wrapped:
    """Returns jitted `eval_step(params, batch) -> (loss_sum, n_tokens)`: summed token loss (fp32 nats) and
    valid-token count of a global batch, for a token-mean over several batches. Always the cross-entropy,
    whatever the plan's training loss (`jaxpar.training.loss`).

    With `mesh.pipeline > 1` the forward runs through the pipeline stages (`jaxpar.training.pipelined.
    pipelined_eval_loss`: each device keeps its own stage's layers), with each device's rows split into
    gcd(rows, pipeline.microbatches) microbatches."""
    loss_sum = loss_body(plan, train=False)
    stages = plan.mesh_shape[pipeline_lib.AXIS]

    def body(params, batch):
        batch = context_batch(batch, plan.context)
        # psum over the token-splitting axes: each device saw only its own tokens (and over pipeline: only the
        # last stage computed a loss).
        if stages > 1:
            total = jax.lax.psum(pipelined_eval_loss(plan, params, batch), TOKEN_AXES + (pipeline_lib.AXIS,))
        else:
            total = jax.lax.psum(loss_sum(params, batch), TOKEN_AXES)
        count = jax.lax.psum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), TOKEN_AXES)
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
