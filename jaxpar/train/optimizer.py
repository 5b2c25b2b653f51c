"""AdamW with warmup + decay, global-norm clipping and a weight-decay mask (optax).

Decoupled weight decay (Loshchilov & Hutter 2019) applies to weight matrices and embeddings only, never to
norm scales or biases (parameters with one non-layer dimension).
"""
from __future__ import annotations

import jax
import optax

from jaxpar.config.schema import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `learning_rate` over `warmup_steps`, then cosine/linear/constant decay to
    `learning_rate * min_lr_ratio` at `total_steps`."""
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warmup = optax.linear_schedule(0.0, peak, max(cfg.warmup_steps, 1))
    decay_steps = max(total_steps - cfg.warmup_steps, 1)
    if cfg.decay == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.decay == "linear":
        decay = optax.linear_schedule(peak, end, decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if cfg.warmup_steps == 0:
        return decay
    return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


def weight_decay_mask(logical: dict) -> dict:
    """True for leaves with at least two non-`layers` dimensions (matrices, embeddings)."""
    return jax.tree.map(lambda names: len([n for n in names if n != "layers"]) >= 2, logical,
                        is_leaf=lambda x: isinstance(x, tuple))


def build_optimizer(cfg: OptimizerConfig, logical: dict, total_steps: int) -> optax.GradientTransformation:
    """optax chain: clip by global norm (when `grad_clip_norm` > 0), then AdamW with the schedule and mask,
    skipped as a whole on non-finite gradients (`optax.apply_if_finite`).

    Clipping runs on global arrays outside `shard_map`, so a replicated leaf is counted once and a sharded
    leaf's shards are summed: the norm equals the single-device norm whatever the layout.
    """
    adamw = optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=weight_decay_mask(logical))
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw) if cfg.grad_clip_norm > 0 else adamw
    # A step whose gradients hold a NaN or inf leaves parameters and optimizer state untouched and is counted
    # (ApplyIfFiniteState.notfinite_count / total_notfinite); the training loop decides when to stop.
    return optax.apply_if_finite(tx, max_consecutive_errors=2**31 - 1)
