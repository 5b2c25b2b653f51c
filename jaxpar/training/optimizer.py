"""The default optimizer (AdamW with warmup + decay, global-norm clipping and a weight-decay mask, optax), the
non-finite skip that any optimizer can be wrapped in, and the readers the train step's metrics use.

Decoupled weight decay (Loshchilov & Hutter 2019) applies to every parameter except those whose name matches a
pattern of `optimizer.weight_decay_exclude` (fnmatch over the dotted names `parameter_names` gives, e.g.
`blocks.attn_norm.scale`); the default, `*.scale *.bq *.bk *.bv`, leaves out the built-in families' norm scales
(qk-norm's included) and Qwen2's q/k/v biases, as Megatron-LM leaves out biases and norms.

A caller's own `optax.GradientTransformation` replaces the default through `jaxpar.training.plan.build_plan(...,
optimizer=tx)`; wrap it in `skip_nonfinite` to get the default's NaN/inf handling and its step metrics.
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from jaxpar.config.choices import LR_DECAYS
from jaxpar.config.errors import ConfigError
from jaxpar.config.schema import OptimizerConfig
from jaxpar.model.interface import LAYERS_AXIS

_LOGGER = logging.getLogger("jaxpar.training")

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


def _is_axes(x) -> bool:
    return isinstance(x, tuple)


def parameter_names(logical: dict) -> dict:
    """The tree of `logical` (a parameter's logical axes per leaf, `jaxpar.model.ModelDef.logical_axes`) with each
    leaf replaced by the parameter's name: its dotted path in the parameter tree, e.g. `embed.table`,
    `blocks.attn_norm.scale` (stacked blocks under `blocks`)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: ".".join(str(getattr(k, "key", k)) for k in path), logical, is_leaf=_is_axes
    )


def weight_decay_mask(logical: dict, exclude: Sequence[str]) -> dict:
    """True for the parameters weight decay applies to: those whose name (`parameter_names`) matches none of the
    fnmatch patterns `exclude` (`optimizer.weight_decay_exclude`; `fnmatch.fnmatchcase`, so `*` also matches
    dots)."""
    return jax.tree.map(lambda name: not any(fnmatch.fnmatchcase(name, p) for p in exclude), parameter_names(logical))


def check_weight_decay_exclude(cfg: OptimizerConfig, logical: dict) -> None:
    """Checks `optimizer.weight_decay_exclude` against the model's parameter names, before any device work
    (`jaxpar.training.plan.build_plan` calls it for the default optimizer); logs a warning when weight decay
    applies to a parameter with fewer than two non-`layers` dimensions (a bias or norm scale, which decay
    usually leaves alone: Loshchilov & Hutter 2019 decay weight matrices).

    The default patterns are a convention, not checked: a model without norm scales (`*.scale`) keeps it.

    Raises:
      ConfigError: a pattern set by the user that matches no parameter name (a typo would otherwise decay what it
        meant to spare); the message lists the model's names.
    """
    names = jax.tree.leaves(parameter_names(logical))
    default = tuple(cfg.weight_decay_exclude) == OptimizerConfig().weight_decay_exclude
    for pattern in () if default else cfg.weight_decay_exclude:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ConfigError(
                f"optimizer.weight_decay_exclude: the pattern {pattern!r} matches no parameter of this model; "
                f"its parameters are {', '.join(names)}; fix or remove the pattern (fnmatch: * matches any "
                f"characters, dots included)"
            )
    if cfg.weight_decay == 0:
        return
    decayed = jax.tree.leaves(weight_decay_mask(logical, cfg.weight_decay_exclude))
    axes = jax.tree.leaves(logical, is_leaf=_is_axes)
    vectors = [
        n for n, d, a in zip(names, decayed, axes, strict=True) if d and len([x for x in a if x != LAYERS_AXIS]) < 2
    ]
    if vectors:
        _LOGGER.warning(
            f"optimizer: weight decay applies to {len(vectors)} parameters of fewer than two dimensions (biases "
            f"or norm scales): {', '.join(vectors)}; add patterns for them to optimizer.weight_decay_exclude "
            f"to leave them undecayed"
        )


def build_optimizer(cfg: OptimizerConfig, logical: dict, total_steps: int) -> optax.GradientTransformation:
    """optax chain: clip by global norm (when `grad_clip_norm` > 0), then AdamW with the schedule and the mask of
    `weight_decay_exclude` (`weight_decay_mask`), skipped as a whole on non-finite gradients (`skip_nonfinite`).

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
        mask=weight_decay_mask(logical, cfg.weight_decay_exclude),
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
