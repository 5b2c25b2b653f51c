"""Zero-bubble pipeline schedules (ZB-H1, ZB-V) and 1F1B as static tables for the lockstep SPMD pipeline
(`jaxpar.parallel.schedule_table` has the table, its checker and the lockstep cost; pure Python).

Symbols: p devices on the `pipeline` axis, v model chunks per device, m microbatches, i a microbatch, s a device,
c a model chunk, j = c // p a virtual stage, t a clock tick; T_F, T_B, T_W the times of one stage's forward,
input-gradient backward and weight-gradient backward of one microbatch (a chunk's take 1/v of them). Sources:
Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241 (ZB-H1 in section 2.1, whose bubble figures
assume T_F = T_B = T_W); Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", arXiv 2405.15362,
sections 3-4 (V-shape building blocks; ZB-V is the zero-bubble one, V-ZB).

Schedules (every tick, each device has one F, one B and one W slot):
  * `1f1b` (PipeDream-Flush, Narayanan et al. 2021, arXiv 2104.04473, section 2.2; interleaved with v > 1,
    section 2.2.2): the ticks of `jaxpar.parallel.schedule`, chunk c on device c mod p, W in its B's tick. Plain
    1F1B: F(i, s) = i + s, B(i, s) = W(i, s) = i + 2p - 2 - s.
  * `zb-h1`: 1F1B's F and B ticks (interleaved with v > 1), and W of chunk j*p + s in device 0's B tick of chunk
    j*p, the same microbatch: every device runs its W in the same ticks. v = 1: W(i, s) = i + 2p - 2.
  * `zb-v`: v = 2 chunks per device in a V: chunk c on device c for c < p and on 2p - 1 - c after, so chunk 0
    runs down 0 -> p-1, the last chunk comes back to device 0, and chunks p - 1 and p share device p - 1.
    F(i, c) = 2i + c, B(i, c) = 2i + 4p - 2 - c, W(i, c) = 2i + 4p - 2 for c < p, 2i + 2p - 1 + 2*floor(p/2)
    after. A device's two chunks are an odd number of ticks apart, so its F (and B) alternate between them; W
    of first-half chunks takes the even ticks, of second-half chunks the odd ones. Activations go +1 through
    chunks 0 .. p-2 and -1 through p .. 2p-2, gradients the other way: a steady tick needs a permute in each
    direction for each (`schedule_table.permutes`), twice 1F1B's traffic, and no wrap from p - 1 to 0.

Bubble per device in the lockstep model (`schedule_table` module docstring), every allowed m:
  * 1F1B: (p - 1)(T_F + T_B + T_W)/v, the papers' figure (2401.10241 section 2.1; 2104.04473 section 2.2.2).
  * ZB-H1: (p - 1)(T_F + T_B)/v; ZB-V: (p - 1)(T_F + T_B). The papers give ZB-H1 (p - 1)(T_F + T_B - T_W)
    (2401.10241 section 2.1, v = 1) and ZB-V zero at T_F = T_B = T_W (2405.15362 section 4). Lockstep cannot
    reach those: a tick pays for a slot kind when any device runs it, so a W fills only ticks that pay for W
    anyway and never hides in another device's F or B time, as it does in the papers' asynchronous schedules.
    The least any lockstep table with these slots can do: a device's m*v forward ticks are distinct, and so are
    the ticks in which chunks on other devices run the forwards that precede its first chunk and follow its last
    chunk (h hops in all); F then pays for at least m*v + h chunk ticks, B likewise, W for m*v, so the bubble is
    at least h (T_F + T_B)/v, with h = p - 1 on the interleaved ring (s hops before chunk s, p - 1 - s after
    chunk (v-1)p + s) and h = 2(p - 1) in the V (device p - 1 is p - 1 hops from both ends). Both tables reach
    that bound. At T_F = T_B = T_W the fraction of the step is 2(p - 1)/(3mv + 2(p - 1)) for ZB-H1 (v = 1: two
    thirds of 1F1B's bubble, where the paper has one third; v = 2: (p - 1) stage times, the paper's ZB-H1
    figure) and 2(p - 1)/(3m + 2(p - 1)) for ZB-V (ZB-H1's at v = 1, not zero): in lockstep the V loses to the
    ring, since its middle device waits 2(p - 1) chunk ticks.

In flight (chunk-microbatches a device holds, `schedule_table.in_flight`), per device s: at most these, which
every m >= 2p reaches (each table's `in_flight_bound`):
  * 1F1B: (v + 1)p - 1 - 2s. At v = 1 device 0 holds 2p - 1 (asynchronous 1F1B holds p): in lockstep it starts
    a forward every tick until its first backward in tick 2p - 2. The step's stash ring has 2pv - 1 slots.
  * ZB-H1: (v + 1)p - 1 - s: device 0 holds 1F1B's peak, the others more than under 1F1B but never more than
    device 0 (2401.10241 section 2.1: 1F1B's peak memory, reached by every device).
  * ZB-V: 2p + floor(p/2) on every device, half a stage each: p + floor(p/2)/2 stages' worth, at most 1F1B's
    2p - 1 for p >= 2 (2405.15362 section 4 has exactly 1F1B's p stages, asynchronously).

Microbatches allowed: any m >= 1; with v > 1 on the ring (interleaved 1F1B, ZB-H1) only multiples of p, which run
in groups of p (`jaxpar.parallel.schedule.check`); ZB-V takes any m >= 1.
"""

from __future__ import annotations

import dataclasses

from jaxpar.parallel import schedule
from jaxpar.parallel.schedule_table import Op, Table

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


def build(name: str, p: int, m: int, v: int = 1) -> Table:
    """The table of schedule `name` (module docstring) for p devices, m microbatches, v chunks per device.
    Raises ValueError from `check_sizes`."""
    check_sizes(name, p, m, v)
    if name == "zb-v":
        return zb_v(p, m)
    return zb_h1(p, m, v) if name == "zb-h1" else one_f_one_b(p, m, v)


def one_f_one_b(p: int, m: int, v: int = 1) -> Table:
    """1F1B (interleaved with v > 1) with W in its B's tick: `jaxpar.parallel.schedule`'s ticks as a table."""
    ops = []
    for t in range(schedule.ticks(p, v, m)):
        for s in range(p):
            i, j, ok = schedule.forward_at(t, s, p, v, m)
            if ok:
                ops.append(Op("F", t, s, i, j * p + s))
            i, j, ok = schedule.backward_at(t, s, p, v, m)
            if ok:
                ops += [Op("B", t, s, i, j * p + s), Op("W", t, s, i, j * p + s)]
    bound = tuple((v + 1) * p - 1 - 2 * s for s in range(p))
    return Table("1f1b", p, v, m, tuple(c % p for c in range(p * v)), tuple(ops), bound)


def zb_h1(p: int, m: int, v: int = 1) -> Table:
    """ZB-H1 (module docstring): 1F1B's F and B; W of (i, j*p + s) in the tick of B of (i, j*p) on device 0."""
    base = one_f_one_b(p, m, v)
    b_tick = {(op.microbatch, op.chunk): op.tick for op in base.ops if op.kind == "B"}
    ops = tuple(
        op._replace(tick=b_tick[op.microbatch, op.chunk - op.chunk % p]) if op.kind == "W" else op for op in base.ops
    )
    bound = tuple((v + 1) * p - 1 - s for s in range(p))
    return dataclasses.replace(base, name="zb-h1", ops=ops, in_flight_bound=bound)


def zb_v_device(c: int, p: int) -> int:
    """The device of chunk c in the V: c for c < p, 2p - 1 - c after."""
    return c if c < p else 2 * p - 1 - c


def zb_v(p: int, m: int) -> Table:
    """ZB-V (module docstring): F(i, c) = 2i + c, B(i, c) = 2i + 4p - 2 - c, W(i, c) = 2i + 4p - 2 for c < p and
    2i + 2p - 1 + 2*floor(p/2) for c >= p."""
    ops = []
    for i in range(m):
        for c in range(2 * p):
            s = zb_v_device(c, p)
            w = 2 * i + (4 * p - 2 if c < p else 2 * p - 1 + 2 * (p // 2))
            ops += [Op("F", 2 * i + c, s, i, c), Op("B", 2 * i + 4 * p - 2 - c, s, i, c), Op("W", w, s, i, c)]
    placement = tuple(zb_v_device(c, p) for c in range(2 * p))
    return Table("zb-v", p, 2, m, placement, tuple(ops), (2 * p + p // 2,) * p)


def bubble(name: str, p: int, v: int = 1, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """A device's bubble in lockstep (module docstring), in the units of t_f, t_b, t_w, the same for every m:
    1F1B (p - 1)(T_F + T_B + T_W)/v, ZB-H1 (p - 1)(T_F + T_B)/v, ZB-V (p - 1)(T_F + T_B)."""
    if name == "1f1b":
        return (p - 1) * (t_f + t_b + t_w) / v
    return (p - 1) * (t_f + t_b) / (v if name == "zb-h1" else 1)


def paper_bubble(name: str, p: int, v: int = 1, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """The papers' bubble per device, asynchronous: 1F1B (p - 1)(T_F + T_B + T_W)/v (2104.04473 section 2.2.2),
    ZB-H1 (p - 1)(T_F + T_B - T_W) (2401.10241 section 2.1, v = 1), ZB-V 0 (2405.15362 section 4, stated for
    T_F = T_B = T_W). Raises ValueError for ZB-H1 with v > 1 or ZB-V at other times (no figure given)."""
    if name == "1f1b":
        return (p - 1) * (t_f + t_b + t_w) / v
    if name == "zb-h1" and v == 1:
        return (p - 1) * (t_f + t_b - t_w)
    if name == "zb-v" and t_f == t_b == t_w:
        return 0.0
    raise ValueError(f"the papers give no bubble for {name} with v={v}, T_F={t_f}, T_B={t_b}, T_W={t_w}")


def bubble_fraction(
    name: str, p: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0
) -> float:
    """The bubble's share of the lockstep step: bubble / (m (T_F + T_B + T_W) + bubble); at T_F = T_B = T_W
    (p - 1)/(vm + p - 1) for 1F1B. Raises ValueError from `check_sizes`."""
    check_sizes(name, p, m, v)
    idle = bubble(name, p, v, t_f, t_b, t_w)
    return idle / (m * (t_f + t_b + t_w) + idle)
