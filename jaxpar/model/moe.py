"""Mixture-of-experts MLP: a softmax router in fp32, top-k experts per token, optional shared experts.

Shape letters as in the `jaxpar` glossary; F: an expert's hidden width (model.moe.d_expert, else model.d_ff), A:
the router's assignments, (token, choice) pairs.

Every expert is a SwiGLU MLP (Shazeer 2020); the E experts' weights are stacked on a leading dimension with the
logical axis `experts`, split over the expert axes under expert parallelism (`model.moe.expert_axes`,
`jaxpar.parallel.expert`: each device holds E / n whole experts and the assignments travel to them and back by
all-to-all). Routing (Shazeer et al. 2017; Switch Transformer, Fedus et al. 2021; GShard, Lepikhin
et al. 2020): router logits x @ W_r in fp32, probabilities p = softmax, the top_k experts of each token; the
token's output is sum_j gate_j * expert_{e_j}(x) with gate_j = p_{e_j}, renormalised over the top_k when
top_k > 1 (Mixtral, DeepSeek-V3), raw when top_k == 1 (Switch).

Two ways to run the experts, same parameters:
  * dropless: all T*k assignments of the batch are sorted by expert and run as grouped matmuls
    (`jax.lax.ragged_dot`, one group per expert): nothing is dropped (MegaBlocks, Gale et al. 2022).
  * capacity: each expert takes at most C = ceil(capacity_factor * T * k / E) assignments per sequence, in
    priority order "every token's first choice, in sequence order, then every second choice, ..." (GShard);
    the rest are dropped (routed output zero; the residual path carries the token). Fixed shapes [B, E, C, D].
Under context parallelism (`jaxpar.parallel.context`) a device holds T/c tokens of each sequence: the router
statistics behind each sequence's load-balancing loss are summed over `context`, and capacity routing (whose
queues run over the whole sequence in order) is refused (`jaxpar.config.moe`).

The capacity group is one sequence, so which tokens drop depends only on that sequence: the same on any mesh
layout (rows are never split over data or fsdp, and the capacity slots are assigned from the whole sequence's
expert ids under tensor and sequence parallelism), with or without expert parallelism (the slots are assigned
before dispatch).

Tensor parallelism (`jaxpar.parallel.tensor`): the router runs on the block input before `tp.enter` (its weights
replicated over `tensor`); each expert's hidden width F is split over `tensor` (gate/up column-parallel, down
row-parallel) and every tensor rank runs its slice of the experts on every token of its rows; the gates (entering
like an activation) combine each token's k partial outputs and `tp.exit` reduces the sum [B, T, D], as a dense
MLP's output. Without sequence parallelism the router sees the whole sequence on every rank and its gradients are
whole there, like any parameter used outside the column/row pair. With sequence parallelism (Korthikanti et al.
2022) the block input is this rank's slice [B, T/t, D]: the router scores only the slice, the chosen expert ids
are all-gathered over `tensor` (every rank dispatches the whole sequence), the gates are all-gathered too,
`tp.exit` reduce-scatters the combined output back to the slice, and the router's statistics are completed over
`tensor` (`TensorParallel.sequence_sum`, `gather_sequence_values`), so the router gets the partial gradient of its
slice that the step sums over `tensor` like a norm's.

FP8 (`precision.fp8`, `jaxpar.parallel.fp8`): the experts' GEMMs run in FP8 like a dense MLP's, the E experts'
stacked weights one tensor whose amax is max-reduced over the expert axes and `tensor`, the dispatched rows one
tensor whose amax is max-reduced over the token axes (every row sits on one device of them, or is replicated over
`tensor`); the router stays in fp32.

Per block, `MoE.__call__` returns statistics for the losses and metrics (`jaxpar.training.moe_loss`):
  aux_B   fp32 [B]: each sequence's load-balancing loss E * sum_i f_i * P_i (Switch eq. 4), f_i the fraction of
          the sequence's T*k assignments routed to expert i (no gradient), P_i the mean router probability of
          expert i over its T tokens; 1.0 when perfectly balanced.
  z_BT    fp32 [B, T] (whole sequence): each token's router z-loss (log sum_i exp(logit_i))^2 (ST-MoE, Zoph et
          al. 2022, eq. 5).
  load_E  fp32 [E]: assignments routed to each expert (before dropping).
  dropped fp32 []: assignments dropped for capacity (0 when dropless).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.config.schema import MoEConfig
from jaxpar.model.layers import SwiGLU, _normal
from jaxpar.model.stack import MLP_HIDDEN
from jaxpar.parallel.expert import NO_EXPERT_PARALLEL, ExpertParallel, capacity
from jaxpar.parallel.sharding import EXPERTS_AXIS
from jaxpar.parallel.tensor import NO_TENSOR_PARALLEL, TensorParallel


def route(
    x_BTD: jax.Array, router_DE: jax.Array, top_k: int, tp: TensorParallel = NO_TENSOR_PARALLEL
) -> tuple[jax.Array, jax.Array, jax.Array, dict]:
    """The router in fp32 on the block input [B, T', D] (T' = T/t, this rank's slice, under sequence
    parallelism; else T' = T): (gates fp32 [B, T', k] of the slice, expert ids int32 [B, T, k] of the whole
    sequence (all-gathered over `tensor` under sequence parallelism), probabilities fp32 [B, T', E], stats
    {"aux_B", "z_BT" [B, T], "load_E"} of the whole sequence, as in the module docstring)."""
    logits = x_BTD.astype(jnp.float32) @ router_DE.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, idx = jax.lax.top_k(probs, top_k)
    gates = top_p / jnp.sum(top_p, axis=-1, keepdims=True) if top_k > 1 else top_p
    idx = tp.gather_sequence_values(idx.astype(jnp.int32))
    e, cp = router_DE.shape[-1], tp.context
    t = idx.shape[1] * cp.size  # the whole sequence (under context parallelism this device holds T/c of it)
    counts_BE = jnp.sum(jax.nn.one_hot(idx, e, dtype=jnp.float32), axis=(1, 2))
    f_BE = jax.lax.stop_gradient(cp.sequence_sum(counts_BE) / (t * top_k))
    # mean router probability over the whole sequence: its slices over tensor, then over context
    p_BE = cp.sequence_sum(tp.sequence_sum(jnp.sum(probs, axis=1))) / t
    aux_B = e * jnp.sum(f_BE * p_BE, axis=-1)
    z_BT = tp.gather_sequence_values(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    stats = {"aux_B": aux_B, "z_BT": z_BT, "load_E": jnp.sum(counts_BE, axis=0)}
    return gates, idx, probs, stats


def _swiglu_hidden(h_gate: jax.Array, h_up: jax.Array) -> jax.Array:
    return checkpoint_name(jax.nn.silu(h_gate) * h_up, MLP_HIDDEN)


def _grouped_swiglu(
    rows_RD: jax.Array,
    sizes: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    tp: TensorParallel,
    ep: ExpertParallel,
):
    """Rows grouped by expert [R, D] (group g: sizes[g] rows, rows past the groups give zeros) through their
    experts' SwiGLU with `jax.lax.ragged_dot` -> [R, D] (partial sums over `tensor`); in FP8 when `tp.fp8` is
    active (`jaxpar.parallel.fp8.Fp8.grouped_matmul`: the stacked experts' weights one tensor, its amax reduced
    over the expert axes)."""
    if tp.fp8.active:

        def gemm(x, w, split):
            return tp.fp8.grouped_matmul(x, w, sizes, split, tp.active, ep.axes)

        h = _swiglu_hidden(gemm(rows_RD, w_gate, "column"), gemm(rows_RD, w_up, "column"))
        return gemm(h, w_down, "row")
    dt = rows_RD.dtype
    h_gate = jax.lax.ragged_dot(rows_RD, w_gate.astype(dt), sizes)
    h_up = jax.lax.ragged_dot(rows_RD, w_up.astype(dt), sizes)
    return jax.lax.ragged_dot(_swiglu_hidden(h_gate, h_up), w_down.astype(dt), sizes)


def _capacity_swiglu(buf: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, tp: TensorParallel, ep):
    """The dispatched capacity buffer [n, E', B', C, D] (E' local experts) through each expert's SwiGLU ->
    [n, E', B', C, D] (partial sums over `tensor`); in FP8 when `tp.fp8` is active (one GEMM per expert over its
    n * B' * C slots, `jaxpar.parallel.fp8.Fp8.batched_matmul`)."""
    if tp.fp8.active:
        n, e, b, c, d = buf.shape
        x_ERD = jnp.moveaxis(buf, 1, 0).reshape(e, n * b * c, d)

        def gemm(x, w, split):
            return tp.fp8.batched_matmul(x, w, split, tp.active, ep.axes)

        h = _swiglu_hidden(gemm(x_ERD, w_gate, "column"), gemm(x_ERD, w_up, "column"))
        return jnp.moveaxis(gemm(h, w_down, "row").reshape(e, n, b, c, d), 0, 1)
    dt = buf.dtype
    h_gate = jnp.einsum("nebcd,edf->nebcf", buf, w_gate.astype(dt))
    h_up = jnp.einsum("nebcd,edf->nebcf", buf, w_up.astype(dt))
    return jnp.einsum("nebcf,efd->nebcd", _swiglu_hidden(h_gate, h_up), w_down.astype(dt))


def dropless_experts(
    x_BTD: jax.Array,
    idx_BTk: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    ep: ExpertParallel = NO_EXPERT_PARALLEL,
    tp: TensorParallel = NO_TENSOR_PARALLEL,
) -> jax.Array:
    """Every assignment through its expert with grouped matmuls: [B, T, D] -> each assignment's output
    [B, T, k, D] (partial sums over `tensor`: the caller reduces them). Weights: gate/up [E/n, D, F(/t)], down
    [E/n, F(/t), D] (this device's experts under expert parallelism: the assignments go to their experts'
    devices and back, `ep`)."""
    b, t, d = x_BTD.shape
    k = idx_BTk.shape[-1]
    e = w_gate.shape[0] * ep.size()
    expert_A = idx_BTk.reshape(-1)  # assignment a = token * k + choice
    order = jnp.argsort(expert_A, stable=True)  # assignments grouped by expert, in token order within each
    xs_AD = x_BTD.reshape(b * t, d)[order // k]
    sizes = jnp.bincount(expert_A, length=e).astype(jnp.int32)
    if ep.active:
        rows, local_sizes, routing = ep.dispatch_dropless(xs_AD, expert_A[order], sizes)
        out_AD = ep.combine_dropless(_grouped_swiglu(rows, local_sizes, w_gate, w_up, w_down, tp, ep), routing)
    else:
        out_AD = _grouped_swiglu(xs_AD, sizes, w_gate, w_up, w_down, tp, ep)
    return out_AD[jnp.argsort(order)].reshape(b, t, k, d)


def capacity_experts(
    x_BTD: jax.Array,
    idx_BTk: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    capacity_factor: float,
    ep: ExpertParallel = NO_EXPERT_PARALLEL,
    tp: TensorParallel = NO_TENSOR_PARALLEL,
) -> tuple[jax.Array, jax.Array]:
    """Capacity routing (module docstring): (each assignment's output [B, T, k, D], zero where dropped, partial
    sums over `tensor`; kept mask bool [B, T, k]). Weights as in `dropless_experts`; under expert parallelism the
    [B, E, C, D] buffer goes to the experts' devices and back (`ep`)."""
    b, t, d = x_BTD.shape
    k, dt = idx_BTk.shape[-1], x_BTD.dtype
    e = w_gate.shape[0] * ep.size()
    c = capacity(t, k, e, capacity_factor)
    idx_BA = jnp.swapaxes(idx_BTk, 1, 2).reshape(b, k * t)  # a = choice * T + position: choice-major priority
    onehot = jax.nn.one_hot(idx_BA, e, dtype=jnp.int32)
    pos_BA = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)  # place in its expert's queue
    keep_BA = pos_BA < c
    slot_BA = jnp.where(keep_BA, pos_BA, c)  # c is out of range: dropped by the scatter
    rows = jnp.arange(b)[:, None]
    x_BAD = jnp.tile(x_BTD, (1, k, 1))
    buf = jnp.zeros((b, e, c, d), dt).at[rows, idx_BA, slot_BA].add(x_BAD, mode="drop")
    buf = ep.dispatch_capacity(buf)  # [n, E/n, B', C, D]: this device's experts, every source's tokens
    out = ep.combine_capacity(_capacity_swiglu(buf, w_gate, w_up, w_down, tp, ep))  # [B, E, C, D]
    y_BAD = out[rows, idx_BA, jnp.minimum(slot_BA, c - 1)] * keep_BA[..., None].astype(dt)
    y_BTkD = jnp.swapaxes(y_BAD.reshape(b, k, t, d), 1, 2)
    return y_BTkD, jnp.swapaxes(keep_BA.reshape(b, k, t), 1, 2)


class MoE(nnx.Module):
    """Routed SwiGLU experts plus optional shared experts: [B, T, D] -> ([B, T, D], stats) (module docstring).

    Attributes:
      router: [D, E] (logical axes embed, None: never split), applied in fp32.
      w_gate, w_up: [E, D, F] (experts, embed, mlp); w_down: [E, F, D] (experts, mlp, embed).
      ep: the expert-parallel context (`model.moe.expert_axes` as resolved for the mesh: only the step's
        shard_map binds those axes; a model for use outside it is built with expert_axes=()).
      shared: a `SwiGLU` of width shared_experts * F, or None.
    """

    def __init__(self, d: int, f: int, moe: MoEConfig, std: float, rngs: nnx.Rngs):
        e = moe.num_experts
        # The router scores every expert on every device: its expert dimension is never split.
        self.router = nnx.Param(_normal(rngs, (d, e), std), logical_axes=("embed", None))
        self.w_gate = nnx.Param(_normal(rngs, (e, d, f), std), logical_axes=(EXPERTS_AXIS, "embed", "mlp"))
        self.w_up = nnx.Param(_normal(rngs, (e, d, f), std), logical_axes=(EXPERTS_AXIS, "embed", "mlp"))
        self.w_down = nnx.Param(_normal(rngs, (e, f, d), std), logical_axes=(EXPERTS_AXIS, "mlp", "embed"))
        self.shared = SwiGLU(d, moe.shared_experts * f, std, rngs) if moe.shared_experts else None
        self.top_k = moe.top_k
        self.routing = moe.routing
        self.capacity_factor = moe.capacity_factor
        self.ep = ExpertParallel(tuple(moe.expert_axes))

    def __call__(self, x_BTD: jax.Array, tp: TensorParallel = NO_TENSOR_PARALLEL) -> tuple[jax.Array, dict]:
        """x: [B, T', D] -> ([B, T', D], stats), T' = T/t under sequence parallelism (this rank's slice), else T."""
        dt = x_BTD.dtype
        gates, idx, _, stats = route(x_BTD, self.router[...], self.top_k, tp)
        x_in = tp.enter(x_BTD)  # [B, T, D]: every tensor rank runs its slice of every expert on every token
        weights = (self.w_gate[...], self.w_up[...], self.w_down[...])
        if self.routing == "capacity":
            y_BTkD, keep = capacity_experts(x_in, idx, *weights, self.capacity_factor, self.ep, tp)
            stats["dropped"] = jnp.sum(~keep).astype(jnp.float32)
        else:
            y_BTkD = dropless_experts(x_in, idx, *weights, self.ep, tp)
            stats["dropped"] = jnp.zeros((), jnp.float32)
        # The gates combine each token's k partial outputs before the reduction over tensor (linear: the same sum),
        # so the exit moves [B, T, D] like a dense MLP's, not k times that. The gates enter like an activation:
        # all-gathered over the sequence under sequence parallelism (backward reduce-scatter), else replicated
        # (backward all-reduce: each rank's partial outputs give a partial gate gradient).
        gates_BTk = tp.enter(gates.astype(dt))
        y_BTD = tp.exit(jnp.einsum("btk,btkd->btd", gates_BTk, y_BTkD))
        if self.shared is not None:
            y_BTD = y_BTD + self.shared(x_BTD, tp)
        return y_BTD, stats
