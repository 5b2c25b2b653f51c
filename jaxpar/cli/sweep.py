"""`jaxpar-sweep SWEEP.yaml [--out DIR]`: plan, compile and optionally time every point of a mesh sweep.

Examples:
  jaxpar-sweep configs/sweeps/llama_7b_64.yaml                 # analytic: 7B on 64 GPUs, no devices needed
  jaxpar-sweep configs/sweeps/tiny_two_meshes.yaml --out runs/sweeps/two   # compiles and times 2 meshes
  jaxpar-sweep configs/sweeps/tiny_mesh_8.yaml --list          # print the points (every factorisation of 8)
  jaxpar-sweep configs/sweeps/llama_7b_h100_64.yaml --list     # 7B compiled for 8 nodes x 8 H100s (target:)

Writes DIR/results.json (rewritten after every point), DIR/results.md (a table ranked by the sweep's objective)
and DIR/plot.png (with matplotlib, the `plot` extra: pip install 'jaxpar[plot]'; without it the sweep says so and
skips the plot). Run it again to resume: finished points are skipped. The sweep file format is documented in
jaxpar/analysis/sweep/run.py. A sweep file with `target: KIND:NODESxGPUS` and `compile: true` compiles every
point for that GPU cluster without its GPUs, which needs jax's CUDA plugin (pip install 'jaxpar[gpu-compile]');
without it the sweep stops before the first point. Exit status: 0 done (some point valid: ok or over budget), 1
no point ran and some failed, 2 bad sweep file (the message names the key and the fix), no CUDA plugin for a
target, or every point refused by config validation, 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys

PROG = "jaxpar-sweep"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", help="sweep YAML file, e.g. configs/sweeps/tiny_mesh_8.yaml")
    p.add_argument("--out", default=None, help="output directory (default runs/sweeps/<sweep file name>)")
    p.add_argument("--list", action="store_true", help="print the points and exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    from jaxpar.analysis.gpu.deviceless import GpuCompileUnavailable
    from jaxpar.analysis.sweep.run import SweepError, load_sweep, points, run_sweep
    from jaxpar.config.extras import installed

    try:
        sweep = load_sweep(args.sweep)
        if args.list:
            for point in points(sweep):
                print(point["key"])
            return 0
        out = args.out or os.path.join("runs", "sweeps", os.path.splitext(os.path.basename(args.sweep))[0])
        records = run_sweep(sweep, out)
    except SweepError as e:
        print(f"{PROG}: sweep error: {e}", file=sys.stderr)
        return 2
    except GpuCompileUnavailable as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"{PROG}: interrupted; finished points are in results.json and are skipped when run again", file=sys.stderr
        )
        return 130
    counts: dict = {}
    for r in records:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(
        f"{PROG}: {len(records)} points ({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}); "
        f"results in {out}/results.json, results.md{', plot.png' if installed('matplotlib') else ''}"
    )
    return _none_ran(counts)


def _none_ran(counts: dict[str, int]) -> int:
    """The exit status from the points' status counts: 0 when some point is valid (ok, or over budget: planned,
    not run); else, with a line saying none ran, 2 when every point was refused as an invalid config, 1 when
    some failed."""
    if not counts or counts.get("ok", 0) + counts.get("over_budget", 0):
        return 0
    invalid, failed = counts.get("invalid", 0), counts.get("failed", 0)
    print(
        f"{PROG}: none of the {invalid + failed} points ran: {invalid} refused as invalid configs, {failed} failed; "
        f"each point's error is in results.md (fix the sweep's base, overrides or meshes)",
        file=sys.stderr,
    )
    return 2 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
