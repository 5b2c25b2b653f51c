"""Every benchmark measured so far, in one process, as one table of ratios (measured / formula or
jaxpar / reference); rows and their sources are described in `jaxpar.analysis.bench.report`.

    python benchmarks/all.py [--config configs/tiny.yaml] [--quick] [--json] [--devices 8] [key=value ...]

  overhead   step time and XLA cost of jaxpar's step / a hand-written NNX + optax step, one device
  memory     model-state bytes per device, compiled step / ZeRO formula, ZeRO stages 0-3 on data=D
  tensor     tensor-axis collective bytes, compiled HLO / Megatron count, sequence parallelism off and on
  pipeline   compiled temp bytes, 1F1B / GPipe, with the formula's ratio of live stage inputs as the target

`--quick` (a small model, fp32 memory only, one pipeline point, fast XLA:CPU compiles) runs in under two
minutes on 2 CPU cores; the full run (fp32 and 16p memory, pipeline p in 2, 4 and m in 4, 8, 16, optimised
compiles) about 10 minutes with a 4-layer d_model=64 model, longer with configs/tiny.yaml's own. `--json` prints the
rows as one JSON list instead.

On CPU the script simulates D = `--devices` devices (default: JAX_NUM_CPU_DEVICES, else 8), set before jax is
imported.

On GPUs. Run the same command on a machine with N GPUs (jax with CUDA installed, `pip install -e .[cuda12]`):

    python benchmarks/all.py            # or --quick

jax then uses the N GPUs (`--devices` only sets the simulated CPU count, which GPU runs ignore; set
JAX_PLATFORMS=cpu to force the simulation). What changes: D = N, so memory rows use data=N and tensor rows
tensor=2 x fsdp=N/2 (left out for odd N), pipeline rows p <= N; `precision.compute_dtype: auto` becomes
bfloat16, which halves activation and collective bytes in both measured and formula columns (ratios stay
comparable); compiles use XLA's default options; and the overhead row's step times are real GPU times, the
only number here that depends on the hardware rather than on the compiler.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--quick", action="store_true", help="small model, fewer points: < 2 minutes on 2 CPU cores")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    ap.add_argument(
        "--devices",
        type=int,
        default=None,
        help="simulated CPU devices (default: JAX_NUM_CPU_DEVICES, else 8; ignored on GPU)",
    )
    ap.add_argument("--steps", type=int, default=None, help="timed steps per round (default 5 quick, 20 full)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.n_layers=2")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.devices is not None:  # before jax is imported
        os.environ["JAX_NUM_CPU_DEVICES"] = str(args.devices)
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    from jaxpar.analysis.bench.report import format_report, run_report  # imports jax

    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else print
    rows = run_report(args.config, args.overrides, quick=args.quick, steps=args.steps, rounds=args.rounds, log=log)
    print(json.dumps(rows, indent=1) if args.json else "\n" + format_report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
