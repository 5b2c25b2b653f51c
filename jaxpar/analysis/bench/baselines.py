"""Baselines that benchmarks compare jaxpar's train step against, and the random batches they run on.

Shape letters as in the `jaxpar` glossary; B: the rows of a global batch.

  * `reference_step`: a minimal hand-written Flax NNX + optax step (same loss, clipping, AdamW schedule and
    weight-decay mask) on one device: the "no framework" cost of a step.
  * `compiler_chosen_step`: jaxpar's loss, gradient and optax update as one jit over global arrays, with the
    parameters placed by jaxpar's shardings but no shard_map: the XLA partitioner picks every collective.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import Config
from jaxpar.data.batch import BATCH_KEYS
from jaxpar.model.llama import Llama
from jaxpar.parallel.tensor import NO_TENSOR_PARALLEL
from jaxpar.training.optimizer import learning_rate_schedule
from jaxpar.training.plan import StepPlan


def reference_step(cfg: Config, compute_dtype):
    """Minimal NNX + optax step: token-mean masked cross-entropy, value_and_grad, global-norm clip + AdamW
    (the config's schedule; decay on matrices and embeddings only), jit with donation, computing in
    `compute_dtype` (a jnp dtype: the plan's, `jaxpar.training.plan.StepPlan.compute_dtype`, so both steps
    compute alike).

    Returns:
      (step, params, opt_state): `step(params, opt_state, batch) -> (params, opt_state, loss)` (a jitted
      function donating its first two arguments), and the initial params and optimizer state (on the default
      device).
    """
    graphdef, params = nnx.split(Llama(cfg.model, nnx.Rngs(cfg.train.seed)))
    o, dtype = cfg.optimizer, compute_dtype

    # decay matrices and embeddings only (>= 2 dims besides the stacked `layers` dim of block params)
    def decay_mask(p):
        return jax.tree_util.tree_map_with_path(lambda path, x: x.ndim - (path[0].key == "blocks") >= 2, p)

    tx = optax.chain(
        optax.clip_by_global_norm(o.grad_clip_norm),
        optax.adamw(
            learning_rate_schedule(o, cfg.train.steps),
            b1=o.b1,
            b2=o.b2,
            eps=o.eps,
            weight_decay=o.weight_decay,
            mask=decay_mask,
        ),
    )

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["inputs"], dtype).astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(ce * batch["loss_mask"]) / jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, params, tx.init(params)


def compiler_chosen_step(plan: StepPlan) -> jax.stages.Wrapped:
    """The same loss, gradient and optax update as `make_train_step(plan)`, jitted on global arrays: the
    partitioner inserts every collective from the parameter and batch shardings alone.

    Returns:
      a jitted `step(state, batch) -> (state, {"loss", "grad_norm"})` with `plan.state_shardings` in and out,
      donating the state.
    """

    def loss_fn(params, batch):
        logits = plan.global_mdef.bind(params)(batch["inputs"], plan.compute_dtype)
        return NO_TENSOR_PARALLEL.cross_entropy_sum(logits, batch["targets"], batch["loss_mask"]) / jnp.maximum(
            jnp.sum(batch["loss_mask"]), 1.0
        )

    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        target = state["master"] if plan.has_master else state["params"]
        updates, opt_state = plan.tx.update(grads, state["opt_state"], target)
        target = optax.apply_updates(target, updates)
        new = {"step": state["step"] + 1, "opt_state": opt_state, "params": target}
        if plan.has_master:
            new["master"] = target
            new["params"] = jax.tree.map(lambda p: p.astype(plan.param_dtype), target)
        return new, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    batch_shardings = {k: plan.batch_sharding for k in BATCH_KEYS}
    return jax.jit(
        step,
        in_shardings=(plan.state_shardings, batch_shardings),
        out_shardings=(plan.state_shardings, NamedSharding(plan.mesh, P())),
        donate_argnums=0,
    )
