"""Where a test run's time went, per test file: wall seconds, the part spent compiling, and each default-suite
file against its budget.

    python tools/test_times.py runs/ci/default.xml [--times runs/ci/times] [--budget 60]

Reads a pytest `--junitxml` report (each test's setup + call + teardown seconds in its worker) and, with
--times, the compile seconds that tests/conftest.py records when JAXPAR_TEST_TIMES=DIR is set (jax's tracing,
lowering and XLA compile in the test's own process; compiles in subprocesses count as run time). Prints one row
per file, largest first, and the files over the budget.

The budget is per file of the default suite: 60 worker-seconds on a 2-core machine with jax's persistent
compilation cache off. It is printed, not asserted in a test: a test's wall time varies by 20-30% with the
machine's load, so a timed assertion would fail on a slow or busy machine while nothing is wrong. CI prints this
table after the default suite (.ci/run) so a file that grows past its budget shows in every CI log.
Exits 0 always.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import xml.etree.ElementTree as ET

BUDGET_S = 60.0


def file_of(classname: str) -> str:
    """tests.unit.test_x[.Class] -> tests/unit/test_x.py"""
    parts = classname.split(".")
    for i, part in enumerate(parts):
        if part.startswith("test_"):
            return "/".join(parts[: i + 1]) + ".py"
    return classname


def load(junit: list[str], times_dir: str | None) -> dict[str, dict[str, float]]:
    """{file: {"tests", "wall", "compile"}} (seconds) from junit reports and the conftest's compile records."""
    rows: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"tests": 0, "wall": 0.0, "compile": 0.0})
    for path in junit:
        for case in ET.parse(path).getroot().iter("testcase"):
            row = rows[file_of(case.get("classname", ""))]
            row["tests"] += 1
            row["wall"] += float(case.get("time", 0.0))
    if times_dir:
        for path in glob.glob(os.path.join(times_dir, "*.json")):
            with open(path, encoding="utf-8") as f:
                for nodeid, t in json.load(f).items():
                    rows[nodeid.split("::", 1)[0]]["compile"] += t["compile"]
    return dict(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", nargs="+", help="pytest --junitxml reports")
    parser.add_argument("--times", help="the JAXPAR_TEST_TIMES directory of the same run")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds per file (default 60)")
    args = parser.parse_args(argv)
    rows = load(args.junit, args.times)
    total = {k: sum(r[k] for r in rows.values()) for k in ("tests", "wall", "compile")}
    print(f"{'file':58s} {'tests':>5s} {'wall s':>8s} {'compile s':>9s} {'run s':>7s}  budget {args.budget:g} s")
    for name, r in sorted(rows.items(), key=lambda kv: -kv[1]["wall"]):
        flag = "OVER" if r["wall"] > args.budget else ""
        compile_s = f"{r['compile']:9.1f}" if args.times else f"{'-':>9s}"
        run_s = f"{r['wall'] - r['compile']:7.1f}" if args.times else f"{'-':>7s}"
        print(f"{name:58s} {r['tests']:5.0f} {r['wall']:8.1f} {compile_s} {run_s}  {flag}")
    share = ""
    if args.times and total["wall"]:
        share = f", {100 * total['compile'] / total['wall']:.0f}% compiling in-process"
    print(f"{'total (worker-seconds)':58s} {total['tests']:5.0f} {total['wall']:8.1f}{share}")
    over = [n for n, r in rows.items() if r["wall"] > args.budget]
    print(f"{len(over)} file(s) over the {args.budget:g} s budget" + (f": {', '.join(sorted(over))}" if over else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
