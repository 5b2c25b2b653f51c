"""Expert parallelism: token dispatch to the devices holding each expert and combine back, with explicit
all-to-alls over the expert axes, for use inside shard_map.

Shape letters: b local batch rows, E experts, El = E / n experts per device, n expert-parallel size (the product
of the sizes of `model.moe.expert_axes`), C capacity per expert and sequence, A = b * T * k local assignments,
R dropless receive rows per device (`receive_rows`), D model width.

The experts' weights are stacked [E, ...] and split over the expert axes: device r (its linear index over the
axes, major to minor) holds experts [r * El, (r + 1) * El) (`jaxpar.parallel.sharding.logical_to_spec`). Each device
routes its own rows; an all-to-all over the expert axes moves every assignment to its expert's device and the
results back (GShard, Lepikhin et al. 2020, section 3.2; DeepSpeed-MoE, Rajbhandari et al. 2022, section 4.1).
Its transpose is an all-to-all in the other direction, so the backward runs the same two collectives in reverse,
and each expert's weight gradient sums every token routed to it from all n devices: expert weights need no
gradient reduction over the expert axes.

What moves per MoE block and direction (forward dispatch, forward combine, and the same two in the backward), per
device, in the compute dtype:
  * capacity routing: the fixed buffer E * C * b * D (GShard's dispatch tensor), of which (n - 1) / n leaves the
    device;
  * dropless routing, ragged transport (`jax.lax.ragged_all_to_all`, GPU and TPU; `model.moe.all_to_all`
    resolved by the step plan): each device sends only the rows it routes, A * D in all for the dispatch (the
    same back in the combine; the receive buffer, [R, D], is what the static shapes must hold: the worst case
    R = n * A unless `model.moe.receive_factor` bounds it). The senders learn where their rows land from two
    small int32 all-to-alls: counts and offsets, n * (El + 1) and 2 * n per device (`dispatch_dropless`).
  * dropless routing, emulated transport (`jaxpar.parallel.ragged`; any backend, XLA:CPU has no ragged
    all-to-all): the same offsets, then a dense all-to-all of a buffer padded for the worst case, n * min(A, R)
    * D, of which (n - 1) / n leaves the device: each destination gets min(A, R) rows of which only those
    routed there are real, up to n times the bytes of the tokens moved; plus the n int32 output offsets.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.config.choices import REMAT_KEEPING_EXITS_ONLY, REMAT_RECOMPUTING_EXPERTS
from jaxpar.config.schema import MoEConfig
from jaxpar.parallel.ragged import ragged_all_to_all

# Checkpoint names of the all-to-alls' outputs, for the remat policies of `jaxpar.model.stack`: EXPERT_DISPATCHED
# on the rows each device's experts receive, EXPERT_COMBINED on the expert outputs back on their tokens' device.
EXPERT_DISPATCHED = "expert_dispatched"
EXPERT_COMBINED = "expert_combined"


class DroplessRouting(NamedTuple):
    """What `ExpertParallel.combine_dropless` needs to undo a dropless dispatch (int32 unless said; N: the n
    expert-parallel ranks, as destinations on the sending side and as sources on the receiving side).

    Attributes:
      order: [R]: the received rows' order grouped by local expert (received row order[i] is dispatched row i).
      at_N, kept_N: where each source's rows sit in this device's receive buffer, and how many of them it kept.
      src_start_N: where those rows started in each source's sorted assignments.
      send_kept_N: how many of this device's rows for each destination the destination kept.
      dropped: [] this device's assignments that did not fit at their destination.
      assignments: A, this device's assignments (static).
    """

    order: jax.Array
    at_N: jax.Array
    kept_N: jax.Array
    src_start_N: jax.Array
    send_kept_N: jax.Array
    dropped: jax.Array
    assignments: int


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """The expert-parallel context of a MoE layer.

    Attributes:
      axes: the mesh axes experts are split over, major to minor, only those of size > 1; () = no expert
        parallelism (every op below is then the identity or plain local math, so the same layer runs on one
        device outside shard_map).
      ragged: dropless routing's transport: True `jax.lax.ragged_all_to_all` (GPU, TPU), False its emulation
        (`jaxpar.parallel.ragged`; any backend). The step plan decides it from the devices' platform
        (`model.moe.all_to_all`); the model never asks the default backend.
      receive_factor: `model.moe.receive_factor`: the dropless receive buffer's rows (`receive_rows`).
    """

    axes: tuple[str, ...] = ()
    ragged: bool = False
    receive_factor: float = 0.0

    @classmethod
    def of(cls, moe: MoEConfig) -> ExpertParallel:
        """The context `model.moe` describes, as the step plan resolved it (`jaxpar.training.plan`): its expert axes,
        the ragged transport when `all_to_all` is `ragged` (an unresolved `auto` emulates: right on any backend),
        its receive factor."""
        return cls(tuple(moe.expert_axes), ragged=moe.all_to_all == "ragged", receive_factor=moe.receive_factor)

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

    def dispatch_dropless(self, xs_AD: jax.Array, sizes_E: jax.Array) -> tuple[jax.Array, jax.Array, DroplessRouting]:
        """Dropless dispatch of this device's assignments, sorted by expert, to their experts' devices (module
        docstring: which transport, what moves). Inside shard_map over the expert axes, active only.

        Offsets (int32, two small all-to-alls): each source sends its counts per destination's local expert and
        where its rows for each destination start; each destination takes its sources' rows source-major, source
        s at at_s = sum of the earlier sources' counts, and keeps kept_s = clip(R - at_s, 0, count_s) of them (R =
        `receive_rows`); (at_s, kept_s) go back to the sources, which send the first kept_s of their rows for that
        destination. The rest are dropped (their output is zero) and counted.

        Args:
          xs_AD: the A assignments' inputs [A, D], sorted by expert id (stable).
          sizes_E: assignments per expert, int32 [E] (so expert e's rows of xs_AD follow expert e - 1's).

        Returns:
          (rows [R, D]: every assignment received for this device's experts, grouped by local expert, padding
          rows (zeros) last; group sizes int32 [El] for `jax.lax.ragged_dot`; the routing to undo it in
          `combine_dropless`, with the count of this device's assignments dropped).
        """
        a, d = xs_AD.shape
        n = self.size()
        el = sizes_E.shape[0] // n
        r = receive_rows(n, a, self.receive_factor)
        counts_NL = sizes_E.reshape(n, el)  # my assignments per destination rank and its local expert
        send_N = jnp.sum(counts_NL, axis=1)
        start_N = jnp.cumsum(send_N) - send_N  # where my rows for each destination start in xs_AD
        # source -> destination (int32, n * (El + 1) per device): each source's counts for my local experts, and
        # where its rows for me start in its sorted assignments (for the combine to write them back there)
        meta = self._all_to_all(jnp.concatenate([counts_NL, start_N[:, None]], axis=1))
        meta = checkpoint_name(meta, EXPERT_DISPATCHED)
        recv_NL, src_start_N = meta[:, :el], meta[:, el]
        recv_N = jnp.sum(recv_NL, axis=1)
        at_N = jnp.cumsum(recv_N) - recv_N  # where each source's rows land here, source-major
        kept_N = jnp.clip(r - at_N, 0, recv_N)  # what fits in the R receive rows
        # destination -> source (int32, 2n per device): where my rows land on each destination, how many it keeps
        back = checkpoint_name(self._all_to_all(jnp.stack([at_N, kept_N], axis=1)), EXPERT_DISPATCHED)
        out_at_N, send_kept_N = back[:, 0], back[:, 1]
        recv_RD = ragged_all_to_all(
            xs_AD,
            jnp.zeros((r, d), xs_AD.dtype),
            start_N,
            send_kept_N,
            out_at_N,
            kept_N,
            self.axes,
            emulate=not self.ragged,
        )
        # Received row p belongs to segment (source s, local expert j), the last of the n * El segments (source-
        # major) that start at or before p: a kept source's segments are its counts in expert order; only the last
        # kept source can be cut short, its segments then end at R. Rows past every kept row are padding (El).
        first_NL = jnp.cumsum(recv_NL, axis=1) - recv_NL
        seg_start = (at_N[:, None] + jnp.minimum(first_NL, kept_N[:, None])).reshape(-1)
        seg_R = jnp.cumsum(jnp.zeros(r, jnp.int32).at[seg_start].add(1, mode="drop")) - 1
        pos_R = jnp.arange(r, dtype=jnp.int32)
        local_R = jnp.where(pos_R < jnp.sum(kept_N), seg_R % el, el)
        order = jnp.argsort(local_R, stable=True)
        rows = checkpoint_name(recv_RD[order], EXPERT_DISPATCHED)
        kept_NL = jnp.clip(kept_N[:, None] - first_NL, 0, recv_NL)
        routing = DroplessRouting(
            order=order,
            at_N=at_N,
            kept_N=kept_N,
            src_start_N=src_start_N,
            send_kept_N=send_kept_N,
            dropped=jnp.sum(send_N - send_kept_N),
            assignments=a,
        )
        return rows, jnp.sum(kept_NL, axis=0).astype(jnp.int32), routing

    def combine_dropless(self, out_RD: jax.Array, routing: DroplessRouting) -> jax.Array:
        """The inverse of `dispatch_dropless`: expert outputs [R, D] in its row order -> this device's
        assignments' outputs [A, D] in their sorted order, zeros for the dropped ones. The same transport as the
        dispatch, in the other direction: each destination sends back the kept rows of each source to where they
        started in the source's sorted assignments."""
        arrived_RD = jnp.zeros_like(out_RD).at[routing.order].set(out_RD)  # source-major, as received
        back_AD = ragged_all_to_all(
            arrived_RD,
            jnp.zeros((routing.assignments, out_RD.shape[1]), out_RD.dtype),
            routing.at_N,
            routing.kept_N,
            routing.src_start_N,
            routing.send_kept_N,
            self.axes,
            emulate=not self.ragged,
        )
        return checkpoint_name(back_AD, EXPERT_COMBINED)


NO_EXPERT_PARALLEL = ExpertParallel()


def receive_rows(n: int, assignments: int, receive_factor: float) -> int:
    """R, the rows of one device's dropless receive buffer: the worst case n * A (every assignment of the n ranks
    routed to this device's experts: nothing is ever dropped) when receive_factor is 0, else
    ceil(receive_factor * A) clamped to [1, n * A] (A = `assignments`, b * T * k)."""
    if receive_factor <= 0:
        return n * assignments
    return max(1, min(n * assignments, math.ceil(receive_factor * assignments)))


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
    the dispatch tensor); dropless routing n * A * D with A = b * T * k: the emulated transport's buffer, padded
    for the worst case, with `model.moe.receive_factor` 0 or >= 1 (n * min(A, R) * D in general; the ragged
    transport sends A * D and receives into R * D, module docstring).

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
