"""AdamW with warmup + decay, global-norm clipping and a weight-decay mask (optax).

Decoupled weight decay (Loshchilov & Hutter 2019) applies to weight matrices and embeddings only, never to
norm scales or biases (parameters with one non-layer dimension).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from jaxpar.config.schema import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """The learning rate as a function of `count`, the number of updates applied before this one.

    With peak = `learning_rate`, end = peak * `min_lr_ratio`, W = `warmup_steps`, S = `total_steps` and
    D = max(S - W, 1), the k-th update (k = count + 1 = 1, 2, ...) uses

        warmup, k <= W:  peak * k / W                     (update 1 already moves: peak / W; update W: peak)
        decay,  k > W:   t = (k - 1 - W) / D, clipped to [0, 1]
                         linear:   peak + (end - peak) * t
                         cosine:   end + (peak - end) * (1 + cos(pi * t)) / 2   (Loshchilov & Hutter 2017)
                         constant: peak

    so update W + 1 starts the decay at peak, and the decay reaches `end` at count S, the rate after the last
    update: the last update (k = S) uses t = (D - 1) / D, one decay step above `end`. No update runs at rate 0
    (unless `min_lr_ratio` = 0 and the run goes past S). `count` is the optimizer's own update count, which
    an update skipped for non-finite gradients does not advance (`build_optimizer`).

    Returns:
      a function int32 count -> float32 learning rate (usable inside jit).
    """
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warmup = cfg.warmup_steps
    decay_steps = max(total_steps - warmup, 1)

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        t = jnp.clip((count - warmup) / decay_steps, 0.0, 1.0)
        if cfg.decay == "cosine":
            decayed = end + (peak - end) * 0.5 * (1.0 + jnp.cos(math.pi * t))
        elif cfg.decay == "linear":
            decayed = peak + (end - peak) * t
        else:
            decayed = jnp.full_like(t, peak)
        if warmup == 0:
            return decayed
        return jnp.where(count < warmup, peak * (count + 1.0) / warmup, decayed)

    return schedule


def weight_decay_mask(logical: dict) -> dict:
    """True for leaves with at least two non-`layers` dimensions (matrices, embeddings)."""
    return jax.tree.map(lambda names: len([n for n in names if n != "layers"]) >= 2, logical,
                        is_leaf=lambda x: isinstance(x, tuple))


def build_optimizer(cfg: OptimizerConfig, logical: dict, total_steps: int) -> optax.GradientTransformation:
    """optax chain: clip by global norm (when `grad_clip_norm` > 0), then AdamW with the schedule and mask,
    skipped as a whole on non-finite gradients (`optax.apply_if_finite`).

    Clipping runs on global arrays outside `shard_map`, so a replicated leaf is counted once and a sharded
    leaf's shards are summed: the norm equals the single-device norm whatever the layout.

    A skipped update leaves the inner state untouched, its update count included, so the next applied update
    uses the rate the skipped one would have used (see `applied_learning_rate`).
    """
    adamw = optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=weight_decay_mask(logical))
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw) if cfg.grad_clip_norm > 0 else adamw
    # A step whose gradients hold a NaN or inf leaves parameters and optimizer state untouched and is counted
    # (ApplyIfFiniteState.notfinite_count / total_notfinite); the training loop decides when to stop.
    return optax.apply_if_finite(tx, max_consecutive_errors=2**31 - 1)


def schedule_count(opt_state) -> jax.Array:
    """The update count the learning-rate schedule reads (`optax.ScaleByScheduleState.count`, int32 scalar):
    updates applied so far, not counting those `optax.apply_if_finite` skipped.

    Raises:
      ValueError: `opt_state` does not hold exactly one schedule state (not built by `build_optimizer`).
    """
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    found = [s.count for s in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(s)]
    if len(found) != 1:
        raise ValueError(f"expected one optax.ScaleByScheduleState in the optimizer state, found {len(found)}; "
                         f"build the optimizer with jaxpar.train.optimizer.build_optimizer")
    return found[0]


def applied_learning_rate(schedule: optax.Schedule, opt_state_before, opt_state_after) -> jax.Array:
    """The learning rate the update from `opt_state_before` to `opt_state_after` applied (float32 scalar):
    `schedule` at the optimizer's own update count before it, or 0.0 when `optax.apply_if_finite` skipped the
    update (non-finite gradients: nothing was applied)."""
    rate = schedule(schedule_count(opt_state_before))
    return jnp.where(opt_state_after.last_finite, rate, jnp.zeros_like(rate))
