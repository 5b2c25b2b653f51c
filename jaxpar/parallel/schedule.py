"""Clock-tick arithmetic of the lockstep 1F1B schedule with v virtual stages per device (interleaved 1F1B, Narayanan
et al. 2021, arXiv 2104.04473, section 2.2.2); v = 1 is plain 1F1B (PipeDream-Flush, section 2.2).

Symbols: p devices on the `pipeline` axis, v virtual stages (model chunks) per device, m microbatches (a multiple
of p when v > 1), s a device's pipeline index, j a virtual stage, c = j*p + s a model chunk (the model's layers
split into p*v chunks of consecutive layers, chunk c on device c mod p: non-adjacent chunks per device), i a
microbatch, i = g*p + r (group g, position r).

Every device runs the same program in clock ticks; in one tick a device runs at most one chunk forward and one
chunk backward. Forward of (i, c) at tick

    t_f(i, c) = g*p*v + j*p + r + s,

backward at

    t_b(i, c) = (p*v - 1) + g*p*v + (v - 1 - j)*p + r + (p - 1 - s).

Each (t, s) names at most one forward and one backward (the decompositions are unique). A microbatch's
activations move chunk c -> c + 1 one tick later, always to the next device (p - 1 wraps to device 0 and the next
virtual stage), so one ring `ppermute` per tick carries them; gradients move c -> c - 1 the same way backwards.
The last chunk starts each backward in the tick of its forward. Ticks: m*v + v*p + p - 2: v*p - 1 forward-only
(warm-up), m*v + p - v*p steady, v*p - 1 backward-only (cool-down), with m*v chunk forwards and backwards per
device. A tick's chunk is 1/v of a stage, so the schedule takes m + (p - 1)/v stage-ticks of forward+backward where
m are useful: the bubble is (p - 1) / (v*m + p - 1) (section 2.2.2: the bubble shrinks by the factor v).

A chunk input waits t_b - t_f = 2*(p*v - 1 - c) ticks for its backward, at most 2pv - 2, and a device starts at
most one forward per tick, so a ring of 2pv - 1 slots indexed by the forward tick holds every input (or residual)
still needed, whatever m: memory flat in m. v = 1 gives 2p - 1 stage inputs; with v > 1 each slot is 1/v of a
stage's activations, so the stash holds (2pv - 1)/v, about 2p, stages' worth.
"""

from __future__ import annotations


def check(p: int, v: int, m: int) -> None:
    """Raises ValueError unless p, v, m >= 1 and, when v > 1, p divides m (the schedule runs microbatches in groups
    of p through each virtual stage)."""
    if min(p, v, m) < 1:
        raise ValueError(f"pipeline stages {p}, virtual stages {v} and microbatches {m} must be >= 1")
    if v > 1 and m % p:
        raise ValueError(
            f"interleaved 1F1B runs microbatches in groups of mesh.pipeline={p}: pipeline.microbatches={m} is not a "
            f"multiple of it; use {max(p, m - m % p)} or {m - m % p + p}"
        )


def ticks(p: int, v: int, m: int) -> int:
    """Clock ticks of the schedule: m*v + v*p + p - 2."""
    return m * v + v * p + p - 2


def warmup_ticks(p: int, v: int) -> int:
    """Forward-only ticks before the first backward: v*p - 1."""
    return v * p - 1


def forward_tick(i: int, c: int, p: int, v: int) -> int:
    """t_f(i, c) (module docstring)."""
    g, r = divmod(i, p)
    j, s = divmod(c, p)
    return g * p * v + j * p + r + s


def forward_at(t, s, p: int, v: int, m: int):
    """(microbatch i, virtual stage j, valid) of the forward device `s` runs at tick `t`; works on Python ints and
    on jax integer arrays alike (floor division and modulo of non-negative values)."""
    u = t - s
    g, rem = u // (p * v), u % (p * v)
    j, r = rem // p, rem % p
    i = g * p + r
    return i, j, (u >= 0) & (i < m)


def backward_at(t, s, p: int, v: int, m: int):
    """(microbatch i, virtual stage j, valid) of the backward device `s` runs at tick `t` (ints or jax arrays)."""
    u = t - warmup_ticks(p, v) - (p - 1 - s)
    g, rem = u // (p * v), u % (p * v)
    j, r = v - 1 - rem // p, rem % p
    i = g * p + r
    return i, j, (u >= 0) & (i < m)


def stash_slots(p: int, v: int) -> int:
    """Slots of the ring that holds chunk inputs (or residuals) from forward to backward: 2pv - 1."""
    return 2 * p * v - 1


def bubble_fraction(p: int, v: int, m: int) -> float:
    """(p - 1) / (v*m + p - 1): the idle share of each device's time (Narayanan et al. 2021, section 2.2.2)."""
    return (p - 1) / (v * m + p - 1)


def describe(schedule_name: str, p: int, v: int, m: int, recompute: bool) -> str:
    """One line for logs: the schedule, stages, virtual stages, microbatches, what the stash keeps, the bubble.
    GPipe's bubble is the same (p - 1)/(m + p - 1) (Huang et al. 2019, section 2.3)."""
    if schedule_name == "gpipe":
        return f"GPipe, {p} stages, {m} microbatches, bubble {bubble_fraction(p, 1, m):.3f}"
    kind = "1F1B" if v == 1 else f"interleaved 1F1B, {v} virtual stages per device"
    keeps = "stage inputs (forward recomputed)" if recompute else "residuals"
    return (
        f"{kind}, {p} stages, {m} microbatches, a ring of {stash_slots(p, v)} {keeps}, "
        f"bubble (p-1)/(vm+p-1) = {bubble_fraction(p, v, m):.3f}"
    )
