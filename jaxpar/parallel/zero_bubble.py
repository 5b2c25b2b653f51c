"""Zero-bubble pipeline schedules (ZB-H1, ZB-V) and 1F1B as tables of the mixed slot model
(`jaxpar.parallel.schedule_table`: one op per device per slot, values to ring neighbours after each slot; the
table, its checker and its lockstep cost). Pure Python, built at trace time.

Symbols: p devices on the `pipeline` axis, v model chunks per device, n = pv chunks, m microbatches, i a
microbatch, c a model chunk, s a device; t_f, t_b, t_w the times of one chunk's F, B, W (a stage's T_F = v t_f).
Sources: Narayanan et al. 2021, arXiv 2104.04473 (1F1B section 2.2, interleaved section 2.2.2); Qi et al. 2023,
"Zero Bubble Pipeline Parallelism", arXiv 2401.10241 (ZB-H1 section 2.1, ZB-V section 6); Qi et al. 2024,
"Pipeline Parallelism with Controllable Memory", arXiv 2405.15362 (the V and V-ZB, sections 3-4).

Schedules (`build`):
  * `1f1b`: chunk c on device c mod p; each device runs Megatron's order (warm-up forwards, then one forward
    and one backward in turn, then cool-down backwards; interleaved, v > 1, in groups of p microbatches per
    chunk), every B followed by its W in the next slot: the unsplit backward, whose input gradient the builder
    lets chunk c - 1 use only after that W, as 1F1B without the split would. Ops as early as order and
    dependencies allow.
  * `zb-h1`: v = 1, the order of 2401.10241 section 2.1 (figure 3): device s runs p - s warm-up forwards, then
    B, [W], F in turn, its W starting after s B's (W deferred by the warm-up count), then the deferred W's; so
    every device holds p chunk-microbatches, 1F1B's peak. v > 1 (the interleaved ring, m a multiple of p): a
    list schedule, each slot each device runs a ready B (Megatron's backward order), else a ready F (its forward
    order) while it holds fewer than pv, else its oldest deferred W.
  * `zb-v`: v = 2, chunk c on device c for c < p and on 2p - 1 - c after (the V): activations go +1 through
    chunks 0 .. p - 1 and -1 back, gradients the other way, no wrap. Device p - 1 holds chunks p - 1 and p and
    runs them in pairs of slots: a string of 3m pairs, F^p (B W F)^(m-p) B^p W^p, fixes when microbatch i's
    chunks meet it (the i-th F pair at phi_i, the i-th B pair at beta_i; beta_i >= phi_i + p, the V's round
    trip), and nothing waits on the way: F(i, c) = 2 phi_i + c, B(i, c) = 2 beta_i + 2p - 1 - c. On device s
    the F of chunk s and the B of chunk 2p-1-s take the slots of one parity, the others the other parity, so
    they never collide; the slots left free (device p - 1's W pairs, seen from s, and the ends) take the
    device's W's, oldest B first. Device s idles s slots before chunk s's first F and p - 1 - s slots of the
    other parity before chunk 2p-1-s's: p - 1 in all, and the W's fill every other slot to the step's end (the
    tests check this). For m < p the string is F^m, p - m idle pairs, B^m W^m.

Bubble per device at t_f = t_b = t_w = 1, in chunk slots, counted from the tables (`unit_bubble`):
  * 1F1B: 3(p - 1), fraction (p - 1)/(vm + p - 1): the paper's (2104.04473 sections 2.2, 2.2.2).
  * ZB-H1: p - 1 for m >= p (v = 1) and for every allowed m (v > 1), fraction (p - 1)/(3vm + p - 1): at v = 1
    the paper's (p - 1)(T_F + T_B - T_W) (2401.10241 section 2.1); v > 1 has no paper figure, and its bubble is a
    third of interleaved 1F1B's. m < p (v = 1): (p - 1) + (p - m).
  * ZB-V: p - 1 for m >= p, fraction (p - 1)/(6m + p - 1). The papers call it zero (2401.10241 section 6; V-ZB,
    2405.15362 section 4): they count each device from its first op to its last, a parallelogram that the next
    iteration fills, while one lockstep step holds every device from the first slot to the last.
These p - 1 are the least any table can have, on the ring or the V: chunk p - 1 sits on device p - 1 and its
first F waits for p - 1 earlier chunks' F's, so device p - 1 idles through slots 0 .. p - 2, and every device's
bubble is the same step time minus the same busy time.

In flight (chunk-microbatches, `schedule_table.in_flight`; each table's `in_flight_bound`, reached by every
device once m is large enough):
  * 1F1B: min(mv, w_s + 1) with w_s Megatron's warm-up count, p - s - 1 (v = 1; so p - s, section 2.2) or
    2(p - s - 1) + (v - 1)p (v > 1).
  * ZB-H1: min(m, p) at v = 1 (device 0's 1F1B peak on every device, 2401.10241 section 2.1); pv (p stages'
    worth, plain 1F1B's device 0) at v > 1, below interleaved 1F1B's (v + 1)p - 1 on device 0.
  * ZB-V: 2p chunks of half a stage: p stages, 1F1B's device 0 (2405.15362 section 4).
W pending (`schedule_table.w_pending`, the executor's W ring): 1 for 1F1B, s + 1 for ZB-H1 at v = 1 and m >= p.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from jaxpar.parallel import schedule
from jaxpar.parallel.schedule_table import Op, Table, check
from jaxpar.parallel.schedule_table import bubble_fraction as table_bubble_fraction

SCHEDULES = ("1f1b", "zb-h1", "zb-v")


def check_sizes(name: str, p: int, m: int, v: int = 1) -> None:
    """Raises ValueError unless schedule `name` can run p devices, m microbatches and v chunks per device (module
    docstring); the message names the values that work."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r} has no table; use one of {', '.join(SCHEDULES)}")
    if name == "zb-v":
        if v != 2:
            raise ValueError(f"zb-v runs 2 chunks per device (the V), not virtual_stages={v}; use virtual_stages=2")
        if min(p, m) < 1:
            raise ValueError(f"zb-v needs pipeline stages {p} >= 1 and microbatches {m} >= 1 (any m >= 1 works)")
        return
    schedule.check(p, v, m)


@functools.lru_cache(maxsize=64)
def build(name: str, p: int, m: int, v: int = 1) -> Table:
    """The checked table (`schedule_table.check`) of schedule `name` (module docstring) for p devices, m
    microbatches, v chunks per device. Raises ValueError from `check_sizes`."""
    check_sizes(name, p, m, v)
    if name == "zb-v":
        table = zb_v(p, m)
    else:
        table = zb_h1(p, m, v) if name == "zb-h1" else one_f_one_b(p, m, v)
    check(table)
    return table


def ring(p: int, v: int) -> tuple[int, ...]:
    """The interleaved ring's placement: chunk c on device c mod p."""
    return tuple(c % p for c in range(p * v))


def v_shape(p: int) -> tuple[int, ...]:
    """The V's placement: chunk c on device c for c < p, on 2p - 1 - c after."""
    return tuple(c if c < p else 2 * p - 1 - c for c in range(2 * p))


def one_f_one_b(p: int, m: int, v: int = 1) -> Table:
    """1F1B, interleaved with v > 1 (module docstring)."""
    orders = []
    for s in range(p):
        forwards, backwards = _megatron(p, m, v, s)
        warm = min(m * v, _warmup(p, v, s))
        order = [("F", *ic) for ic in forwards[:warm]]
        for k, (i, c) in enumerate(backwards):
            if warm + k < m * v:
                order.append(("F", *forwards[warm + k]))
            order += [("B", i, c), ("W", i, c)]
        orders.append(order)
    bound = tuple(min(m * v, _warmup(p, v, s) + 1) for s in range(p))
    return Table("1f1b", p, v, m, ring(p, v), _run(p, m, v, ring(p, v), _in_order(orders), True), bound)


def zb_h1(p: int, m: int, v: int = 1) -> Table:
    """ZB-H1 (module docstring): the paper's order at v = 1, a list schedule holding at most pv at v > 1."""
    if v > 1:
        f_key = lambda ic: (ic[0] // p, ic[1] // p, ic[0] % p)  # noqa: E731 (Megatron's forward order)
        b_key = lambda ic: (ic[0] // p, -(ic[1] // p), ic[0] % p)  # noqa: E731
        ops = _run(p, m, v, ring(p, v), _greedy(p * v, f_key, b_key))
        return Table("zb-h1", p, v, m, ring(p, v), ops, (p * v,) * p)
    orders = []
    for s in range(p):
        warm = min(m, p - s)
        order = [("F", i, s) for i in range(warm)]
        for k in range(m):
            order.append(("B", k, s))
            if k >= s:
                order.append(("W", k - s, s))
            if warm + k < m:
                order.append(("F", warm + k, s))
        orders.append(order + [("W", i, s) for i in range(max(0, m - s), m)])
    return Table("zb-h1", p, 1, m, ring(p, 1), _run(p, m, 1, ring(p, 1), _in_order(orders)), (min(m, p),) * p)


def zb_v(p: int, m: int) -> Table:
    """ZB-V (module docstring): F and B from device p - 1's pair string, W's in the free slots."""
    k = min(m, p)
    pairs = "F" * k + "." * (p - k) + "BWF" * (m - k) + "B" * k + "W" * k
    phi = [t for t, x in enumerate(pairs) if x == "F"]
    beta = [t for t, x in enumerate(pairs) if x == "B"]
    placement = v_shape(p)
    ops = [Op("F", 2 * phi[i] + c, placement[c], i, c) for i in range(m) for c in range(2 * p)]
    ops += [Op("B", 2 * beta[i] + 2 * p - 1 - c, placement[c], i, c) for i in range(m) for c in range(2 * p)]
    for s in range(p):
        taken = {op.slot for op in ops if op.device == s}
        backwards = sorted((op for op in ops if op.device == s and op.kind == "B"), key=lambda op: op.slot)
        t = 0
        for b in backwards:  # the oldest B's W in each free slot after it
            t = max(t, b.slot + 1)
            while t in taken:
                t += 1
            ops.append(Op("W", t, s, b.microbatch, b.chunk))
            t += 1
    return Table("zb-v", p, 2, m, placement, tuple(ops), (2 * p,) * p)


def unit_bubble(name: str, p: int, m: int, v: int = 1) -> int:
    """The bubble every device of `build(name, p, m, v)` has at t_f = t_b = t_w = 1, in chunk slots, in closed
    form (module docstring): 1F1B 3(p - 1); ZB-H1 (p - 1) + max(0, p - m); ZB-V p - 1 for m >= p. Raises
    ValueError from `check_sizes`, and for ZB-V with m < p (no closed form; the table has more)."""
    check_sizes(name, p, m, v)
    if name == "1f1b":
        return 3 * (p - 1)
    if name == "zb-h1":
        return p - 1 + max(0, p - m)
    if m < p:
        raise ValueError(f"zb-v with m={m} < p={p} microbatches has no closed-form bubble; count it from the table")
    return p - 1


def bubble_fraction(
    name: str, p: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0
) -> float:
    """1 - m*v*(t_f + t_b + t_w) / step time, counted from the table in lockstep (`schedule_table`); at unit
    times (p - 1)/(vm + p - 1) for 1F1B, (p - 1)/(3vm + p - 1) for ZB-H1 and (p - 1)/(6m + p - 1) for ZB-V
    (m >= p). Raises ValueError from `check_sizes`."""
    return table_bubble_fraction(build(name, p, m, v), t_f, t_b, t_w)


def paper_bubble(name: str, p: int, v: int = 1, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """The papers' bubble per device (asynchronous devices), in the units of the chunk times t_f, t_b, t_w:
    1F1B (p - 1)(t_f + t_b + t_w), i.e. (p - 1)(T_F + T_B + T_W)/v in stage times (2104.04473 sections 2.2,
    2.2.2); ZB-H1 at v = 1 (p - 1)(T_F + T_B - T_W) (2401.10241 section 2.1); ZB-V 0 at T_F = T_B = T_W
    (2401.10241 section 6, 2405.15362 section 4). Raises ValueError where the papers give none (ZB-H1 with
    v > 1, ZB-V at other times)."""
    if name == "1f1b":
        return (p - 1) * (t_f + t_b + t_w)
    if name == "zb-h1" and v == 1:
        return (p - 1) * (t_f + t_b - t_w)
    if name == "zb-v" and t_f == t_b == t_w:
        return 0.0
    raise ValueError(f"the papers give no bubble for {name} with v={v}, T_F={t_f}, T_B={t_b}, T_W={t_w}")


def describe(name: str, p: int, v: int, m: int, recompute: bool) -> str:
    """One line for logs: `jaxpar.parallel.schedule.describe` for 1f1b and gpipe; for zb-h1 and zb-v the
    schedule, stages, chunks per device, microbatches, what the stash keeps and the table's bubble at unit
    times."""
    if name not in ("zb-h1", "zb-v"):
        return schedule.describe(name, p, v, m, recompute)
    keeps = "stage inputs (forward recomputed)" if recompute else "residuals"
    kind = "ZB-V, 2 chunks per device in a V" if name == "zb-v" else "ZB-H1" + (f", {v} chunks per device" * (v > 1))
    return (
        f"{kind}, {p} stages, {m} microbatches, backward split into B and W, stash of {keeps}, "
        f"bubble {bubble_fraction(name, p, m, v):.3f}"
    )


def _warmup(p: int, v: int, s: int) -> int:
    """Megatron's warm-up forwards on device s: p - s - 1 (v = 1), 2(p - s - 1) + (v - 1)p (interleaved)."""
    return p - s - 1 if v == 1 else 2 * (p - s - 1) + (v - 1) * p


def _megatron(p: int, m: int, v: int, s: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Device s's (microbatch, chunk) forwards and backwards in Megatron's order: the k-th runs microbatch
    (k // pv) p + k mod p of virtual stage (k // p) mod v (backwards: v - 1 minus that)."""
    forwards, backwards = [], []
    for k in range(m * v):
        g, rest = divmod(k, p * v)
        i, j = g * p + rest % p, rest // p
        forwards.append((i, j * p + s))
        backwards.append((i, (v - 1 - j) * p + s))
    return forwards, backwards


Pick = Callable[[int, list, list, list, int], "tuple[str, int, int] | None"]


def _run(p: int, m: int, v: int, placement: tuple[int, ...], pick: Pick, unsplit: bool = False) -> tuple[Op, ...]:
    """List scheduling: slot by slot, device s runs pick(s, ready F's, ready B's, pending W's, held) (each a list
    of (microbatch, chunk), a chunk's F's and B's in microbatch order, W's oldest B first; `held` its
    chunk-microbatches in flight), or nothing for None. With `unsplit`, B(i, c) also waits for W(i, c + 1)."""
    n = p * v
    mine = [[c for c in range(n) if placement[c] == s] for s in range(p)]
    ran: set[tuple[str, int, int]] = set()  # ops of earlier slots: a slot's ops join after every device chose
    next_f, next_b = [0] * n, [0] * n
    pending: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    held = [0] * p
    ops: list[Op] = []
    t = 0
    while len(ops) < 3 * m * n:
        if t > 6 * m * n + 4 * n:
            raise RuntimeError(f"the list schedule stalls at slot {t} (p={p}, m={m}, v={v})")
        chosen: list[Op] = []
        for s in range(p):
            fs = [(next_f[c], c) for c in mine[s] if next_f[c] < m and (c == 0 or ("F", next_f[c], c - 1) in ran)]
            bs = [
                (next_b[c], c)
                for c in mine[s]
                if next_b[c] < m
                and ("F", next_b[c], c) in ran
                and (c == n - 1 or ("W" if unsplit else "B", next_b[c], c + 1) in ran)
            ]
            choice = pick(s, fs, bs, pending[s], held[s])
            if choice is not None:
                chosen.append(Op(choice[0], t, s, choice[1], choice[2]))
        for op in chosen:
            ran.add((op.kind, op.microbatch, op.chunk))
            if op.kind == "F":
                next_f[op.chunk] += 1
                held[op.device] += 1
            elif op.kind == "B":
                next_b[op.chunk] += 1
                pending[op.device].append((op.microbatch, op.chunk))
            else:
                pending[op.device].remove((op.microbatch, op.chunk))
                held[op.device] -= 1
        ops += chosen
        t += 1
    return tuple(ops)


def _in_order(orders: list[list[tuple[str, int, int]]]) -> Pick:
    """A `_run` pick that runs each device's ops in the given order, each as soon as it is ready."""
    position = [0] * len(orders)

    def pick(s, fs, bs, ws, held):
        if position[s] == len(orders[s]):
            return None
        kind, i, c = orders[s][position[s]]
        if (i, c) not in {"F": fs, "B": bs, "W": ws}[kind]:
            return None
        position[s] += 1
        return kind, i, c

    return pick


def _greedy(bound: int, f_key: Callable, b_key: Callable) -> Pick:
    """A `_run` pick: a ready B (least `b_key`), else a ready F (least `f_key`) while the device holds fewer
    than `bound`, else the oldest pending W."""

    def pick(s, fs, bs, ws, held):
        if bs:
            return ("B", *min(bs, key=b_key))
        if fs and held < bound:
            return ("F", *min(fs, key=f_key))
        return ("W", *ws[0]) if ws else None

    return pick
