"""Mixture-of-experts MLP: a softmax router in fp32, top-k experts per token, optional shared experts.

Shape letters as in the `jaxpar` glossary; F: an expert's hidden width (model.moe.d_expert, else model.d_ff), A:
the router's assignments, (token, choice) pairs.

Every expert is a SwiGLU MLP (Shazeer 2020); the E experts' weights are stacked on a leading dimension with the
logical axis `experts`, split over the expert axes under expert parallelism (`model.moe.expert_axes`,
`jaxpar.parallel.expert`: each device holds E / n whole experts and the assignments travel to them and back by
all-to-all). Routing (Shazeer et al. 2017; Switch Transformer, Fedus et al. 2021; GShard, Lepikhin
et al. 2020): router logits x @ W_r in fp32, probabilities p = softmax, the top_k experts of each token; the
token's output is sum_j gate_j * expert_{e_j}(x) with gate_j = p_{e_j}, renormalised over the top_k when
top_k > 1 (Mixtral), raw when top_k == 1 (Switch).

Sigmoid gating (`model.moe.gating=sigmoid`; DeepSeek-V3 technical report, arXiv 2412.19437, section 2.1.2,
eq. 12-16): affinities s_i = sigmoid(logit_i) in fp32; the top_k are chosen on s_i + b_i, b [E] the block's
balancing bias (`MoE.router_bias`, moved after each step by `jaxpar.training.router_bias`: auxiliary-loss-free load
balancing); gate_j = s_{e_j} / sum over the chosen of s (top-k normalisation, for every top_k; the bias is not in
the gates). Either gating's gates are multiplied by `model.moe.routed_scale` (DeepSeek-V3's
routed_scaling_factor, 2.5). Node-limited routing (`model.moe.expert_groups`, `group_top_k`; `limit_to_groups`)
lets each token choose only among the experts of its best groups.

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
          expert i over its T tokens; 1.0 when perfectly balanced. Under sigmoid gating P_i is the mean of the
          normalised affinities s'_i = s_i / sum_j s_j: DeepSeek-V3's sequence-wise balance loss sum_i f'_i P_i
          (eq. 17-20, f'_i = E / (k T) * the tokens choosing i = E f_i), the same number. f counts the
          choices made (on s + b, within the groups), where eq. 18 writes the top-k of s alone.
  z_BT    fp32 [B, T] (whole sequence): each token's router z-loss (log sum_i exp(logit_i))^2 (ST-MoE, Zoph et
          al. 2022, eq. 5); zeros under sigmoid gating (no log-partition; `jaxpar.config.moe` refuses its weight).
  load_E  fp32 [E]: assignments routed to each expert (before dropping).
  dropped fp32 []: assignments dropped: for capacity, or (dropless) past a device's receive buffer when
          model.moe.receive_factor bounds it (0 when dropless with the worst-case buffer).
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
    x_BTD: jax.Array,
    router_DE: jax.Array,
    top_k: int,
    tp: TensorParallel = NO_TENSOR_PARALLEL,
    *,
    gating: str = "softmax",
    bias_E: jax.Array | None = None,
    routed_scale: float = 1.0,
    expert_groups: int = 1,
    group_top_k: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array, dict]:
    """The router in fp32 on the block input [B, T', D] (T' = T/t, this rank's slice, under sequence
    parallelism; else T' = T), with `gating` "softmax" or "sigmoid" (module docstring, "Routing").

    Args:
      x_BTD: the block input [B, T', D], any float dtype.
      router_DE: the router's weights [D, E].
      top_k: experts per token, k.
      tp: the tensor (and context) parallel context whose axes complete the statistics.
      gating: "softmax" or "sigmoid" (DeepSeek-V3, arXiv 2412.19437, section 2.1.2, eq. 12-16).
      bias_E: sigmoid gating's balancing bias b [E] (any float dtype, no gradient), added to the affinities for
        the top-k choice only; None = zeros. Not used with softmax.
      routed_scale: every gate multiplied by it (DeepSeek-V3's routed_scaling_factor).
      expert_groups, group_top_k: node-limited routing (`limit_to_groups`); group_top_k 0 = off.

    Returns:
      (gates fp32 [B, T', k] of the slice, expert ids int32 [B, T, k] of the whole sequence (all-gathered over
      `tensor` under sequence parallelism), probabilities fp32 [B, T', E] (softmax: p; sigmoid: the normalised
      affinities s'), stats {"aux_B", "z_BT" [B, T], "load_E"} of the whole sequence, as in the module docstring).

    Raises:
      ValueError: `gating` is neither "softmax" nor "sigmoid".
    """
    logits = x_BTD.astype(jnp.float32) @ router_DE.astype(jnp.float32)
    if gating == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        if group_top_k:
            _, idx = jax.lax.top_k(limit_to_groups(probs, expert_groups, group_top_k), top_k)
            top_p = jnp.take_along_axis(probs, idx, axis=-1)
        else:
            top_p, idx = jax.lax.top_k(probs, top_k)
        gates = top_p / jnp.sum(top_p, axis=-1, keepdims=True) if top_k > 1 else top_p
        z_BT = tp.gather_sequence_values(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    elif gating == "sigmoid":
        s_BTE = jax.nn.sigmoid(logits)  # affinities s_{i,t} (eq. 15)
        biased = s_BTE if bias_E is None else s_BTE + jax.lax.stop_gradient(bias_E.astype(jnp.float32))
        if group_top_k:
            biased = limit_to_groups(biased, expert_groups, group_top_k)
        _, idx = jax.lax.top_k(biased, top_k)  # chosen on s + b (eq. 16), the bias nowhere else
        top_s = jnp.take_along_axis(s_BTE, idx, axis=-1)
        gates = top_s / jnp.sum(top_s, axis=-1, keepdims=True)  # top-k normalisation (eq. 13)
        probs = s_BTE / jnp.sum(s_BTE, axis=-1, keepdims=True)  # s' of the sequence-wise loss (eq. 19)
        z_BT = None  # no z-loss: sigmoid gates have no log-partition (zeros of the whole sequence, below)
    else:
        raise ValueError(f"route: gating {gating!r} is neither 'softmax' nor 'sigmoid' (model.moe.gating)")
    if routed_scale != 1.0:
        gates = gates * routed_scale
    idx = tp.gather_sequence_values(idx.astype(jnp.int32))
    if z_BT is None:
        z_BT = jnp.zeros(idx.shape[:2], jnp.float32)
    e, cp = router_DE.shape[-1], tp.context
    t = idx.shape[1] * cp.size  # the whole sequence (under context parallelism this device holds T/c of it)
    counts_BE = jnp.sum(jax.nn.one_hot(idx, e, dtype=jnp.float32), axis=(1, 2))
    f_BE = jax.lax.stop_gradient(cp.sequence_sum(counts_BE) / (t * top_k))
    # mean router probability over the whole sequence: its slices over tensor, then over context
    p_BE = cp.sequence_sum(tp.sequence_sum(jnp.sum(probs, axis=1))) / t
    aux_B = e * jnp.sum(f_BE * p_BE, axis=-1)
    stats = {"aux_B": aux_B, "z_BT": z_BT, "load_E": jnp.sum(counts_BE, axis=0)}
    return gates, idx, probs, stats


def limit_to_groups(scores_BTE: jax.Array, groups: int, chosen: int) -> jax.Array:
    """Node-limited routing (DeepSeek-V3, arXiv 2412.19437, section 2.1.2; DeepSeek-V2's device-limited routing):
    the choice scores [..., E] with -inf at every expert outside the token's `chosen` best of `groups` groups of
    E / groups consecutive experts, a group scored by the sum of its two highest scores (its one score when it
    holds a single expert). fp32 in, fp32 out; the top-k of the result picks only experts of those groups."""
    e = scores_BTE.shape[-1]
    grouped = scores_BTE.reshape(*scores_BTE.shape[:-1], groups, e // groups)
    group_score = jnp.sum(jax.lax.top_k(grouped, min(2, e // groups))[0], axis=-1)  # [..., groups]
    _, best = jax.lax.top_k(group_score, chosen)
    keep = jnp.sum(jax.nn.one_hot(best, groups, dtype=jnp.int32), axis=-2) > 0  # [..., groups]
    return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(scores_BTE.shape)


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
) -> tuple[jax.Array, jax.Array]:
    """Every assignment through its expert with grouped matmuls: [B, T, D] -> (each assignment's output
    [B, T, k, D] (partial sums over `tensor`: the caller reduces them), zero where dropped; int32 [] this device's
    assignments dropped). Weights: gate/up [E/n, D, F(/t)], down [E/n, F(/t), D] (this device's experts under
    expert parallelism: the assignments go to their experts' devices and back, `ep`, which drops those past a
    device's receive buffer, `model.moe.receive_factor`; none are dropped without it)."""
    b, t, d = x_BTD.shape
    k = idx_BTk.shape[-1]
    e = w_gate.shape[0] * ep.size()
    expert_A = idx_BTk.reshape(-1)  # assignment a = token * k + choice
    order = jnp.argsort(expert_A, stable=True)  # assignments grouped by expert, in token order within each
    xs_AD = x_BTD.reshape(b * t, d)[order // k]
    sizes = jnp.bincount(expert_A, length=e).astype(jnp.int32)
    if ep.active:
        rows, local_sizes, routing = ep.dispatch_dropless(xs_AD, sizes)
        out_AD = ep.combine_dropless(_grouped_swiglu(rows, local_sizes, w_gate, w_up, w_down, tp, ep), routing)
        dropped = routing.dropped
    else:
        out_AD = _grouped_swiglu(xs_AD, sizes, w_gate, w_up, w_down, tp, ep)
        dropped = jnp.zeros((), jnp.int32)
    return out_AD[jnp.argsort(order)].reshape(b, t, k, d), dropped


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
      router_bias: with sigmoid gating (only then), the balancing bias b [E] (logical axes None: never split; the
        layer stack's `layers` axis puts it on its block's pipeline stage), fp32 zeros at init. Never trained by
        gradient: the train step rewrites it after the optimizer's update (`jaxpar.training.router_bias`).
    """

    def __init__(self, d: int, f: int, moe: MoEConfig, std: float, rngs: nnx.Rngs):
        e = moe.num_experts
        # The router scores every expert on every device: its expert dimension is never split.
        self.router = nnx.Param(_normal(rngs, (d, e), std), logical_axes=("embed", None))
        self.w_gate = nnx.Param(_normal(rngs, (e, d, f), std), logical_axes=(EXPERTS_AXIS, "embed", "mlp"))
        self.w_up = nnx.Param(_normal(rngs, (e, d, f), std), logical_axes=(EXPERTS_AXIS, "embed", "mlp"))
        self.w_down = nnx.Param(_normal(rngs, (e, f, d), std), logical_axes=(EXPERTS_AXIS, "mlp", "embed"))
        self.shared = SwiGLU(d, moe.shared_experts * f, std, rngs) if moe.shared_experts else None
        if moe.gating == "sigmoid":
            self.router_bias = nnx.Param(jnp.zeros((e,), jnp.float32), logical_axes=(None,))
        self.gating = moe.gating
        self.routed_scale = moe.routed_scale
        self.groups = (moe.expert_groups, moe.group_top_k)
        self.top_k = moe.top_k
        self.routing = moe.routing
        self.capacity_factor = moe.capacity_factor
        self.ep = ExpertParallel.of(moe)

    def __call__(self, x_BTD: jax.Array, tp: TensorParallel = NO_TENSOR_PARALLEL) -> tuple[jax.Array, dict]:
        """x: [B, T', D] -> ([B, T', D], stats), T' = T/t under sequence parallelism (this rank's slice), else T."""
        dt = x_BTD.dtype
        bias = self.router_bias[...] if self.gating == "sigmoid" else None
        gates, idx, _, stats = route(
            x_BTD,
            self.router[...],
            self.top_k,
            tp,
            gating=self.gating,
            bias_E=bias,
            routed_scale=self.routed_scale,
            expert_groups=self.groups[0],
            group_top_k=self.groups[1],
        )
        x_in = tp.enter(x_BTD)  # [B, T, D]: every tensor rank runs its slice of every expert on every token
        weights = (self.w_gate[...], self.w_up[...], self.w_down[...])
        if self.routing == "capacity":
            y_BTkD, keep = capacity_experts(x_in, idx, *weights, self.capacity_factor, self.ep, tp)
            stats["dropped"] = jnp.sum(~keep).astype(jnp.float32)
        else:
            y_BTkD, dropped = dropless_experts(x_in, idx, *weights, self.ep, tp)
            stats["dropped"] = dropped.astype(jnp.float32)
        # The gates combine each token's k partial outputs before the reduction over tensor (linear: the same sum),
        # so the exit moves [B, T, D] like a dense MLP's, not k times that. The gates enter like an activation:
        # all-gathered over the sequence under sequence parallelism (backward reduce-scatter), else replicated
        # (backward all-reduce: each rank's partial outputs give a partial gate gradient).
        gates_BTk = tp.enter(gates.astype(dt))
        y_BTD = tp.exit(jnp.einsum("btk,btkd->btd", gates_BTk, y_BTkD))
        if self.shared is not None:
            y_BTD = y_BTD + self.shared(x_BTD, tp)
        return y_BTD, stats
