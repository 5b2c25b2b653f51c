"""The golden losses table (tests/fixtures/golden_losses.json): how it is made from measured runs, its tolerance,
and the two comparisons, within the tolerance (tests/system/test_golden_losses.py) and bitwise
(tools/compare_losses.py). The runs themselves: `golden_runs`.

The tolerance comes from the spread of the same runs under the XLA CPU code generation CI uses (`VARIANTS`): for
each variant, config and step, |loss - reference| / |reference| against the native run; the table's relative
tolerance is MARGIN times the largest of them, and never under MARGIN fp32 ulps (`tolerance`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from collections.abc import Sequence

import golden_runs
import numpy as np

TABLE = os.path.join(golden_runs.ROOT, "tests", "fixtures", "golden_losses.json")
# The tolerance is MARGIN times the largest spread measured: room for CPUs and thread counts not measured here.
MARGIN = 10.0
# One fp32 ulp relative to the value, at its largest (a value just above a power of two): the smallest nonzero
# relative difference two fp32 losses can have is between 2**-24 and this.
ULP32 = 2.0**-23
# Each way of running the reference that CI or another machine may use: (environment changes, command prefix).
# XLA_FLAGS=--xla_cpu_max_isa caps the instruction set XLA:CPU generates code for (AVX2: 256-bit vectors;
# SSE4_2: 128-bit and no fused multiply-add); one core changes the thread pool.
VARIANTS = {
    "avx2": ({"XLA_FLAGS": "--xla_cpu_max_isa=AVX2"}, ()),
    "sse4_2": ({"XLA_FLAGS": "--xla_cpu_max_isa=SSE4_2"}, ()),
    "one_core": ({}, ("taskset", "-c", "0")),
}
# A run that must fail the comparison: the default config with its learning rate 1.0001 times tiny.yaml's.
PERTURBED = ("default", "optimizer.learning_rate=0.0030003")


def variants_here() -> dict[str, tuple[dict[str, str], tuple[str, ...]]]:
    """The VARIANTS this machine can run: the instruction-set caps on x86-64 only, one core where taskset exists."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    has_taskset = any(os.access(os.path.join(d, "taskset"), os.X_OK) for d in os.get_exec_path())
    return {k: v for k, v in VARIANTS.items() if (x86 if k != "one_core" else has_taskset)}


def tolerance(max_spread: float) -> float:
    """The relative tolerance of every step: MARGIN * max(the largest measured spread, one fp32 ulp)."""
    return MARGIN * max(max_spread, ULP32)


def spread(reference: dict[str, list[float]], variants: dict[str, dict[str, list[float]]]) -> dict:
    """The measured spread: {"by_variant": {variant: {config: max relative difference over steps}}, "by_step":
    [max over variants and configs, per step], "max": the largest}; relative to `reference` (the native run)."""
    by_variant = {
        v: {c: max(golden_runs.relative_differences(losses[c], reference[c])) for c in reference}
        for v, losses in variants.items()
    }
    rows = [
        golden_runs.relative_differences(losses[c], reference[c]) for losses in variants.values() for c in reference
    ]
    by_step = [max(col) for col in zip(*rows)] if rows else []
    return {"by_variant": by_variant, "by_step": by_step, "max": max(by_step, default=0.0)}


def token_digest() -> str:
    """sha256 of the token stream's bytes (uint16, little-endian)."""
    return hashlib.sha256(golden_runs.token_stream().astype("<u2").tobytes()).hexdigest()


def make_table(
    reference: dict[str, list[float]], variants: dict[str, dict[str, list[float]]], perturbed: list[float]
) -> dict:
    """The table: the configs with their reference losses, what they were made with, the measured spread, the
    tolerance that follows from it, and the perturbed run (`PERTURBED`) that the tolerance must reject."""
    measured = spread(reference, variants)
    name, change = PERTURBED
    return {
        "about": (
            "Training loss per step (token-mean cross-entropy, nats) of the golden configs, made by "
            "`python tools/golden_losses.py write` (tests/golden_runs.py, tests/golden_table.py) and compared by "
            "tests/system/test_golden_losses.py within tolerance.rtol. docs/testing.md says when to remake it."
        ),
        "made_with": {**golden_runs.versions(), "machine": platform.machine()},
        "steps": golden_runs.STEPS,
        "data": {
            "what": "golden_runs.token_stream: a Markov chain over 64 token ids from PCG64's raw output",
            "tokens": golden_runs.TOKENS,
            "seed": golden_runs.SEED,
            "sha256": token_digest(),
        },
        "common_overrides": list(golden_runs.COMMON),
        "configs": {
            c: {"what": g.what, "base": g.base, "overrides": list(g.overrides), "losses": reference[c]}
            for c, g in golden_runs.CONFIGS.items()
        },
        "spread": {
            "variants": {
                v: " ".join([*(f"{k}={x}" for k, x in VARIANTS[v][0].items()), *VARIANTS[v][1]]) for v in variants
            },
            **measured,
        },
        "tolerance": {"margin": MARGIN, "ulp32": ULP32, "rtol": tolerance(measured["max"])},
        "perturbed": {"config": name, "override": change, "losses": perturbed},
    }


def stale(table: dict) -> list[str]:
    """What of golden_runs the table no longer matches (configs, overrides, steps, data): it must be remade."""
    out = []
    if table["steps"] != golden_runs.STEPS or table["common_overrides"] != list(golden_runs.COMMON):
        out.append("the steps or the common overrides changed")
    if table["data"]["sha256"] != token_digest():
        out.append("the token stream changed")
    mine = {c: {"base": g.base, "overrides": list(g.overrides)} for c, g in golden_runs.CONFIGS.items()}
    theirs = {c: {"base": t["base"], "overrides": t["overrides"]} for c, t in table["configs"].items()}
    if mine != theirs:
        out.append(f"the configs changed: table {theirs}, golden_runs {mine}")
    return out


def bad_steps(table: dict, name: str, losses: Sequence[float]) -> list[int]:
    """The 1-based steps of `losses` that are over the table's tolerance for config `name` ([1] when the number
    of steps differs)."""
    rel = golden_runs.relative_differences(losses, table["configs"][name]["losses"])
    return [i + 1 for i, r in enumerate(rel) if not r <= table["tolerance"]["rtol"]]


def check(table: dict, losses: dict[str, list[float]]) -> list[str]:
    """Each step of each config of `losses` against the table: one line per config that is off (the first step
    over the tolerance and the worst one); [] when every step is within `rtol`."""
    rtol = table["tolerance"]["rtol"]
    out = []
    for name, got in losses.items():
        want = table["configs"][name]["losses"]
        bad = bad_steps(table, name, got)
        if len(got) != len(want):
            out.append(f"{name}: {len(got)} steps, the table has {len(want)}")
        elif bad:
            rel = golden_runs.relative_differences(got, want)
            worst = int(np.argmax(rel))
            out.append(
                f"{name}: {len(bad)} of {len(want)} steps off by more than rtol {rtol:.3g}, first at step {bad[0]}; "
                f"worst step {worst + 1}: {got[worst]!r} vs the table's {want[worst]!r} (relative {rel[worst]:.3g})"
            )
    return out


def bitwise_report(base: dict[str, list[float]], head: dict[str, list[float]]) -> tuple[list[str], bool]:
    """One line per config of `base`: bitwise equal (the fp32 losses' bits), or the first differing step and the
    largest relative difference; and whether all are equal."""
    lines, equal = [], True
    width = max(map(len, base), default=0)
    for name, a in base.items():
        b = head[name]
        bits_a, bits_b = (np.asarray(x, np.float32).view(np.uint32) for x in (a, b))
        if len(a) == len(b) and np.array_equal(bits_a, bits_b):
            lines.append(f"{name:<{width}}  bitwise equal ({len(a)} steps)")
            continue
        equal = False
        if len(a) != len(b):
            lines.append(f"{name:<{width}}  differs: {len(a)} steps at BASE, {len(b)} at HEAD")
            continue
        first = int(np.flatnonzero(bits_a != bits_b)[0])
        rel = golden_runs.relative_differences(b, a)
        worst = int(np.argmax(rel))
        lines.append(
            f"{name:<{width}}  differs from step {first + 1}: max relative difference {rel[worst]:.3g} (step "
            f"{worst + 1}: {a[worst]!r} at BASE, {b[worst]!r} at HEAD)"
        )
    return lines, equal


def dumps(table: dict) -> str:
    """The table as JSON, two-space indents, each list of numbers on one line."""
    text = json.dumps(table, indent=2)
    return re.sub(r"\[\s+([-+0-9.eE,\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n"


def load(path: str = TABLE) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def versions_note(table: dict) -> str:
    """The library versions that differ between the table and this process, in words ('' when none)."""
    here, there = golden_runs.versions(), table["made_with"]
    diff = [f"{k} {there.get(k)} (here {v})" for k, v in here.items() if there.get(k) != v]
    return "the table was made with " + ", ".join(diff) if diff else ""


def summary(table: dict) -> list[str]:
    """The measured spread and the tolerance, in lines (the tool prints them)."""
    s = table["spread"]
    lines = [
        f"max relative difference from the native run, per variant and config (rtol {table['tolerance']['rtol']:.3g})"
    ]
    for v, per in s["by_variant"].items():
        lines.append(f"  {v:<9} " + "  ".join(f"{c} {r:.2g}" for c, r in per.items()))
    lines.append("  per step (max over variants and configs): " + " ".join(f"{r:.2g}" for r in s["by_step"]))
    return lines
