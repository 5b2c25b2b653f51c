"""Expert parallelism: token dispatch to the devices holding each expert and combine back, with explicit
`all_to_all`s over the expert axes, for use inside shard_map.

Shape letters: b local batch rows, E experts, El = E / n experts per device, n expert-parallel size (the product
of the sizes of `model.moe.expert_axes`), C capacity per expert and sequence, A = b * T * k local assignments,
D model width.

The experts' weights are stacked [E, ...] and split over the expert axes: device r (its linear index over the
axes, major to minor) holds experts [r * El, (r + 1) * El) (`jaxpar.parallel.sharding.logical_to_spec`). Each device
routes its own rows; `all_to_all` over the expert axes moves every assignment to its expert's device and the
results back (GShard, Lepikhin et al. 2020, section 3.2; DeepSpeed-MoE, Rajbhandari et al. 2022, section 4.1).
An `all_to_all` is its own transpose, so the backward runs the same two collectives in reverse, and each
expert's weight gradient sums every token routed to it from all n devices: expert weights need no gradient
reduction over the expert axes.

Bytes per MoE block and direction (forward dispatch, forward combine, and the same two in the backward), per
device, in the compute dtype, of which the fraction (n - 1) / n leaves the device:
  * capacity routing: the fixed buffer E * C * b * D (GShard's dispatch tensor);
  * dropless routing: a padded buffer n * A * D. Without a ragged all-to-all (XLA:CPU has none) the static
    shapes must hold the worst case, every local assignment sent to one device, so each destination gets A
    rows of which only those routed there are real: n times the bytes of the tokens moved. (A ragged
    all-to-all, `jax.lax.ragged_all_to_all` on GPU/TPU, would send only the real rows; not used yet.)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.config.choices import REMAT_KEEPING_EXITS_ONLY, REMAT_RECOMPUTING_EXPERTS

# Checkpoint names of the all-to-alls' outputs, for the remat policies of `jaxpar.model.stack`: EXPERT_DISPATCHED
# on the rows each device's experts receive, EXPERT_COMBINED on the expert outputs back on their tokens' device.
EXPERT_DISPATCHED = "expert_dispatched"
EXPERT_COMBINED = "expert_combined"


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """The expert-parallel context of a MoE layer.

    Attributes:
      axes: the mesh axes experts are split over, major to minor, only those of size > 1; () = no expert
        parallelism (every op below is then the identity or plain local math, so the same layer runs on one
        device outside shard_map).
    """

    axes: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.axes)

    def size(self) -> int:
        """n, the expert-parallel size (1 when inactive). Inside shard_map only when active."""
        return jax.lax.axis_size(self.axes) if self.active else 1

    def _all_to_all(self, x: jax.Array) -> jax.Array:
        # all-to-all over the expert axes: slice i of the leading dimension goes to expert-parallel rank i, and
        # the slices received are stacked in rank order. Sent as [n, everything else]: XLA:CPU's all-to-all
        # combiner fails its verifier on two rank-5 all-to-alls of different layouts.
        flat = jax.lax.all_to_all(x.reshape(x.shape[0], -1), self.axes, 0, 0, tiled=True)
        return flat.reshape(x.shape)

    def dispatch_capacity(self, buf_BECD: jax.Array) -> jax.Array:
        """Capacity routing's dispatch: this device's buffer [b, E, C, D] -> the tokens of every source for this
        device's experts [n, El, b, C, D] (leading: source rank)."""
        b, e, c, d = buf_BECD.shape
        n = self.size()
        per_rank = jnp.swapaxes(buf_BECD, 0, 1).reshape(n, e // n, b, c, d)
        return checkpoint_name(self._all_to_all(per_rank), EXPERT_DISPATCHED) if self.active else per_rank

    def combine_capacity(self, out_NLBCD: jax.Array) -> jax.Array:
        """The inverse of `dispatch_capacity`: expert outputs [n, El, b, C, D] -> this device's [b, E, C, D]."""
        n, el, b, c, d = out_NLBCD.shape
        back = checkpoint_name(self._all_to_all(out_NLBCD), EXPERT_COMBINED) if self.active else out_NLBCD
        return jnp.swapaxes(back.reshape(n * el, b, c, d), 0, 1)

    def dispatch_dropless(
        self, xs_AD: jax.Array, expert_A: jax.Array, sizes_E: jax.Array
    ) -> tuple[jax.Array, jax.Array, dict]:
        """Dropless dispatch of this device's assignments, sorted by expert.

        Args:
          xs_AD: the A assignments' inputs [A, D], sorted by expert id (stable).
          expert_A: their expert ids, int32 [A], non-decreasing.
          sizes_E: assignments per expert, int32 [E].

        Returns:
          (rows [n * A, D]: every assignment received for this device's experts, grouped by local expert,
          padding rows (zeros) last; group sizes int32 [El] for `jax.lax.ragged_dot`; the routing to undo it in
          `combine_dropless`).
        """
        a, d = xs_AD.shape
        n = self.size()
        el = sizes_E.shape[0] // n
        dest = expert_A // el  # the device holding each assignment's expert, non-decreasing
        per_dest = jnp.sum(sizes_E.reshape(n, el), axis=1)
        pos = jnp.arange(a, dtype=jnp.int32) - (jnp.cumsum(per_dest) - per_dest)[dest]
        send = jnp.zeros((n, a, d), xs_AD.dtype).at[dest, pos].set(xs_AD)
        counts_NL = sizes_E.reshape(n, el)
        if self.active:
            send = self._all_to_all(send)  # [n(source), A, D]
            # each source's counts for this device's experts (int32, E * 4 bytes per device)
            counts_NL = checkpoint_name(self._all_to_all(counts_NL), EXPERT_DISPATCHED)
        # Received row p of source s belongs to local expert j where p falls in [ends[s, j-1], ends[s, j]);
        # rows past the source's total are padding (id El, sorted last).
        ends = jnp.cumsum(counts_NL, axis=1)
        local_NA = jnp.sum(jnp.arange(a, dtype=jnp.int32)[None, :, None] >= ends[:, None, :], axis=-1)
        order = jnp.argsort(local_NA.reshape(-1), stable=True)
        rows = checkpoint_name(send.reshape(n * a, d)[order], EXPERT_DISPATCHED)
        return rows, jnp.sum(counts_NL, axis=0).astype(jnp.int32), {"dest": dest, "pos": pos, "order": order}

    def combine_dropless(self, out_RD: jax.Array, routing: dict) -> jax.Array:
        """The inverse of `dispatch_dropless`: expert outputs [n * A, D] in its row order -> this device's
        assignments' outputs [A, D] in their sorted order."""
        n_a, d = out_RD.shape
        n = self.size()
        back = jnp.zeros_like(out_RD).at[routing["order"]].set(out_RD).reshape(n, n_a // n, d)
        if self.active:
            back = self._all_to_all(back)  # [n(destination), A, D]
        return checkpoint_name(back[routing["dest"], routing["pos"]], EXPERT_COMBINED)


NO_EXPERT_PARALLEL = ExpertParallel()


def capacity(seq_len: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """C, the assignments one expert takes per sequence under capacity routing: ceil(capacity_factor * T * k / E)
    (GShard, Lepikhin et al. 2020, section 2.2), at least 1."""
    return max(1, math.ceil(capacity_factor * seq_len * top_k / num_experts))


def all_to_all_buffer(
    routing: str,
    n: int,
    rows: int,
    seq_len: int,
    top_k: int,
    num_experts: int,
    d_model: int,
    capacity_factor: float,
) -> int:
    """S, the elements (compute dtype) of one MoE all-to-all buffer on one device (module docstring): capacity
    routing E * C * b * D with C = ceil(capacity_factor * T * k / E) (GShard, Lepikhin et al. 2020, section 3.2:
    the dispatch tensor); dropless routing n * A * D with A = b * T * k (padded for the worst case).

    Args:
      routing: `dropless` or `capacity`; n: the expert-parallel size; rows: b, local rows of the microbatch;
      seq_len: T (whole sequences: MoE blocks see every position); top_k: k; num_experts: E; d_model: D;
      capacity_factor: capacity routing's.
    """
    if routing == "capacity":
        return num_experts * capacity(seq_len, top_k, num_experts, capacity_factor) * rows * d_model
    return n * rows * seq_len * top_k * d_model


def all_to_alls_per_block(remat: str) -> tuple[int, int]:
    """(buffers, count all-to-alls) one MoE block sends per microbatch through a forward and a backward: four
    buffers (dispatch and combine in the forward, their transposes in the backward); five when `remat` (a
    `model.remat` policy) keeps only EXPERT_COMBINED of the two all-to-all outputs (`names`: the backward re-runs
    the dispatch); six when it keeps neither (`REMAT_RECOMPUTING_EXPERTS`, `full`: the backward re-runs dispatch
    and combine); and the dropless path's int32 expert counts (E * 4 bytes each), once per dispatch run, twice
    with a re-run dispatch (`jaxpar.model.stack`)."""
    if remat in REMAT_RECOMPUTING_EXPERTS:
        return 6, 2
    return (5, 2) if remat in REMAT_KEEPING_EXITS_ONLY else (4, 1)


def all_to_all_bytes(
    routing: str,
    n: int,
    rows: int,
    seq_len: int,
    top_k: int,
    num_experts: int,
    d_model: int,
    dtype_bytes: int,
    capacity_factor: float,
    remat: str,
) -> float:
    """Bytes one device sends in the all-to-alls of one MoE block for one microbatch, forward and backward:
    (n - 1) / n of every buffer (`all_to_all_buffer` elements of `dtype_bytes`, times `all_to_alls_per_block`)
    and, with dropless routing, of the expert counts (ring cost of an all-to-all; NCCL tests,
    doc/PERFORMANCE.md). 0.0 when n == 1: no all-to-all. Arguments as in `all_to_all_buffer`; remat:
    `model.remat`."""
    if n == 1:
        return 0.0
    buffers, counts = all_to_alls_per_block(remat)
    sent = buffers * all_to_all_buffer(routing, n, rows, seq_len, top_k, num_experts, d_model, capacity_factor)
    sent *= dtype_bytes
    if routing != "capacity":
        sent += counts * num_experts * 4
    return (n - 1) / n * sent
