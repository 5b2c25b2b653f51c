"""Step timing for benchmark scripts: per-step wall time, interleaved rounds, medians.

Benchmarks print ratios measured in one run (never timed assertions). Interleaving the contenders round by
round spreads slow drift of the machine (other processes, thermal state) over all of them alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def compiled_cost(compiled) -> dict[str, float]:
    """XLA's static cost estimate of a compiled program: {"flops", "bytes_accessed"} (per device; NaN where the
    backend gives none). Deterministic, so it separates real extra work from timing noise."""
    cost = compiled.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else (cost or {})
    return {
        "flops": float(cost.get("flops", float("nan"))),
        "bytes_accessed": float(cost.get("bytes accessed", float("nan"))),
    }


def time_steps(step: Callable[[], Any], n: int) -> list[float]:
    """Calls `step()` n times, blocking on each result; returns the wall time of each call in seconds.

    `step` runs one training step and returns something to wait on (arrays or a pytree of them); it keeps its
    own state between calls (e.g. a closure over a dict it updates).
    """
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(step())
        times.append(time.perf_counter() - t0)
    return times


def interleaved_step_times(
    steps: dict[str, Callable[[], Any]], n: int, rounds: int, warmup: int = 2
) -> dict[str, list[list[float]]]:
    """Times each named step `n` times per round for `rounds` rounds, taking turns within every round and
    reversing the order of turns every other round (so no contender always runs right after another).

    Each step is first called `warmup` times untimed (compilation, first-touch allocation).

    Returns:
      name -> `rounds` lists of `n` per-step wall times in seconds.

    Raises:
      ValueError: n, rounds < 1.
    """
    if n < 1 or rounds < 1:
        raise ValueError(f"need n >= 1 and rounds >= 1, got n={n} rounds={rounds}")
    for step in steps.values():
        time_steps(step, warmup)
    out: dict[str, list[list[float]]] = {name: [] for name in steps}
    order = list(steps)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            out[name].append(time_steps(steps[name], n))
    return out


def median_seconds(rounds: list[list[float]]) -> float:
    """Median over all rounds' per-step wall times (seconds): robust to the odd slow step (GC, scheduler)."""
    return statistics.median(t for r in rounds for t in r)


def round_medians(rounds: list[list[float]]) -> list[float]:
    """Median per-step wall time (seconds) of each round: shows the run-to-run spread."""
    return [statistics.median(r) for r in rounds]
