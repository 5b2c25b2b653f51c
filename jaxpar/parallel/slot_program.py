"""A schedule table (`jaxpar.parallel.schedule_table`) lowered to the per-slot instructions the SPMD executor
(`jaxpar.parallel.pipeline_zb`) indexes, and a symbolic run of them that checks every read (pure Python and
numpy, built at trace time).

The executor runs the slots as one `jax.lax.scan`; in slot t device s reads row [t, s] of every field, runs the
branch of `kind`, then two ring `ppermute`s: "up" (s -> s + 1 mod p) and "down" (s -> s - 1 mod p). Within a
slot all reads come before all writes, and the values received come last; so a ring slot read in slot t may be
written again in slot t.

Rings (per device, each `<ring>_slots` entries, the same count on every device):
  * act: activations waiting for their F (received, or written locally when chunk c + 1 sits on the device);
  * grad: input gradients waiting for their B (the same, from chunk c + 1's B to chunk c's);
  * stash: what F keeps for its B; seed: the head's gradient, from the last chunk's F to its B;
  * w: what B keeps for its W (B's boundary).
A value occupies its ring slot from the slot that writes it to the slot that reads it; ring slots are given by
interval colouring (the earliest write first, into the lowest slot free by then), which uses exactly the most
values live at once: the least ring that works. Index -1 means "nothing to read or write" in every index field;
an executor that writes unconditionally gives each ring one more entry (index `<ring>_slots`) as scratch for
them, as `pipeline_zb` does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NoReturn

import numpy as np

from jaxpar.parallel.schedule_table import Table, check

IDLE, F, B, W = 0, 1, 2, 3
Name = tuple[str, int] | tuple[str, int, int]  # a value: (ring, microbatch[, chunk])
Value = tuple[int, int, int, Name]  # (device, written in slot, read in slot, name)
ACT, GRAD = 1, 2  # recv_*_kind
RINGS = ("act", "grad", "stash", "seed", "w")
FIELDS = (
    "kind",  # IDLE, F, B or W
    "microbatch",  # i (0 when idle)
    "chunk_local",  # j: the chunk's rank among the device's chunks in model order (0 when idle)
    "is_first",  # 1 when the op's chunk is model chunk 0 (F reads the embedding, B makes its gradient)
    "is_last",  # 1 when it is chunk n - 1 (F runs the head and writes the seed, B reads it)
    "act_read",  # F: act slot of its input (-1 for chunk 0)
    "stash_write",  # F: stash slot of what its B needs
    "seed_write",  # F of chunk n - 1: seed slot of the head's gradient
    "stash_read",  # B: its F's stash slot
    "grad_read",  # B: grad slot of its output gradient (-1 for chunk n - 1, which reads the seed)
    "seed_read",  # B of chunk n - 1: the seed slot
    "w_write",  # B: w slot of what its W needs
    "w_read",  # W: that slot
    "send",  # after the slot: +1 up, -1 down, 0 nothing (the next chunk's device gets F's output, the
    # previous chunk's gets B's input gradient; nothing for chunk n - 1's F, chunk 0's B, or a local hand-over)
    "local_act_write",  # F whose chunk c + 1 sits on the same device: the act slot its output goes to
    "local_grad_write",  # B whose chunk c - 1 sits on the same device: the grad slot its gradient goes to
    "recv_up_kind",  # what arrives from s - 1 through "up" at the end of the slot: 0 nothing, ACT, GRAD
    "recv_up_slot",  # the act or grad slot it goes to (-1 for nothing)
    "recv_down_kind",  # the same for what arrives from s + 1 through "down"
    "recv_down_slot",
)


@dataclasses.dataclass(frozen=True, eq=False)
class SlotProgram:
    """Every field of `FIELDS` as a numpy int32 array [slots, p] (row = slot, column = device), and the rings'
    sizes (each >= 1, not counting a scratch entry)."""

    kind: np.ndarray
    microbatch: np.ndarray
    chunk_local: np.ndarray
    is_first: np.ndarray
    is_last: np.ndarray
    act_read: np.ndarray
    stash_write: np.ndarray
    seed_write: np.ndarray
    stash_read: np.ndarray
    grad_read: np.ndarray
    seed_read: np.ndarray
    w_write: np.ndarray
    w_read: np.ndarray
    send: np.ndarray
    local_act_write: np.ndarray
    local_grad_write: np.ndarray
    recv_up_kind: np.ndarray
    recv_up_slot: np.ndarray
    recv_down_kind: np.ndarray
    recv_down_slot: np.ndarray
    act_slots: int
    grad_slots: int
    stash_slots: int
    seed_slots: int
    w_slots: int


def direction(src: int, dst: int, p: int) -> int:
    """+1 (up) when dst = src + 1 mod p, else -1 (down): the permute that carries a value between ring neighbours.
    With p = 2 both neighbours are the same device and every send goes up."""
    return 1 if dst == (src + 1) % p else -1


def program(table: Table) -> SlotProgram:
    """The instructions of `table` (module docstring). Raises ValueError from `schedule_table.check`."""
    check(table)
    p, n, place = table.p, table.n, table.placement
    at = {(op.kind, op.microbatch, op.chunk): op.slot for op in table.ops}
    # Every value: (device, written in slot, read in slot, its name: (ring, microbatch[, chunk])).
    values: list[Value] = []
    for i in range(table.m):
        values.append((place[n - 1], at["F", i, n - 1], at["B", i, n - 1], ("seed", i)))
        for c in range(n):
            values.append((place[c], at["F", i, c], at["B", i, c], ("stash", i, c)))
            values.append((place[c], at["B", i, c], at["W", i, c], ("w", i, c)))
            if c < n - 1:
                values.append((place[c + 1], at["F", i, c], at["F", i, c + 1], ("act", i, c)))
            if c > 0:
                values.append((place[c - 1], at["B", i, c], at["B", i, c - 1], ("grad", i, c)))
    index, sizes = _colour(values)
    shape = (table.slots, p)
    out = {name: np.full(shape, -1, np.int32) for name in FIELDS}
    for name in ("kind", "microbatch", "chunk_local", "is_first", "is_last", "send", "recv_up_kind", "recv_down_kind"):
        out[name][:] = 0
    local = [sum(1 for k in range(c) if place[k] == place[c]) for c in range(n)]
    for op in table.ops:
        t, s, i, c = op.slot, op.device, op.microbatch, op.chunk
        row = {name: out[name][t] for name in FIELDS}
        row["kind"][s] = {"F": F, "B": B, "W": W}[op.kind]
        row["microbatch"][s], row["chunk_local"][s] = i, local[c]
        row["is_first"][s], row["is_last"][s] = c == 0, c == n - 1
        if op.kind == "W":
            row["w_read"][s] = index["w", i, c]
            continue
        if op.kind == "F":
            row["stash_write"][s] = index["stash", i, c]
            if c > 0:
                row["act_read"][s] = index["act", i, c - 1]
            if c == n - 1:
                row["seed_write"][s] = index["seed", i]
            ring, dst, kind = "act", c + 1, ACT
        else:
            row["stash_read"][s] = index["stash", i, c]
            row["w_write"][s] = index["w", i, c]
            if c == n - 1:
                row["seed_read"][s] = index["seed", i]
            else:
                row["grad_read"][s] = index["grad", i, c + 1]
            ring, dst, kind = "grad", c - 1, GRAD
        if not 0 <= dst < n:
            continue
        if place[dst] == s:
            row[f"local_{ring}_write"][s] = index[ring, i, c]
            continue
        step = direction(s, place[dst], p)
        way = "up" if step == 1 else "down"
        row["send"][s] = step
        row[f"recv_{way}_kind"][place[dst]] = kind
        row[f"recv_{way}_slot"][place[dst]] = index[ring, i, c]
    fields: dict[str, Any] = {**out, **{f"{ring}_slots": sizes[ring] for ring in RINGS}}
    return SlotProgram(**fields)


def _colour(values: list[Value]) -> tuple[dict[Name, int], dict[str, int]]:
    """Interval colouring per ring and device: ({name: ring slot}, {ring: entries, at least 1}). A value holds
    its slot from its write (the end of slot `start`) until its read (in slot `stop` > start)."""
    index: dict[Name, int] = {}
    read_in: dict[tuple[str, int], list[int]] = {}  # per ring and device, per ring slot: when its value is read
    for device, start, stop, name in sorted(values, key=lambda v: v[1:3]):
        busy = read_in.setdefault((name[0], device), [])
        k = next((k for k, read in enumerate(busy) if read <= start), len(busy))
        if k == len(busy):
            busy.append(stop)
        busy[k] = stop
        index[name] = k
    sizes = {ring: max([1] + [len(b) for (r, _), b in read_in.items() if r == ring]) for ring in RINGS}
    return index, sizes


def simulate(prog: SlotProgram, table: Table) -> dict[str, int]:
    """Runs `prog` as the executor would, with symbolic values (("act", i, c), ("grad", i, c), ("stash", i, c),
    ("seed", i), ("w", i, c)) through per-device rings and the two permutes. Raises AssertionError naming the
    slot and device when an op is not the table's, reads anything but the value it needs, writes over a value not
    yet read (or, through an index field its op does not use, anywhere: the executor writes every slot), sends or
    receives wrongly, or when a value is never read. Returns {ring: the most entries live at once on a device}."""
    p, n, place = table.p, table.n, table.placement
    grid = table.grid()
    chunk_of = {(place[c], sum(1 for k in range(c) if place[k] == place[c])): c for c in range(n)}
    rings: list[dict[str, list[Name | None]]] = [
        {r: [None] * getattr(prog, f"{r}_slots") for r in RINGS} for _ in range(p)
    ]
    peak = dict.fromkeys(RINGS, 0)
    for t in range(prog.kind.shape[0]):
        row = {name: [int(x) for x in getattr(prog, name)[t]] for name in FIELDS}
        reads: list[tuple[int, str, Name]] = []  # (device, field, value)
        writes: list[tuple[int, str, Name]] = []
        sent: dict[tuple[int, str], Name] = {}  # (receiving device, way): value
        for s in range(p):
            op, kind = grid[t][s], row["kind"][s]
            i, c = row["microbatch"][s], chunk_of.get((s, row["chunk_local"][s]))
            if ((op.kind, op.microbatch, op.chunk) if op else None) != (("_FBW"[kind], i, c) if kind else None):
                _fail(table, t, s, f"runs {'_FBW'[kind]}({i}, {c}) where the table runs {op}")
            if kind == IDLE:
                if row["send"][s] or any(row[f][s] != -1 for f in _INDEX_FIELDS):
                    _fail(table, t, s, "idle, yet sends or has an index (the executor writes it)")
                continue
            if (row["is_first"][s], row["is_last"][s]) != (c == 0, c == n - 1):
                _fail(table, t, s, "is_first / is_last do not match the chunk")
            assert c is not None  # the op matches the table's, whose chunk is set
            out: Name | None = None
            dst = -1
            if kind == F:
                reads += [(s, "act_read", ("act", i, c - 1))] if c > 0 else []
                writes += [(s, "stash_write", ("stash", i, c))]
                writes += [(s, "seed_write", ("seed", i))] if c == n - 1 else []
                out, dst = ("act", i, c), c + 1
            elif kind == B:
                reads += [(s, "stash_read", ("stash", i, c))]
                reads += [(s, "seed_read", ("seed", i)) if c == n - 1 else (s, "grad_read", ("grad", i, c + 1))]
                writes += [(s, "w_write", ("w", i, c))]
                out, dst = ("grad", i, c), c - 1
            else:
                reads += [(s, "w_read", ("w", i, c))]
            if out is None or not 0 <= dst < n:  # W (no output), or F / B of a chunk whose neighbour is none
                if row["send"][s]:
                    _fail(table, t, s, f"sends {out}, which no chunk needs")
            elif place[dst] == s:
                writes.append((s, f"local_{out[0]}_write", out))
            else:
                if (s + row["send"][s]) % p != place[dst] or row["send"][s] == 0:
                    _fail(table, t, s, f"sends {out} {row['send'][s]:+d}, but chunk {dst} is on device {place[dst]}")
                sent[(place[dst], "up" if row["send"][s] == 1 else "down")] = out
            used = {field for d, field, _ in reads + writes if d == s}
            if any(row[f][s] != -1 for f in _INDEX_FIELDS if f not in used):
                _fail(table, t, s, f"has an index in a field {'_FBW'[kind]} does not use (the executor writes it)")
        for s, field, value in reads:
            k, ring = row[field][s], rings[s][value[0]]
            if not 0 <= k < len(ring) or ring[k] != value:
                _fail(table, t, s, f"{field} {k} holds {ring[k] if 0 <= k < len(ring) else None}, needs {value}")
            ring[k] = None
        for s in range(p):
            for way in ("up", "down"):
                got, kind = sent.pop((s, way), None), row[f"recv_{way}_kind"][s]
                if (got[0] if got else None) != (RINGS[kind - 1] if kind else None):
                    _fail(table, t, s, f"receives {got} through {way} where the program expects kind {kind}")
                if got is not None:
                    writes.append((s, f"recv_{way}_slot", got))
                elif row[f"recv_{way}_slot"][s] != -1:
                    _fail(table, t, s, f"recv_{way}_slot is set with nothing to receive")
        for s, field, value in writes:  # the op's writes, then what the permutes brought
            k, ring = row[field][s], rings[s][value[0]]
            if not 0 <= k < len(ring) or ring[k] is not None:
                _fail(table, t, s, f"{field} {k} writes {value} out of range or over a value not yet read")
            ring[k] = value
        for r in RINGS:
            peak[r] = max([peak[r]] + [sum(x is not None for x in rings[s][r]) for s in range(p)])
    left = [x for s in range(p) for r in RINGS for x in rings[s][r] if x is not None]
    if left or prog.kind.shape[0] != table.slots:
        raise AssertionError(f"{table.name}: values never read {left[:4]}, or {prog.kind.shape[0]} slots run")
    return peak


_INDEX_FIELDS = tuple(f for f in FIELDS if f.endswith(("_read", "_write")))


def _fail(table: Table, t: int, s: int, why: str) -> NoReturn:
    raise AssertionError(f"{table.name} slot {t} device {s}: {why}")


def branch_shares(prog: SlotProgram, s: int) -> tuple[list[float], float]:
    """Device s's share of slots of each kind ([idle, F, B, W], summing to 1), and of slots whose op is F of the
    model's last chunk, after which the head's cond runs its true branch: the weights the compiled program's
    FLOPs reader gives the slot switch's branches and the head's cond (`jaxpar.analysis.hlo.flops.
    dot_flops_per_device`, `jaxpar.parallel.pipeline_zb`)."""
    kinds = prog.kind[:, s]
    shares = [float(np.mean(kinds == k)) for k in (IDLE, F, B, W)]
    return shares, float(np.mean((kinds == F) & (prog.is_last[:, s] > 0)))
