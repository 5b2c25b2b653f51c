"""Megatron tensor parallelism with explicit collectives over the `tensor` mesh axis, for use inside shard_map.

Shape letters: B batch, T sequence, D model width, V vocabulary, t tensor-parallel size.
Sources: Shoeybi et al. 2019 (Megatron-LM, arXiv 1909.08053, section 3: the f and g operators, vocab-parallel
embedding and cross-entropy); Korthikanti et al. 2022 (arXiv 2205.05198, section 4.2: sequence parallelism).

A column-parallel linear splits its output features over `tensor`; a row-parallel linear splits its input
features and leaves a partial sum on each rank. Around each column -> row pair sit two collectives:

    sequence_parallel   before the column-parallel op (enter)       after the row-parallel op (exit)
    False               identity; backward all-reduce (Megatron f)   all-reduce (psum); backward identity (g)
    True                all-gather over T; backward reduce-scatter   reduce-scatter over T; backward all-gather

With sequence parallelism the activations between blocks are [B, T/t, D]: each rank holds a slice of the
sequence, and norm parameters (replicated over `tensor`) receive partial gradients that the train step sums
over `tensor` (`jaxpar.training.step`). Every op here degenerates to plain math when t == 1, so the same model code
runs on one device outside shard_map.

The custom VJPs are written for gradients taken inside the shard_map (as the train step does): with
`check_vma=False`, differentiating through the shard_map boundary from outside adds jax's own transposes of the
boundary on top of them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.config.mesh_axes import PIPELINE, TENSOR
from jaxpar.parallel.context import NO_CONTEXT_PARALLEL, ContextParallel
from jaxpar.parallel.fp8 import NO_FP8, Fp8

AXIS = TENSOR
SEQ_DIM = 1  # activations are [B, T, ...]
# Checkpoint names of the outputs of the collectives that move activations, for the remat policies of
# `jaxpar.model.stack`: TENSOR_REDUCED on every `exit` (all-reduce, or reduce-scatter with sequence parallelism;
# [B, T/t or T, D]) and TENSOR_GATHERED on every sequence-parallel `enter` (all-gather; [B, T, D], t times a
# block input). Without sequence parallelism `enter` is the identity in the forward: nothing to name.
TENSOR_REDUCED = "tensor_reduced"
TENSOR_GATHERED = "tensor_gathered"


@jax.custom_vjp
def _copy_to_tensor(x):
    return x


def _copy_fwd(x):
    return x, None


def _copy_bwd(_, g):
    # all-reduce over tensor: every rank's column shard contributed to the gradient of the shared input.
    return (jax.lax.psum(g, AXIS),)


_copy_to_tensor.defvjp(_copy_fwd, _copy_bwd)


@jax.custom_vjp
def _reduce_from_tensor(x):
    # all-reduce over tensor: sum the row-parallel partial results.
    return jax.lax.psum(x, AXIS)


def _reduce_fwd(x):
    return _reduce_from_tensor(x), None


def _reduce_bwd(_, g):
    return (g,)  # the sum's output is replicated; each rank's partial gets the same gradient


_reduce_from_tensor.defvjp(_reduce_fwd, _reduce_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _reduce_over(x, axes: tuple[str, ...]):
    # all-reduce over `axes`: sum partial results that every rank then uses alike
    return jax.lax.psum(x, axes)


def _reduce_over_fwd(x, axes):
    return _reduce_over(x, axes), None


def _reduce_over_bwd(axes, _, g):
    return (g,)


_reduce_over.defvjp(_reduce_over_fwd, _reduce_over_bwd)


@jax.custom_vjp
def _gather_sequence(x):
    # all-gather over tensor along T: the column-parallel op needs the whole sequence.
    return jax.lax.all_gather(x, AXIS, axis=SEQ_DIM, tiled=True)


def _gather_seq_fwd(x):
    return _gather_sequence(x), None


def _gather_seq_bwd(_, g):
    # reduce-scatter over tensor along T: sum the ranks' gradients and keep this rank's sequence slice.
    return (jax.lax.psum_scatter(g, AXIS, scatter_dimension=SEQ_DIM, tiled=True),)


_gather_sequence.defvjp(_gather_seq_fwd, _gather_seq_bwd)


@jax.custom_vjp
def _scatter_sequence(x):
    # reduce-scatter over tensor along T: sum the row-parallel partials, keep this rank's sequence slice.
    return jax.lax.psum_scatter(x, AXIS, scatter_dimension=SEQ_DIM, tiled=True)


def _scatter_seq_fwd(x):
    return _scatter_sequence(x), None


def _scatter_seq_bwd(_, g):
    # all-gather over tensor along T: every rank's partial fed every sequence slice.
    return (jax.lax.all_gather(g, AXIS, axis=SEQ_DIM, tiled=True),)


_scatter_sequence.defvjp(_scatter_seq_fwd, _scatter_seq_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_vocab(x, size):
    # all-gather over tensor along the vocabulary: every rank gets the full logits.
    return jax.lax.all_gather(x, AXIS, axis=x.ndim - 1, tiled=True)


def _gather_vocab_fwd(x, size):
    return _gather_vocab(x, size), None


def _gather_vocab_bwd(size, _, g):
    # Every rank computed the same loss from the same full logits: its own columns of the gradient are the
    # gradient of its shard (a psum_scatter would count the loss t times).
    v_local = g.shape[-1] // size
    return (jax.lax.dynamic_slice_in_dim(g, jax.lax.axis_index(AXIS) * v_local, v_local, axis=g.ndim - 1),)


_gather_vocab.defvjp(_gather_vocab_fwd, _gather_vocab_bwd)


@jax.custom_vjp
def _gather_sequence_values(x):
    # all-gather over tensor along T: every rank gets the whole sequence's per-token values.
    return jax.lax.all_gather(x, AXIS, axis=SEQ_DIM, tiled=True)


def _gather_values_fwd(x):
    return _gather_sequence_values(x), None


def _gather_values_bwd(_, g):
    # Every rank computes the same loss term from the same gathered values: its own slice of the gradient is the
    # gradient of its part (a reduce-scatter would count the term t times).
    t_local = g.shape[SEQ_DIM] // jax.lax.axis_size(AXIS)
    return (jax.lax.dynamic_slice_in_dim(g, jax.lax.axis_index(AXIS) * t_local, t_local, axis=SEQ_DIM),)


_gather_sequence_values.defvjp(_gather_values_fwd, _gather_values_bwd)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel context handed to every layer.

    Attributes:
      size: t, the `tensor` mesh axis size; 1 means no tensor parallelism (no collectives at all).
      sequence_parallel: shard activations between blocks over the sequence on `tensor`.
      vocab_stages: the vocabulary shard of the logits is split once more, over `pipeline` into this many parts
        (the pipeline's vocabulary-parallel head, `jaxpar.parallel.pipeline_1f1b`): `vocab_start` and
        `log_softmax_terms` then count the shards over (tensor, pipeline), tensor-major. 1: not split. Only the
        head's and the loss's context carries it; the embedding's never does.
      context: context parallelism (`jaxpar.parallel.context.ContextParallel`): each device holds R = T/c tokens
        of every sequence, so T above reads R, and attention reaches the other devices' keys and values through
        it. Carried here because every layer already takes this context; its collectives are over `context`.
      fp8: FP8 GEMMs (`jaxpar.parallel.fp8.Fp8`) for the dense layers' projections, whose scales are max-reduced
        over the axes that split each operand; inactive by default. `column_matmul` and `row_matmul` use it.
    """

    size: int = 1
    sequence_parallel: bool = False
    vocab_stages: int = 1
    context: ContextParallel = NO_CONTEXT_PARALLEL
    fp8: Fp8 = NO_FP8

    @property
    def _vocab_axes(self) -> tuple[str, ...]:
        """The mesh axes the vocabulary is sharded over (none without tensor parallelism or vocab stages)."""
        return ((AXIS,) if self.active else ()) + ((PIPELINE,) if self.vocab_stages > 1 else ())

    @property
    def active(self) -> bool:
        return self.size > 1

    def enter(self, x_BTD: jax.Array) -> jax.Array:
        """Input of a column-parallel op: [B, T/t or T, D] -> [B, T, D] replicated over `tensor` (with sequence
        parallelism the all-gathered output carries the checkpoint name `TENSOR_GATHERED`)."""
        if not self.active:
            return x_BTD
        if self.sequence_parallel:
            return checkpoint_name(_gather_sequence(x_BTD), TENSOR_GATHERED)
        return _copy_to_tensor(x_BTD)

    def exit(self, y_BTD: jax.Array) -> jax.Array:
        """Output of a row-parallel op (a partial sum on each rank) -> the block output [B, T/t or T, D], named
        `TENSOR_REDUCED` for the remat policies."""
        if not self.active:
            return y_BTD
        y_BTD = _scatter_sequence(y_BTD) if self.sequence_parallel else _reduce_from_tensor(y_BTD)
        return checkpoint_name(y_BTD, TENSOR_REDUCED)

    def sequence_start(self, seq_local: int) -> jax.Array | int:
        """First position of this rank's slice of the sequence: with sequence parallelism activations between
        blocks are [B, T/t, D] and rank r holds positions [r * T/t, (r + 1) * T/t); else 0 (every rank holds
        all T). `seq_local` is the local length (T/t or T). Use it for position-dependent terms added outside
        the column-parallel ops, e.g. a learned position table."""
        return jax.lax.axis_index(AXIS) * seq_local if self.active and self.sequence_parallel else 0

    def sequence_sum(self, x: jax.Array) -> jax.Array:
        """With sequence parallelism: the sum over `tensor` of each rank's partial sum over its sequence slice
        (all-reduce; backward identity: each rank's slice gets the gradient of the whole sum, which every rank
        uses alike and the loss counts once). Else the identity (every rank already summed all T)."""
        return _reduce_from_tensor(x) if self.active and self.sequence_parallel else x

    def gather_sequence_values(self, x_BT: jax.Array) -> jax.Array:
        """With sequence parallelism: per-token values [B, T/t, ...] of this rank's slice -> [B, T, ...] of the whole
        sequence (all-gather over `tensor`), for a term every rank computes alike and the loss counts once: the
        backward keeps this rank's slice of the gradient. Else the identity."""
        if not (self.active and self.sequence_parallel):
            return x_BT
        if not jnp.issubdtype(x_BT.dtype, jnp.floating):  # ids: no gradient
            return jax.lax.all_gather(x_BT, AXIS, axis=SEQ_DIM, tiled=True)
        return _gather_sequence_values(x_BT)

    def vocab_start(self, vocab_local: int) -> jax.Array | int:
        """First vocabulary id held by this rank (its shard is [start, start + vocab_local)); with `vocab_stages`
        the shard of (tensor rank r, stage s) is the s-th of r's tensor shard's `vocab_stages` parts."""
        shard: jax.Array | int = jax.lax.axis_index(AXIS) if self.active else 0
        if self.vocab_stages > 1:
            shard = shard * self.vocab_stages + jax.lax.axis_index(PIPELINE)
        return shard * vocab_local

    def embed(self, table_VD: jax.Array, tokens_BT: jax.Array) -> jax.Array:
        """Vocab-parallel lookup: each rank holds rows [start, start + V/t) of the table, looks up the tokens in
        its range (zeros elsewhere) and `exit` sums (or reduce-scatters over T) the partial embeddings."""
        if not self.active:
            return jnp.take(table_VD, tokens_BT, axis=0)
        v_local = table_VD.shape[0]
        local = tokens_BT - self.vocab_start(v_local)
        mine = (local >= 0) & (local < v_local)
        x_BTD = jnp.take(table_VD, jnp.clip(local, 0, v_local - 1), axis=0) * mine[..., None].astype(table_VD.dtype)
        return self.exit(x_BTD)

    def log_softmax_terms(self, logits_BTV: jax.Array, targets_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(log Z, target logit) per token, fp32 [B, T] each, from logits sharded over the vocabulary, so that
        cross-entropy = log Z - target logit and the softmax normaliser Z = sum over the whole vocabulary of
        exp(logit). Both are the same on every tensor rank.

        Each rank holds logits [B, T, V/t]; the max, the sum of exponentials and the target logit are reduced
        over `tensor` (pmax / psum of [B, T] values), so the full logits are never materialised on one rank.
        Gradients flow back to each rank's own vocabulary shard. Plain math when `size` == 1.
        """
        logits = logits_BTV.astype(jnp.float32)
        v_local = logits.shape[-1]
        local = targets_BT - self.vocab_start(v_local)
        mine = (local >= 0) & (local < v_local)
        target_logit = jnp.take_along_axis(logits, jnp.clip(local, 0, v_local - 1)[..., None], axis=-1)[..., 0]
        target_logit = target_logit * mine.astype(jnp.float32)
        # The max only shifts the exponentials for stability; it carries no gradient.
        shift = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
        axes = self._vocab_axes
        if axes:
            shift = jax.lax.pmax(shift, axes)  # max over the shards: the global max logit of each token
        sum_exp = jnp.sum(jnp.exp(logits - shift[..., None]), axis=-1)
        if axes:
            # all-reduce over the shards of [B, T] partial sums (forward psum, backward identity: Megatron g)
            sum_exp = _reduce_over(sum_exp, axes)
            target_logit = _reduce_over(target_logit, axes)
        log_z = jnp.log(sum_exp) + shift
        return log_z, target_logit

    def cross_entropy_sum(self, logits_BTV: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array) -> jax.Array:
        """Sum over tokens of mask * cross-entropy, in fp32 nats, from logits sharded over the vocabulary
        (`log_softmax_terms`)."""
        log_z, target_logit = self.log_softmax_terms(logits_BTV, targets_BT)
        return jnp.sum((log_z - target_logit) * mask_BT.astype(jnp.float32))

    def gather_vocab(self, logits_BTV: jax.Array) -> jax.Array:
        """This rank's vocabulary shard [B, T, V/t] -> the full logits [B, T, V] (all-gather over `tensor`), the
        same on every rank; the backward keeps this rank's slice of the gradient (no sum: every rank computes the
        same function of the full logits). Costs B * T * V values per rank. Identity when `size` == 1.

        Raises:
          ValueError: with `vocab_stages` > 1 (a loss of the full logits cannot run on vocabulary slices).
        """
        if self.vocab_stages > 1:
            raise ValueError(
                "pipeline.vocab_parallel splits the logits over the stages and needs a vocabulary-parallel loss "
                "(jaxpar.training.loss.VocabParallelLoss, e.g. the default cross-entropy); this loss takes the full "
                "logits: set pipeline.vocab_parallel=false"
            )
        if not self.active:
            return logits_BTV
        return _gather_vocab(logits_BTV, self.size)


NO_TENSOR_PARALLEL = TensorParallel()


def column_matmul(x_BTD: jax.Array, w_DF: jax.Array, tp: TensorParallel) -> jax.Array:
    """The GEMM of a column-parallel linear on an input that has passed `enter`: x [..., D] @ w [D, F/t...] ->
    [..., F/t...] in x's dtype; in FP8 when `tp.fp8` is active (w's output features split over `tensor`), else in
    x's dtype (w cast to it)."""
    if tp.fp8.active:
        return tp.fp8.matmul(x_BTD, w_DF, "column", tp.active)
    return jnp.tensordot(x_BTD, w_DF.astype(x_BTD.dtype), axes=1)


def row_matmul(h_BTF: jax.Array, w_FD: jax.Array, tp: TensorParallel) -> jax.Array:
    """The GEMM of a row-parallel linear before `exit`: h [..., F/t] @ w [F/t, D] -> this rank's partial sum
    [..., D] in h's dtype; in FP8 when `tp.fp8` is active (h's and w's F split over `tensor`)."""
    if tp.fp8.active:
        return tp.fp8.matmul(h_BTF, w_FD, "row", tp.active)
    return h_BTF @ w_FD.astype(h_BTF.dtype)


def column_parallel(x_BTD: jax.Array, w_DF: jax.Array, b_F: jax.Array | None, tp: TensorParallel) -> jax.Array:
    """Column-parallel linear: `enter`, then x @ w + b with w [D, F/t] and b [F/t] local to each rank.

    Returns [B, T, F/t]: this rank's slice of the output features.
    """
    y = column_matmul(tp.enter(x_BTD), w_DF, tp)
    return y if b_F is None else y + b_F.astype(y.dtype)


def row_parallel(h_BTF: jax.Array, w_FD: jax.Array, b_D: jax.Array | None, tp: TensorParallel) -> jax.Array:
    """Row-parallel linear: h @ w with h [B, T, F/t] and w [F/t, D] local, `exit` (sum over ranks), then + b.

    The bias [D] is replicated and added once, after the reduction, never on every rank before it.
    """
    y = tp.exit(row_matmul(h_BTF, w_FD, tp))
    return y if b_D is None else y + b_D.astype(y.dtype)
