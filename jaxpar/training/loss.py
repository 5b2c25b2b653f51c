"""Training losses: the protocol a caller's own loss follows, the built-in cross-entropy, and cross-entropy with
PaLM's z-loss.

Shape letters: b microbatch rows on one device, T sequence length, V vocabulary, t tensor-parallel size.

A loss turns one microbatch's logits into a *sum* over its tokens, an fp32 scalar (nats, or whatever unit the
loss has). The train step calls it once per microbatch on each device's rows (inside the step's shard_map; on
the last pipeline stage when pipelining, under 1F1B and GPipe alike) and divides every sum by the global sum of
`loss_mask` over the whole global batch, all data/fsdp shards, accumulation steps and pipeline microbatches
together, computed before the microbatch loop. So the loss the optimizer sees is exactly
(sum over the global batch) / (global sum of loss_mask), whatever the split. A loss must therefore be additive
over rows and tokens (a sum, not a mean) and weight its terms by `loss_mask` itself; the normaliser is always the
global sum of `loss_mask`, which as a float32 mask may hold real-valued weights (a weighted token mean).

Two kinds of loss, which differ in how they see the logits under tensor parallelism (`mesh.tensor` = t > 1,
where the output projection is split over the vocabulary):

* a plain function `loss_fn(logits_BTV, batch) -> fp32 scalar` sees the full vocabulary, [b, T, V]. With t > 1
  the step first all-gathers the vocabulary shards (`TensorParallel.gather_vocab`: b * T * V values per device
  and one all-gather per microbatch), so any function of the logits is exact on every mesh, at that cost.
* `VocabParallelLoss(fn)`, with `fn(logits_BTv, batch, tp) -> fp32 scalar`, sees only this tensor rank's
  vocabulary shard, [b, T, V/t], and the `TensorParallel` context `tp`; it must reduce over `tensor` itself,
  e.g. through `tp.log_softmax_terms(logits, targets)` (each token's log Z and target logit, already reduced),
  and never materialises the full logits. The built-in losses are of this kind. With t = 1 the shard is the
  whole vocabulary and `tp` does no communication.

`batch` is this microbatch's rows: "inputs", "targets" (int32 [b, T]) and "loss_mask" (float32 [b, T]). Every
tensor rank computes the loss; its value must be the same on all of them (it is counted once).

Only training uses the loss. Evaluation (`jaxpar.training.step.make_eval_step`, the `val_loss` metric) stays the
token-mean cross-entropy, comparable across runs and with the unigram entropy the training loop prints.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpar.data.batch import abstract_batch
from jaxpar.parallel.tensor import NO_TENSOR_PARALLEL, TensorParallel


@dataclasses.dataclass(frozen=True)
class VocabParallelLoss:
    """A loss computed from this tensor rank's vocabulary shard of the logits (module docstring).

    Attributes:
      fn: `fn(logits_BTv, batch, tp) -> fp32 scalar`, the microbatch's summed loss; logits [b, T, V/t] in the
        compute dtype, `tp` the `jaxpar.parallel.tensor.TensorParallel` context.
    """

    fn: Callable[[jax.Array, dict, TensorParallel], jax.Array]

    def __call__(self, logits_BTv: jax.Array, batch: dict, tp: TensorParallel) -> jax.Array:
        return self.fn(logits_BTv, batch, tp)


LossFn = VocabParallelLoss | Callable[[jax.Array, dict], jax.Array]


def _cross_entropy(logits_BTv: jax.Array, batch: dict, tp: TensorParallel) -> jax.Array:
    """Sum over tokens of loss_mask * cross-entropy (fp32 nats), from vocabulary-sharded logits."""
    return tp.cross_entropy_sum(logits_BTv, batch["targets"], batch["loss_mask"])


# The default loss: next-token cross-entropy (`TensorParallel.cross_entropy_sum`).
cross_entropy = VocabParallelLoss(_cross_entropy)


def cross_entropy_with_z_loss(weight: float = 1e-4) -> VocabParallelLoss:
    """Cross-entropy plus the auxiliary z-loss `weight * (log Z)^2` per token, summed with loss_mask weights.

    Z is the softmax normaliser, sum over the vocabulary of exp(logit); the z-loss pulls log Z towards 0, which
    PaLM found to stabilise training (Chowdhery et al. 2022, arXiv 2204.02311, section 5: z_loss =
    10^-4 * log^2 Z). Computed from vocabulary-sharded logits: log Z is reduced over `tensor` as in the
    cross-entropy (`TensorParallel.log_softmax_terms`), so no rank holds the full logits.

    Args:
      weight: the z-loss coefficient, finite and >= 0 (PaLM: 1e-4).

    Returns:
      a `VocabParallelLoss` whose per-microbatch value is sum(loss_mask * (log Z - target logit + weight *
      (log Z)^2)), fp32.

    Raises:
      ValueError: `weight` is negative or not finite.
    """
    weight = float(weight)
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"z-loss weight must be finite and >= 0, got {weight!r}; PaLM uses 1e-4")

    def fn(logits_BTv: jax.Array, batch: dict, tp: TensorParallel) -> jax.Array:
        log_z, target_logit = tp.log_softmax_terms(logits_BTv, batch["targets"])
        per_token = log_z - target_logit + weight * jnp.square(log_z)
        return jnp.sum(per_token * batch["loss_mask"].astype(jnp.float32))

    return VocabParallelLoss(fn)


def summed_loss(loss_fn: LossFn, logits_BTv: jax.Array, batch: dict, tp: TensorParallel) -> jax.Array:
    """One microbatch's summed loss, fp32 scalar: `loss_fn` on this rank's vocabulary shard (a
    `VocabParallelLoss`) or on the full logits, gathered over `tensor` when t > 1 (a plain function)."""
    if isinstance(loss_fn, VocabParallelLoss):
        out = loss_fn(logits_BTv, batch, tp)
    else:
        out = loss_fn(tp.gather_vocab(logits_BTv), batch)
    out = jnp.asarray(out)
    return out if out.dtype == jnp.float32 else out.astype(jnp.float32)


def check_loss_fn(loss_fn: LossFn, seq_len: int, vocab_size: int) -> None:
    """Traces `loss_fn` once on abstract inputs (no device work): logits float32 [1, seq_len, vocab_size] and a
    batch of that shape.

    Raises:
      TypeError: `loss_fn` is not callable, fails on those inputs, or does not return a real scalar.
    """
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable: (logits [b, T, V], batch) -> summed loss, or a "
            f"jaxpar.training.loss.VocabParallelLoss; got {type(loss_fn).__name__}"
        )
    logits = jax.ShapeDtypeStruct((1, seq_len, vocab_size), jnp.float32)
    batch = abstract_batch(1, seq_len)

    def raw(x, b):  # the loss's own output, before summed_loss casts it to fp32
        out = loss_fn(x, b, NO_TENSOR_PARALLEL) if isinstance(loss_fn, VocabParallelLoss) else loss_fn(x, b)
        return jnp.asarray(out)

    try:
        out = jax.eval_shape(raw, logits, batch)
    except Exception as e:  # any failure of the caller's function, reported with what it got
        raise TypeError(
            f"loss_fn failed on logits float32 [1, {seq_len}, {vocab_size}] and a batch of "
            f"'inputs', 'targets' (int32 [1, {seq_len}]) and 'loss_mask' (float32 [1, {seq_len}]): "
            f"{type(e).__name__}: {e}"
        ) from e
    if not isinstance(out, jax.ShapeDtypeStruct) or out.shape != () or not jnp.issubdtype(out.dtype, jnp.floating):
        what = f"shape {out.shape} {out.dtype}" if isinstance(out, jax.ShapeDtypeStruct) else type(out).__name__
        raise TypeError(
            f"loss_fn must return the microbatch's summed loss as a real scalar, got {what}; sum "
            f"over rows and tokens (weighted by batch['loss_mask']), the step divides by the global "
            f"token count"
        )
