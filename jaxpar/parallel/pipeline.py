"""Pipeline schedules inside one SPMD program: 1F1B and GPipe over the `pipeline` mesh axis (inside shard_map).

Shape letters: p stages, m microbatches, b microbatch rows, T' activation sequence length (T, or T/t under
sequence parallelism), D model width.

Every stage runs the same program in lockstep clock ticks; `ppermute` moves activations to the next stage and
gradients to the previous one. A stage function `stage(params, x_in, mb, is_first, is_last) -> (h, loss)`
embeds the microbatch on the first stage (ignoring `x_in`), runs this stage's layers, and on the last stage
computes the summed loss (0 elsewhere).

1F1B (PipeDream-Flush; Narayanan et al. 2021, arXiv 2104.04473, section 2.2) in lockstep: at tick k, stage s
runs the forward of microbatch k - s and the backward of microbatch k - (2p - 2 - s); the last stage starts
each backward in the tick of its forward. Three static loops -- warm-up (forward only, p - 1 ticks), steady
(forward and backward, m ticks), cool-down (backward only, p - 1 ticks) -- give m + 2p - 2 ticks, of which
the warm-up and cool-down ticks do half the work: (m + p - 1) ticks' worth of forward+backward, the 1F1B
bubble (p - 1)/(m + p - 1). The backward recomputes the stage forward from its stashed input (`jax.vjp`),
about 4/3 of the model FLOPs; a stage input waits 2p - 2 - 2s ticks for its backward, so the stash is a ring of
2p - 1 slots indexed by microbatch mod 2p - 1, whatever m. Weight gradients are running sums.

GPipe (Huang et al. 2019): the forward of all microbatches over m + p - 1 ticks, then the backward by
automatic differentiation of that loop, which keeps every microbatch's stage input: memory grows with m.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

AXIS = "pipeline"


def _microbatch(mbs: dict, i: jax.Array, m: int) -> dict:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, jnp.clip(i, 0, m - 1), keepdims=False), mbs)


def _shift(x: jax.Array, p: int, forward: bool) -> jax.Array:
    # ppermute over pipeline: activations to stage s+1 (forward) or gradients to stage s-1 (backward); the
    # stage with no sender receives zeros.
    pairs = [(i, i + 1) for i in range(p - 1)] if forward else [(i + 1, i) for i in range(p - 1)]
    return jax.lax.ppermute(x, AXIS, pairs)


def _after(tree, deps):
    """`tree` unchanged in value, but computed from `deps` too: whatever uses the result starts after every
    array in `deps` is ready.

    Why: in a 1F1B tick the forward of one microbatch and the backward of another are independent, and so are
    the two permutes, so nothing in the data flow orders their collectives; the compiler's schedule does, and
    XLA:CPU only keeps the order in which collectives *start*. A collective scheduled after a loop of
    collectives that it does not depend on can start while the loop runs, so devices issue them in different
    orders; each in-process collective blocks a thread of one pool shared by all devices, and the step
    deadlocks (seen on 16 simulated devices). A data dependency fixes one order on every device and backend
    (`jaxpar.analysis.collective_order` checks a compiled program for such pairs). `jax.lax.optimization_barrier` does
    not: XLA:CPU compiles it to nothing.

    Cost: one element read from each array in `deps` and one add per leaf of `tree`. The added term is exactly
    0 (and 0 for a non-finite element too, so a NaN does not spread into `tree`).
    """

    def first(a):
        return jnp.ravel(a)[0].astype(jnp.float32)

    probe = sum(first(a) for a in jax.tree.leaves(deps))
    zero = jnp.where(jnp.isfinite(probe), probe * 0.0, 0.0)
    return jax.tree.map(lambda x: x + zero.astype(x.dtype), tree)


def ticks_1f1b(p: int, m: int) -> int:
    """Clock ticks of the lockstep 1F1B loop: m + 2p - 2 (2p - 2 of them half ticks)."""
    return m + 2 * p - 2


def one_f_one_b(
    stage: Callable,
    params: dict,
    mbs: dict,
    *,
    p: int,
    m: int,
    act_shape: tuple[int, ...],
    act_dtype,
    loss_scale: jax.Array,
) -> tuple[dict, jax.Array]:
    """Runs the 1F1B schedule; returns (fp32 gradient sums of `params`, this stage's summed scaled loss).

    Args:
      stage: the stage function (module docstring).
      params: this stage's local parameters (all of them; the stage function picks what it uses).
      mbs: microbatches, each leaf [m, b, ...].
      p, m: stages and microbatches.
      act_shape, act_dtype: shape [b, T', D] and dtype of the activations passed between stages.
      loss_scale: multiplies each microbatch's loss (1 / global token count), fp32 scalar.
    """
    s = jax.lax.axis_index(AXIS)
    is_first, is_last = s == 0, s == p - 1
    depth = 2 * p - 1
    zeros_act = jnp.zeros(act_shape, act_dtype)

    def tick(carry, k, do_forward: bool, do_backward: bool):
        recv_f, recv_b, stash, g_acc, loss_acc = carry
        send_f = send_b = zeros_act
        if do_forward:
            i = k - s
            valid = (i >= 0) & (i < m)
            h, _ = stage(params, recv_f, _microbatch(mbs, i, m), is_first, is_last)
            slot = jnp.mod(i, depth)
            kept = jax.lax.dynamic_index_in_dim(stash, slot, keepdims=False)
            stash = jax.lax.dynamic_update_index_in_dim(stash, jnp.where(valid, recv_f, kept), slot, 0)
            send_f = h
        if do_backward:
            j = k - (2 * p - 2 - s)
            valid = (j >= 0) & (j < m)
            x_in = jax.lax.dynamic_index_in_dim(stash, jnp.mod(j, depth), keepdims=False)
            mb = _microbatch(mbs, j, m)
            if do_forward:  # the backward's collectives start after the forward's have finished
                x_in, mb = _after((x_in, mb), send_f)
            (_, loss), vjp = jax.vjp(lambda prm, x: stage(prm, x, mb, is_first, is_last), params, x_in)
            d_h = jnp.where(valid & ~is_last, recv_b, jnp.zeros_like(recv_b))
            d_loss = jnp.where(valid, loss_scale, 0.0).astype(loss.dtype)
            d_params, d_x = vjp((d_h, d_loss))
            g_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), g_acc, d_params)
            loss_acc = loss_acc + jnp.where(valid, loss * loss_scale, 0.0)
            send_b = d_x
        if do_forward and do_backward:  # the permutes after the backward, one after the other
            send_f = _after(send_f, (send_b, d_params))
        recv_f = _shift(send_f, p, forward=True) if do_forward else recv_f
        if do_forward and do_backward:
            send_b = _after(send_b, recv_f)
        recv_b = _shift(send_b, p, forward=False) if do_backward else recv_b
        return (recv_f, recv_b, stash, g_acc, loss_acc), None

    carry = (
        zeros_act,
        zeros_act,
        jnp.zeros((depth, *act_shape), act_dtype),
        jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params),
        jnp.zeros((), jnp.float32),
    )
    phases = ((0, p - 1, True, False), (p - 1, m + p - 1, True, True), (m + p - 1, m + 2 * p - 2, False, True))
    for start, stop, fwd, bwd in phases:
        if stop > start:
            carry, _ = jax.lax.scan(lambda c, k, f=fwd, b=bwd: tick(c, k, f, b), carry, jnp.arange(start, stop))
    _, _, _, grads, loss = carry
    return grads, loss


def gpipe(
    stage: Callable,
    params: dict,
    mbs: dict,
    *,
    p: int,
    m: int,
    act_shape: tuple[int, ...],
    act_dtype,
    loss_scale: jax.Array,
) -> tuple[dict, jax.Array]:
    """Runs GPipe: forward of all m microbatches in m + p - 1 ticks, backward by autodiff of that loop.

    Same arguments and results as `one_f_one_b`.
    """
    s = jax.lax.axis_index(AXIS)
    is_first, is_last = s == 0, s == p - 1

    def forward(prm):
        def tick(carry, k):
            recv, loss_acc = carry
            i = k - s
            valid = (i >= 0) & (i < m)
            h, loss = stage(prm, recv, _microbatch(mbs, i, m), is_first, is_last)
            return (_shift(h, p, forward=True), loss_acc + jnp.where(valid, loss * loss_scale, 0.0)), None

        init = (jnp.zeros(act_shape, act_dtype), jnp.zeros((), jnp.float32))
        (_, loss), _ = jax.lax.scan(tick, init, jnp.arange(m + p - 1))
        return loss

    loss, grads = jax.value_and_grad(forward)(params)
    return jax.tree.map(lambda g: g.astype(jnp.float32), grads), loss
