"""A pipeline schedule as a static table of clock ticks with split backward, its checker, and what it costs in
lockstep SPMD (pure Python, built at trace time; `jaxpar.parallel.zero_bubble` builds the tables).

Symbols: p devices on the `pipeline` axis, v model chunks per device, m microbatches, i a microbatch, c a model
chunk (0 .. pv - 1, the model's layers in pv runs of consecutive layers), `placement[c]` the device that holds
chunk c, t a clock tick.

Each tick every device has three slots, run in this order: F (the forward of one chunk of one microbatch), B (its
input-gradient backward: the gradient with respect to the chunk input, what the previous chunk waits for) and W
(its weight-gradient backward); any slot may be idle. After the three slots one `ppermute` per direction moves
the values a device produced in tick t to a ring neighbour, which reads them in tick t + 1. Split backward and
the slot names are those of Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, section 2.

Dependency rules `check` enforces (i a microbatch, c a chunk, n = pv chunks):
  * F(i, c) at a tick >= F(i, c - 1) + 1: from another device through the permute, or, on the same device, in a
    later tick (the value stays local; one F slot per tick allows no earlier);
  * B(i, n - 1) at a tick >= F(i, n - 1) (the same tick allowed: the B slot follows the F slot, and the head's
    gradient seeds it); B(i, c) for c < n - 1 at a tick >= B(i, c + 1) + 1 (same two cases as F) and >= F(i, c);
  * W(i, c) at a tick >= B(i, c) (the same tick allowed: the W slot follows the B slot);
  * a value that changes device moves to a ring neighbour (device +- 1 mod p);
  * every F, B and W of every (i, c) exactly once, on `placement[c]`, at most one of each kind per device per tick;
  * in flight on a device (chunk-microbatches whose F has run and whose W has not, counted inside a tick after its
    F slot and before its W slot: what the device must keep) at most the schedule's stated bound.

Lockstep cost (what a tick takes). The step runs the ticks as static loops over runs of ticks that use the same
slot kinds (as `jaxpar.parallel.pipeline_1f1b` runs warm-up, steady and cool-down), so a tick pays for a slot kind
when any device runs that kind in it, and every device pays for it, busy or idle: devices meet at each tick's
permute. With T_F, T_B, T_W the times of one stage's F, B, W of one microbatch (the paper's units; a chunk's are
1/v of them), tick t takes

    time(t) = (T_F [some device runs F at t] + T_B [... B at t] + T_W [... W at t]) / v,

the step sum_t time(t), and a device's bubble the slot time it pays for and leaves idle; `idle_time` counts it from
the table. Every device runs m*v of each kind, so every device's bubble is the step time minus
m*(T_F + T_B + T_W).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

KINDS = ("F", "B", "W")


class Op(NamedTuple):
    """One slot's work: `kind` (F, B or W) of model chunk `chunk` of microbatch `microbatch`, on `device` at `tick`."""

    kind: str
    tick: int
    device: int
    microbatch: int
    chunk: int


@dataclasses.dataclass(frozen=True)
class Table:
    """A static schedule: `ops` (every F, B, W) over `ticks` clock ticks of p devices, v chunks per device,
    `placement[c]` the device of chunk c, and `in_flight_bound[s]` the most chunk-microbatches device s may hold
    (the module docstring says how they are counted)."""

    name: str
    p: int
    v: int
    m: int
    placement: tuple[int, ...]
    ops: tuple[Op, ...]
    in_flight_bound: tuple[int, ...]

    @property
    def ticks(self) -> int:
        """Clock ticks: one past the last op's tick."""
        return 1 + max(op.tick for op in self.ops)

    def grid(self) -> list[list[dict[str, tuple[int, int] | None]]]:
        """grid[t][s] = {"F": (microbatch, chunk) or None, "B": ..., "W": ...}: what device s runs in tick t."""
        out: list[list[dict[str, tuple[int, int] | None]]] = [
            [dict.fromkeys(KINDS) for _ in range(self.p)] for _ in range(self.ticks)
        ]
        for op in self.ops:
            out[op.tick][op.device][op.kind] = (op.microbatch, op.chunk)
        return out


def check(table: Table) -> None:
    """Raises ValueError naming the first violation of the rules in the module docstring (with the op(s) at
    fault); returns None when the table passes them all."""
    p, n = table.p, table.p * table.v
    if len(table.placement) != n or any(not 0 <= d < p for d in table.placement):
        raise ValueError(f"{table.name}: placement {table.placement} must give a device in 0..{p - 1} per chunk")
    at: dict[tuple[str, int, int], int] = {}
    busy: set[tuple[str, int, int]] = set()
    for op in table.ops:
        if op.kind not in KINDS or not (0 <= op.microbatch < table.m and 0 <= op.chunk < n) or op.tick < 0:
            raise ValueError(f"{table.name}: {op} is not an F, B or W of a microbatch and chunk of the table")
        if op.device != table.placement[op.chunk]:
            raise ValueError(f"{table.name}: {op} runs chunk {op.chunk} off its device {table.placement[op.chunk]}")
        if (op.kind, op.microbatch, op.chunk) in at:
            raise ValueError(f"{table.name}: {op.kind} of microbatch {op.microbatch} chunk {op.chunk} runs twice")
        if (op.kind, op.device, op.tick) in busy:
            raise ValueError(f"{table.name}: device {op.device} runs two {op.kind} in tick {op.tick}")
        at[op.kind, op.microbatch, op.chunk] = op.tick
        busy.add((op.kind, op.device, op.tick))
    missing = [(k, i, c) for k in KINDS for i in range(table.m) for c in range(n) if (k, i, c) not in at]
    if missing:
        raise ValueError(f"{table.name}: never runs (kind, microbatch, chunk) {missing[:4]} ({len(missing)} in all)")
    for i in range(table.m):
        for c in range(n):
            _check_ready(table, at, i, c)
    _check_in_flight(table)


def _check_ready(table: Table, at: dict[tuple[str, int, int], int], i: int, c: int) -> None:
    """The dependency rules of microbatch i's chunk c (module docstring)."""
    p, n, name = table.p, table.p * table.v, table.name
    f, b, w = at["F", i, c], at["B", i, c], at["W", i, c]
    if c > 0 and f < at["F", i, c - 1] + 1:
        raise ValueError(f"{name}: F of microbatch {i} chunk {c} in tick {f} before chunk {c - 1}'s output arrives")
    if b < f:
        raise ValueError(f"{name}: B of microbatch {i} chunk {c} in tick {b} before its F (tick {f})")
    if c < n - 1 and b < at["B", i, c + 1] + 1:
        raise ValueError(f"{name}: B of microbatch {i} chunk {c} in tick {b} before chunk {c + 1}'s gradient arrives")
    if w < b:
        raise ValueError(f"{name}: W of microbatch {i} chunk {c} in tick {w} before its B (tick {b})")
    if c > 0 and (table.placement[c] - table.placement[c - 1]) % p not in (0, 1, p - 1):
        raise ValueError(f"{name}: chunks {c - 1} and {c} sit on devices that are not ring neighbours")


def in_flight(table: Table) -> list[int]:
    """Per device, the most chunk-microbatches in flight in any tick (F run, W not yet run; module docstring)."""
    delta: dict[int, collections.Counter[int]] = {s: collections.Counter() for s in range(table.p)}
    for op in table.ops:
        if op.kind == "F":
            delta[op.device][op.tick] += 1
        elif op.kind == "W":
            delta[op.device][op.tick + 1] -= 1  # freed after the W slot: still held during tick `op.tick`
    peaks = []
    for s in range(table.p):
        held = peak = 0
        for t in sorted(delta[s]):
            held += delta[s][t]
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def _check_in_flight(table: Table) -> None:
    """Raises ValueError when a device holds more chunk-microbatches than `table.in_flight_bound` allows."""
    for s, (held, bound) in enumerate(zip(in_flight(table), table.in_flight_bound, strict=True)):
        if held > bound:
            raise ValueError(
                f"{table.name}: device {s} holds {held} chunk-microbatches in flight, over its bound {bound}"
            )


def paid(table: Table) -> list[set[str]]:
    """Per tick, the slot kinds some device runs: those the lockstep program executes (and all devices wait for)."""
    kinds: list[set[str]] = [set() for _ in range(table.ticks)]
    for op in table.ops:
        kinds[op.tick].add(op.kind)
    return kinds


def phases(table: Table) -> list[tuple[int, int, frozenset[str]]]:
    """Maximal runs [start, stop) of ticks that pay for the same slot kinds: one static loop each in the step."""
    out: list[tuple[int, int, frozenset[str]]] = []
    for t, kinds in enumerate(paid(table)):
        if out and out[-1][2] == kinds:
            out[-1] = (out[-1][0], t + 1, out[-1][2])
        else:
            out.append((t, t + 1, frozenset(kinds)))
    return out


def step_time(table: Table, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """sum_t time(t) (module docstring), in the units of t_f, t_b, t_w: one stage's F, B, W of one microbatch."""
    cost = {"F": t_f, "B": t_b, "W": t_w}
    return sum(cost[k] for kinds in paid(table) for k in kinds) / table.v


def idle_time(table: Table, device: int, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """Device `device`'s bubble counted from the table: the time of the slots its ticks pay for (some device runs
    that kind) in which it runs nothing; units of t_f, t_b, t_w."""
    cost = {"F": t_f, "B": t_b, "W": t_w}
    own = {(op.tick, op.kind) for op in table.ops if op.device == device}
    return sum(cost[k] for t, kinds in enumerate(paid(table)) for k in kinds if (t, k) not in own) / table.v


def permutes(table: Table) -> list[set[tuple[str, int]]]:
    """Per tick, the permutes its end needs: ("activation", +1) when some device sends a forward output to device
    s + 1 (mod p), ("activation", -1) to s - 1, ("gradient", +-1) the same for an input gradient from B. A chunk
    that follows one on the same device needs none."""
    at = {(op.kind, op.microbatch, op.chunk): op for op in table.ops}
    n, p = table.p * table.v, table.p
    out: list[set[tuple[str, int]]] = [set() for _ in range(table.ticks)]
    for op in table.ops:
        nxt = op.chunk + 1 if op.kind == "F" else op.chunk - 1
        if op.kind == "W" or not 0 <= nxt < n:
            continue
        diff = at[op.kind, op.microbatch, nxt].device - op.device
        if diff:  # +1 or -1, or the ring's wrap from p - 1 to 0 (+1) and back (-1)
            direction = 1 if diff in (1, 1 - p) and diff != -1 else -1
            out[op.tick].add(("activation" if op.kind == "F" else "gradient", direction))
    return out
