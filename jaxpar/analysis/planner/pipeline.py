"""Pipeline schedule arithmetic for reports: bubble, clock ticks, activations in flight, ideal step-time ratio.

Shape letters: p stages, m microbatches per step, b microbatch rows, T' activation sequence length, D model width.

Sources: GPipe (Huang et al. 2019) and PipeDream-Flush /
1F1B (Narayanan et al. 2021, arXiv 2104.04473, section 2.2): both have the bubble (p - 1)/(m + p - 1); the worst
stage holds m microbatches' activations under GPipe and p under 1F1B with separate programs per stage. The
numbers for the lockstep single-program loop (`jaxpar.parallel.pipeline`) are derived from its tick schedule:
at tick k stage s runs the forward of microbatch k - s and the backward of microbatch k - (2p - 2 - s).

All functions are pure integer/float arithmetic (no jax), so they are cheap to test.
"""

from __future__ import annotations

from jaxpar.config.choices import PIPELINE_SCHEDULES
from jaxpar.log import human_bytes
from jaxpar.parallel import schedule as _schedule
from jaxpar.parallel import schedule_table, zero_bubble
from jaxpar.parallel.slot_program import program as slot_program

ZERO_BUBBLE = ("zb-h1", "zb-v")  # the schedules run as a slot table (`jaxpar.parallel.pipeline_zb`)


def _check(schedule: str, p: int, m: int) -> None:
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule must be one of {PIPELINE_SCHEDULES}, got {schedule!r}")
    if p < 1 or m < 1:
        raise ValueError(f"need p >= 1 and m >= 1, got p={p} m={m}")


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a step, (p - 1)/(v*m + p - 1): for v = 1, (p - 1)/(m + p - 1), GPipe and 1F1B alike (GPipe
    section 2.3; arXiv 2104.04473 section 2.2); v > 1 virtual stages per device, interleaved 1F1B (section 2.2.2).
    The formula is `jaxpar.parallel.schedule.bubble_fraction`'s. Raises ValueError for p or m < 1, or, with v > 1,
    for v < 1 or m not a multiple of p (`jaxpar.parallel.schedule.check`)."""
    _check("1f1b", p, m)
    _schedule.check(p, v, m)
    return _schedule.bubble_fraction(p, v, m)


def schedule_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The bubble of any schedule: `bubble_fraction` for 1f1b and gpipe, the table's idle share at unit times
    for zb-h1 and zb-v (`jaxpar.parallel.zero_bubble.bubble_fraction`: ZB-H1 (p - 1)/(3vm + p - 1), ZB-V
    (p - 1)/(6m + p - 1) for m >= p)."""
    if schedule in ZERO_BUBBLE:
        return zero_bubble.bubble_fraction(schedule, p, m, v)
    return bubble_fraction(p, m, v)


def tick_counts(schedule: str, p: int, m: int, v: int = 1) -> dict[str, float]:
    """Clock ticks of one step of the lockstep loop.

    Returns {"ticks": ticks run, "half_ticks": ticks doing only a forward or only a backward,
    "full_equivalent": stage-ticks' worth of forward + backward, "formula": m + (p - 1)/v}.
      1F1B: m + 2p - 2 ticks; the p - 1 warm-up (forward only) and p - 1 cool-down (backward only) ticks are
        half ticks, so the step is worth m + p - 1 full ticks.
      Interleaved 1F1B (v > 1, `jaxpar.parallel.schedule`): m*v + v*p + p - 2 chunk ticks, v*p - 1 forward-only
        and v*p - 1 backward-only; a chunk tick is 1/v of a stage tick, so the step is worth m + (p - 1)/v.
      GPipe: m + p - 1 forward ticks, then m + p - 1 backward ticks (autodiff of the forward loop); counted as
        2(m + p - 1) half ticks = m + p - 1 full ticks.
      zb-h1, zb-v: the table's slots (`jaxpar.parallel.zero_bubble`), one chunk's F, B or W per device each, so
        3v slots are one stage's F + B + W: the step is worth slots / 3v; none is a half tick (an idle device
        skips its slot).
    Raises ValueError for an unknown schedule, p, m < 1, or v > 1 with GPipe or with m not a multiple of p.
    """
    _check(schedule, p, m)
    if schedule in ZERO_BUBBLE:
        table = zero_bubble.build(schedule, p, m, v)
        full = table.slots / (3 * v)
        return {"ticks": table.slots, "half_ticks": 0, "full_equivalent": full, "formula": full}
    if v > 1:
        if schedule != "1f1b":
            raise ValueError(f"virtual stages interleave 1F1B, not {schedule}")
        _schedule.check(p, v, m)
        formula = m + (p - 1) / v
        half = 2 * _schedule.warmup_ticks(p, v)
        return {"ticks": _schedule.ticks(p, v, m), "half_ticks": half, "full_equivalent": formula, "formula": formula}
    formula = m + p - 1
    if schedule == "1f1b":
        return {"ticks": m + 2 * p - 2, "half_ticks": 2 * (p - 1), "full_equivalent": formula, "formula": formula}
    return {"ticks": 2 * formula, "half_ticks": 2 * formula, "full_equivalent": formula, "formula": formula}


def stage_inputs_in_flight(schedule: str, p: int, m: int, v: int = 1) -> dict[str, int]:
    """Microbatch stage inputs ([b, T', D] each) kept for the backward, on the worst stage (stage 0).

    Returns {"allocated": buffers the program reserves, "live": most that hold a needed input at once}.
      1F1B: a ring of 2p - 1 slots whatever m; stage s keeps each input 2p - 2 - 2s ticks, so stage 0 has up
        to min(m, 2p - 1) live (stage s: min(m, 2p - 1 - 2s)). Separate per-stage programs need only p
        (arXiv 2104.04473); the lockstep loop pays 2p - 1 for having every stage run the same tick.
      Interleaved 1F1B (v > 1): a ring of 2pv - 1 chunk inputs (each the size of a stage input); device 0 keeps
        chunk j*p's input 2(pv - 1 - j*p) ticks, starting one forward per tick, so up to min(m*v, 2pv - 1) live.
      GPipe: autodiff of the forward scan saves every tick's stage input (m + p - 1 buffers, m of them real
        microbatches) plus each tick's layer residuals, which this count leaves out.
      zb-h1, zb-v: chunk-microbatches whose F has run and whose W has not, on the device that holds the most
        (`jaxpar.parallel.schedule_table.in_flight`), against the stash ring's slots (`slot_program`); B's
        boundary for W has its own ring.
    Raises ValueError for an unknown schedule or p, m < 1, or as `tick_counts` for v > 1.
    """
    _check(schedule, p, m)
    if schedule in ZERO_BUBBLE:
        table = zero_bubble.build(schedule, p, m, v)
        return {"allocated": slot_program(table).stash_slots, "live": max(schedule_table.in_flight(table))}
    if v > 1:
        tick_counts(schedule, p, m, v)  # the checks
        slots = _schedule.stash_slots(p, v)
        return {"allocated": slots, "live": min(m * v, slots)}
    if schedule == "1f1b":
        return {"allocated": 2 * p - 1, "live": min(m, 2 * p - 1)}
    return {"allocated": m + p - 1, "live": m}


def activation_bytes(b: int, seq: int, d_model: int, dtype_bytes: int) -> int:
    """Bytes of one microbatch's stage input [b, T', D]: b * T' * D * dtype_bytes, what one collective-permute sends."""
    return b * seq * d_model * dtype_bytes


def ideal_time_ratio(schedule: str, p: int, m: int, recompute: bool = False, v: int = 1) -> float:
    """Compute-bound step time of the lockstep loop over a data-parallel step on the same p devices with the
    same global batch (m * b rows), counting a backward as 2 forwards and ignoring communication and the
    embedding and head (which the first and last stage alone run, each once per microbatch).

    Unit: one stage forward on b rows; data parallel does 3m units per device.
      1F1B, `recompute` (pipeline.recompute=true): warm-up p - 1 ticks x 1 (F), steady m x 4 (F + recomputed
        F + B), cool-down p - 1 x 3 -> 4(m + p - 1); ratio 4(m + p - 1) / 3m (the 4/3 is the stage forward
        recomputed from its stashed input).
      1F1B keeping residuals, and GPipe: (m + p - 1) x 3 (masked ticks still compute) -> ratio (m + p - 1) / m
        = 1 / (1 - bubble).
      Interleaved 1F1B (v > 1): the same in chunk ticks, a chunk being 1/v of a stage: (v m + p - 1)/(v m), times
        4/3 with recompute.
      zb-h1, zb-v: slots / 3vm (an idle slot costs its wait, nothing more), times 4/3 with recompute.
    """
    full = tick_counts(schedule, p, m, v)["full_equivalent"]
    units = 4 * full if (schedule != "gpipe" and recompute) else 3 * full
    return units / (3 * m)


def report_row(
    schedule: str,
    p: int,
    m: int,
    b: int,
    seq: int,
    d_model: int,
    dtype_bytes: int,
    recompute: bool = False,
    v: int = 1,
) -> dict:
    """The formula columns of one benchmark row (schedule, p, m, ticks, stage inputs in flight and their
    bytes, bubble, ideal time ratio, the tick ratio (v m + p - 1)/(v m) that bounds the FLOPs ratio); the
    benchmark adds measured temp bytes, FLOPs and step-time ratios. `recompute`: 1F1B with
    pipeline.recompute=true (the schedule column then reads "1f1b-rc"); `v`: virtual stages ("1f1b-v2")."""
    ticks = tick_counts(schedule, p, m, v)
    flight = stage_inputs_in_flight(schedule, p, m, v)
    one = activation_bytes(b, seq, d_model, dtype_bytes)
    name = (
        schedule
        + (f"-v{v}" if v > 1 and schedule != "zb-v" else "")
        + ("-rc" if recompute and schedule != "gpipe" else "")
    )
    return {
        "schedule": name,
        "p": p,
        "m": m,
        **ticks,
        "in_flight": flight["live"],
        "in_flight_alloc": flight["allocated"],
        "in_flight_bytes": flight["live"] * one,
        "bubble": schedule_bubble(schedule, p, m, v),
        "ideal_ratio": ideal_time_ratio(schedule, p, m, recompute, v),
        "tick_ratio": 1 / (1 - schedule_bubble(schedule, p, m, v)),
    }


COLUMNS = (
    ("schedule", "sched", "{}"),
    ("p", "p", "{}"),
    ("m", "m", "{}"),
    ("temp_bytes", "temp bytes", None),
    ("in_flight", "live/alloc inputs", "{}"),
    ("in_flight_bytes", "live bytes", None),
    ("ticks", "ticks (half)", "{}"),
    ("full_equivalent", "full-tick eq", "{:g}"),
    ("bubble", "bubble", "{:.3f}"),
    ("bubble_flops", "1-dp/FLOPs", "{:.3f}"),
    ("bubble_time", "1-dp/t", "{:.3f}"),
    ("tick_ratio", "1/(1-bubble)", "{:.3f}"),
    ("flops_ratio", "FLOPs/dp", "{:.3f}"),
    ("busiest_ratio", "max FLOPs/dp", "{:.3f}"),
    ("busiest_formula", "max/mean formula", "{:.3f}"),
    ("ideal_ratio", "ideal t/dp", "{:.2f}"),
    ("time_ratio", "meas t/dp", "{:.2f}"),
)


def format_table(rows: list[dict]) -> str:
    """Fixed-width text table of `report_row` dicts, with "temp_bytes", "flops_ratio" and "time_ratio" added
    (bytes by `jaxpar.log.human_bytes`); the measured bubbles are 1 - 1/flops_ratio and 1 - 1/time_ratio (the
    share of the pipelined step's work, or time, that data parallelism does not need)."""

    def cell(row, key, fmt):
        if key in ("bubble_flops", "bubble_time"):
            ratio = row.get("flops_ratio" if key == "bubble_flops" else "time_ratio")
            return "-" if ratio is None else fmt.format(1 - 1 / ratio)
        if key == "in_flight":
            return f"{row['in_flight']}/{row['in_flight_alloc']}"
        if key == "ticks":
            return f"{row['ticks']} ({row['half_ticks']})"
        value = row.get(key)
        if value is None:
            return "-"
        return human_bytes(value) if key.endswith("bytes") else fmt.format(value)

    table = [[head for _, head, _ in COLUMNS]] + [[cell(r, k, f) for k, _, f in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in table)
