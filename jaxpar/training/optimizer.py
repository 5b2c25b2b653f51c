"""The default optimizer (AdamW with warmup + decay, global-norm clipping and a weight-decay mask, optax), the
non-finite skip that any optimizer can be wrapped in, and the readers the train step's metrics use.

Decoupled weight decay (Loshchilov & Hutter 2019) applies to weight matrices and embeddings only, never to
norm scales or biases (parameters with one non-layer dimension).

A caller's own `optax.GradientTransformation` replaces the default through `jaxpar.training.plan.build_plan(...,
optimizer=tx)`; wrap it in `skip_nonfinite` to get the default's NaN/inf handling and its step metrics.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from jaxpar.config.choices import LR_DECAYS
from jaxpar.config.schema import OptimizerConfig

# optimizer.decay -> the decayed rate at decay progress t in [0, 1] (fp32 array) from `peak` to `end` (floats).
DECAYS = {
    "cosine": lambda t, peak, end: end + (peak - end) * 0.5 * (1.0 + jnp.cos(math.pi * t)),
    "linear": lambda t, peak, end: peak + (end - peak) * t,
    "constant": lambda t, peak, end: jnp.full_like(t, peak),
}
if set(DECAYS) != set(LR_DECAYS):
    raise ImportError(f"optimizer decays {sorted(DECAYS)} differ from jaxpar.config.choices.LR_DECAYS {LR_DECAYS}")


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """The learning rate as a function of `count`, the number of updates applied before this one.

    With peak = `learning_rate`, end = peak * `min_lr_ratio`, warmup = `warmup_steps`, total = `total_steps` and
    decay = max(total - warmup, 1), update j (j = count + 1 = 1, 2, ...) uses

        warmup, j <= warmup:  peak * j / warmup    (update 1 already moves: peak / warmup; update warmup: peak)
        decay,  j > warmup:   t = (j - 1 - warmup) / decay, clipped to [0, 1]
                              linear:   peak + (end - peak) * t
                              cosine:   end + (peak - end) * (1 + cos(pi * t)) / 2   (Loshchilov & Hutter 2017)
                              constant: peak

    so update warmup + 1 starts the decay at peak, and the decay reaches `end` at count total, the rate after the
    last update: the last update (j = total) uses t = (decay - 1) / decay, one decay step above `end`. No update
    runs at rate 0 (unless `min_lr_ratio` = 0 and the run goes past total). `count` is the optimizer's own update
    count, which an update skipped for non-finite gradients does not advance (`build_optimizer`).

    Raises:
      KeyError (when called): `cfg.decay` is not one of `jaxpar.config.choices.LR_DECAYS`.

    Returns:
      a function int32 count -> float32 learning rate (usable inside jit).
    """
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warmup = cfg.warmup_steps
    decay_steps = max(total_steps - warmup, 1)

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        t = jnp.clip((count - warmup) / decay_steps, 0.0, 1.0)
        decayed = DECAYS[cfg.decay](t, peak, end)
        if warmup == 0:
            return decayed
        return jnp.where(count < warmup, peak * (count + 1.0) / warmup, decayed)

    return schedule


def weight_decay_mask(logical: dict) -> dict:
    """True for leaves with at least two non-`layers` dimensions (matrices, embeddings)."""
    return jax.tree.map(
        lambda names: len([n for n in names if n != "layers"]) >= 2, logical, is_leaf=lambda x: isinstance(x, tuple)
    )


def build_optimizer(cfg: OptimizerConfig, logical: dict, total_steps: int) -> optax.GradientTransformation:
    """optax chain: clip by global norm (when `grad_clip_norm` > 0), then AdamW with the schedule and mask,
    skipped as a whole on non-finite gradients (`skip_nonfinite`).

    Clipping runs on global arrays outside `shard_map`, so a replicated leaf is counted once and a sharded
    leaf's shards are summed: the norm equals the single-device norm whatever the layout.

    A skipped update leaves the inner state untouched, its update count included, so the next applied update
    uses the rate the skipped one would have used (see `applied_learning_rate`).
    """
    adamw = optax.adamw(
        learning_rate_schedule(cfg, total_steps),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=weight_decay_mask(logical),
    )
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw) if cfg.grad_clip_norm > 0 else adamw
    return skip_nonfinite(tx)


def skip_nonfinite(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx`, except that an update whose gradients hold a NaN or inf is skipped: parameters and `tx`'s state stay
    as they were (its update counts included), and the skip is counted.

    This is `optax.apply_if_finite` with no limit on consecutive skips (the training loop decides when to stop:
    `train.max_bad_steps`, `train.divergence_rollbacks`). Its state, `optax.ApplyIfFiniteState`, carries the
    int32 scalars `notfinite_count` (skips in a row) and `total_notfinite`, and the bool `last_finite`; when an
    optimizer's state holds one, the train step reports them as the metrics `bad_steps_in_a_row` and
    `skipped_steps` (`nonfinite_state`). The default optimizer (`build_optimizer`) is wrapped in it.

    Args:
      tx: any optax gradient transformation.

    Returns:
      the wrapped transformation.
    """
    return optax.apply_if_finite(tx, max_consecutive_errors=2**31 - 1)


def nonfinite_state(opt_state) -> optax.ApplyIfFiniteState | None:
    """The `optax.ApplyIfFiniteState` of a `skip_nonfinite` wrapper anywhere in `opt_state`, or None without one.

    Raises:
      ValueError: `opt_state` holds more than one (nested wrappers), so which counters to report is ambiguous.
    """
    is_skip = lambda x: isinstance(x, optax.ApplyIfFiniteState)  # noqa: E731
    found, todo = [], [opt_state]
    while todo:  # a wrapper's inner state may hold another
        for s in jax.tree.leaves(todo.pop(), is_leaf=is_skip):
            if is_skip(s):
                found.append(s)
                todo.append(s.inner_state)
    if len(found) > 1:
        raise ValueError(
            f"the optimizer state holds {len(found)} optax.ApplyIfFiniteState (nested skip_nonfinite "
            f"or optax.apply_if_finite wrappers); wrap the optimizer in one, around the whole chain"
        )
    return found[0] if found else None


def schedule_count(opt_state) -> jax.Array:
    """The update count the learning-rate schedule reads (`optax.ScaleByScheduleState.count`, int32 scalar):
    updates applied so far, not counting those `optax.apply_if_finite` skipped.

    An optax optimizer given a schedule (a callable `learning_rate`, e.g. `optax.lion(schedule)`) keeps one such
    state; given a constant rate it keeps none.

    Raises:
      ValueError: `opt_state` does not hold exactly one schedule state.
    """
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    found = [s.count for s in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(s)]
    if len(found) != 1:
        raise ValueError(
            f"expected one optax.ScaleByScheduleState in the optimizer state, found {len(found)}: the "
            f"learning-rate metric reads the count of the optimizer's one schedule; give the optimizer "
            f"its schedule as a callable learning_rate (one schedule in the whole chain), or pass no "
            f"learning_rate to build_plan (the metric is then left out)"
        )
    return found[0]


def applied_learning_rate(schedule: optax.Schedule, opt_state_before, opt_state_after) -> jax.Array:
    """The learning rate the update from `opt_state_before` to `opt_state_after` applied (float32 scalar):
    `schedule` at the optimizer's own update count before it, or 0.0 when a `skip_nonfinite` wrapper skipped the
    update (non-finite gradients: nothing was applied). Without such a wrapper every update applies."""
    rate = schedule(schedule_count(opt_state_before))
    skip = nonfinite_state(opt_state_after)
    if skip is None:
        return rate
    return jnp.where(skip.last_finite, rate, jnp.zeros_like(rate))
