"""A pipeline schedule with split backward as a static table of slots, its checker, and what it costs when the
devices run the slots in lockstep (pure Python, built at trace time; `jaxpar.parallel.zero_bubble` builds the
tables, `jaxpar.parallel.slot_program` lowers one to the instructions the SPMD executor runs).

Symbols: p devices on the `pipeline` axis, v model chunks per device, n = pv model chunks (the model's layers in
n runs of consecutive layers), m microbatches, i a microbatch, c a model chunk, `placement[c]` the device that
holds chunk c, t a slot, s a device.

The mixed slot model. Time is a sequence of slots. In each slot each device runs at most one op: F(i, c) (the
forward of chunk c of microbatch i), B(i, c) (its input-gradient backward: the gradient with respect to the chunk
input, what chunk c - 1 waits for), W(i, c) (its weight-gradient backward), or nothing. After every slot the
values a device produced move to its ring neighbours (one `ppermute` to s + 1 mod p, one to s - 1) and are
readable from the next slot on; a value may wait in a receive buffer for later slots. Split backward and the op
names are those of Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, section 2.

Rules `check` enforces ("later" is a strictly later slot):
  * F(i, c) later than F(i, c - 1);
  * B(i, n - 1) later than F(i, n - 1) (the last chunk's F also runs the head, the loss and its gradient);
    B(i, c) later than B(i, c + 1) and than F(i, c);
  * W(i, c) later than B(i, c);
  * chunks c - 1 and c on the same device or on ring neighbours (device difference 0 or +-1 mod p);
  * every F, B and W of every (i, c) exactly once, on `placement[c]`, at most one op per device per slot;
  * in flight on a device (chunk-microbatches counted from their F's slot through their W's slot inclusive: what
    the device keeps for them) at most the table's `in_flight_bound`.

Lockstep cost. With t_f, t_b, t_w the times of one chunk's F, B, W of one microbatch (1 each by default; a chunk
is 1/v of a stage, so a stage's T_F = v t_f), slot t takes the longest op any device runs in it,

    time(t) = max over devices s of the time of the op s runs in slot t  (0 for a slot where all are idle),

the step takes sum_t time(t), a device's bubble is the step time minus its busy time m*v*(t_f + t_b + t_w), and
the bubble fraction is 1 - m*v*(t_f + t_b + t_w) / step time: the papers' "1 - (F + B + W) m / the longest
stage's time" (2401.10241 section 2). At t_f = t_b = t_w = 1 a slot takes 1 and the step time is the number of
slots.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

KINDS = ("F", "B", "W")


class Op(NamedTuple):
    """One op: `kind` (F, B or W) of model chunk `chunk` of microbatch `microbatch`, on `device` in `slot`."""

    kind: str
    slot: int
    device: int
    microbatch: int
    chunk: int


@dataclasses.dataclass(frozen=True)
class Table:
    """A static schedule: `ops` (every F, B and W) of p devices, v chunks per device, m microbatches;
    `placement[c]` the device of chunk c and `in_flight_bound[s]` the most chunk-microbatches device s may hold
    (module docstring)."""

    name: str
    p: int
    v: int
    m: int
    placement: tuple[int, ...]
    ops: tuple[Op, ...]
    in_flight_bound: tuple[int, ...]

    @property
    def n(self) -> int:
        """Model chunks: p*v."""
        return self.p * self.v

    @property
    def slots(self) -> int:
        """Slots: one past the last op's slot."""
        return 1 + max(op.slot for op in self.ops)

    def grid(self) -> list[list[Op | None]]:
        """grid[t][s]: the op device s runs in slot t, or None."""
        out: list[list[Op | None]] = [[None] * self.p for _ in range(self.slots)]
        for op in self.ops:
            out[op.slot][op.device] = op
        return out


def check(table: Table) -> None:
    """Raises ValueError naming the first violation of the rules in the module docstring (with the op at fault);
    returns None when the table passes them all."""
    p, n, name = table.p, table.n, table.name
    if len(table.placement) != n or any(not 0 <= d < p for d in table.placement):
        raise ValueError(f"{name}: placement {table.placement} must give a device in 0..{p - 1} per chunk")
    for c in range(1, n):
        if (table.placement[c] - table.placement[c - 1]) % p not in (0, 1, p - 1):
            raise ValueError(f"{name}: chunks {c - 1} and {c} sit on devices that are not ring neighbours")
    at: dict[tuple[str, int, int], int] = {}
    busy: set[tuple[int, int]] = set()
    for op in table.ops:
        if op.kind not in KINDS or not (0 <= op.microbatch < table.m and 0 <= op.chunk < n) or op.slot < 0:
            raise ValueError(f"{name}: {op} is not an F, B or W of a microbatch and chunk of the table")
        if op.device != table.placement[op.chunk]:
            raise ValueError(f"{name}: {op} runs chunk {op.chunk} off its device {table.placement[op.chunk]}")
        if (op.kind, op.microbatch, op.chunk) in at:
            raise ValueError(f"{name}: {op.kind} of microbatch {op.microbatch} chunk {op.chunk} runs twice")
        if (op.device, op.slot) in busy:
            raise ValueError(f"{name}: device {op.device} runs two ops in slot {op.slot}")
        at[op.kind, op.microbatch, op.chunk] = op.slot
        busy.add((op.device, op.slot))
    missing = [(k, i, c) for k in KINDS for i in range(table.m) for c in range(n) if (k, i, c) not in at]
    if missing:
        raise ValueError(f"{name}: never runs (kind, microbatch, chunk) {missing[:4]} ({len(missing)} in all)")
    for i in range(table.m):
        for c in range(n):
            f, b, w = at["F", i, c], at["B", i, c], at["W", i, c]
            if c > 0 and f <= at["F", i, c - 1]:
                raise ValueError(f"{name}: F of microbatch {i} chunk {c} in slot {f}, not after chunk {c - 1}'s F")
            if b <= f:
                raise ValueError(f"{name}: B of microbatch {i} chunk {c} in slot {b}, not after its F (slot {f})")
            if c < n - 1 and b <= at["B", i, c + 1]:
                raise ValueError(f"{name}: B of microbatch {i} chunk {c} in slot {b}, not after chunk {c + 1}'s B")
            if w <= b:
                raise ValueError(f"{name}: W of microbatch {i} chunk {c} in slot {w}, not after its B (slot {b})")
    for s, (held, bound) in enumerate(zip(in_flight(table), table.in_flight_bound, strict=True)):
        if held > bound:
            raise ValueError(f"{name}: device {s} holds {held} chunk-microbatches in flight, over its bound {bound}")


def _peaks(table: Table, start: str, stop: str, inclusive: bool) -> list[int]:
    """Per device, the most chunk-microbatches between their `start` op and their `stop` op at once (counting the
    `stop` op's slot when `inclusive`)."""
    delta: list[dict[int, int]] = [{} for _ in range(table.p)]
    for op in table.ops:
        if op.kind in (start, stop):
            t, d = (op.slot, 1) if op.kind == start else (op.slot + inclusive, -1)
            delta[op.device][t] = delta[op.device].get(t, 0) + d
    peaks = []
    for s in range(table.p):
        held = peak = 0
        for t in sorted(delta[s]):
            held += delta[s][t]
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def in_flight(table: Table) -> list[int]:
    """Per device, the most chunk-microbatches in flight in any slot: F run, counted through its W's slot."""
    return _peaks(table, "F", "W", inclusive=True)


def w_pending(table: Table) -> list[int]:
    """Per device, the most chunk-microbatches whose B has run and whose W has not, at the end of any slot: what
    deferring W keeps (B's boundary for W; the executor's W ring holds that many)."""
    return _peaks(table, "B", "W", inclusive=False)


def step_time(table: Table, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """sum over slots of the longest op run in the slot (module docstring), in the units of t_f, t_b, t_w: one
    chunk's F, B, W of one microbatch."""
    cost = {"F": t_f, "B": t_b, "W": t_w}
    longest = [0.0] * table.slots
    for op in table.ops:
        longest[op.slot] = max(longest[op.slot], cost[op.kind])
    return sum(longest)


def idle_time(table: Table, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """A device's bubble: the step time minus its busy time m*v*(t_f + t_b + t_w), the same on every device
    (each runs m*v of each kind); units of t_f, t_b, t_w."""
    return step_time(table, t_f, t_b, t_w) - table.m * table.v * (t_f + t_b + t_w)


def bubble_fraction(table: Table, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """1 - m*v*(t_f + t_b + t_w) / step time: the idle share of every device's step (module docstring)."""
    return idle_time(table, t_f, t_b, t_w) / step_time(table, t_f, t_b, t_w)
