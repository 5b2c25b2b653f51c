"""The golden losses: five layouts of a small Llama trained for 20 steps on a fixed token stream, on 8 simulated
CPU devices (tests/golden_runs.py says which), and their table, tests/fixtures/golden_losses.json.

    python tools/golden_losses.py write
    python tools/golden_losses.py run --configs default,moe --steps 5 --out runs/golden/losses.json

`write` runs every config natively, then again under each variant of XLA:CPU code generation CI uses
(--xla_cpu_max_isa=AVX2 and SSE4_2 on x86-64, and on one core with taskset), and once with a perturbed learning
rate; it writes the reference losses, the versions they were made with, the measured spread, the tolerance that
follows from it (tests/golden_table.py) and the perturbed run, and prints the spread (about 2 minutes on 2 cores).
`run` trains the configs in this process and writes {"losses", "errors", "jaxpar"} as JSON: with --root DIR it
reads DIR's configs/ and must import DIR's jaxpar (put DIR first on PYTHONPATH; tools/compare_losses.py does).
Exit status: 0, or 1 when a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import golden_runs  # noqa: E402  (tests/, put on the path above)
import golden_table  # noqa: E402


def _run(args: argparse.Namespace) -> int:
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before jax starts
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jaxpar

    root = os.path.realpath(args.root)
    where = os.path.realpath(os.path.dirname(jaxpar.__file__))
    if not where.startswith(root + os.sep):
        print(
            f"jaxpar is imported from {where}, not from --root {root}: put {root} first on PYTHONPATH", file=sys.stderr
        )
        return 1
    result: dict = {"losses": {}, "errors": {}, "jaxpar": where}
    with tempfile.TemporaryDirectory(prefix="jaxpar-golden-") as workdir:
        for name in args.configs.split(","):
            try:
                result["losses"].update(
                    golden_runs.run([name], workdir, steps=args.steps, root=root, extra=args.override)
                )
            except Exception:  # noqa: BLE001 -- the other configs still run; the error goes to the caller
                result["errors"][name] = traceback.format_exc(limit=3)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f)
    for name, error in result["errors"].items():
        print(f"{name} failed:\n{error}", file=sys.stderr)
    return 1 if result["errors"] else 0


def _losses(names, **kw) -> dict[str, list[float]]:
    """`golden_runs.run_in_subprocess`, failing on any config's error."""
    out = golden_runs.run_in_subprocess(names, **kw)
    if out["errors"]:
        raise RuntimeError("\n".join(f"{k}: {v}" for k, v in out["errors"].items()))
    return out["losses"]


def _write(args: argparse.Namespace) -> int:
    names = list(golden_runs.CONFIGS)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the native run: XLA's own choice
    try:
        print("native run", flush=True)
        reference = _losses(names, env=env)
        variants = {}
        for variant, (changes, prefix) in golden_table.variants_here().items():
            print(f"{variant} run", flush=True)
            variants[variant] = _losses(names, env={**env, **changes}, prefix=prefix)
        config, change = golden_table.PERTURBED
        print(f"perturbed run: {config} with {change}", flush=True)
        perturbed = _losses([config], env=env, extra=[change])[config]
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 1
    table = golden_table.make_table(reference, variants, perturbed)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(golden_table.dumps(table))
    print("\n".join(golden_table.summary(table)))
    print(f"perturbed run fails at steps {golden_table.bad_steps(table, config, perturbed)}; wrote {args.out}")
    return 0


def _parser(command: str) -> argparse.ArgumentParser:
    """The parser of one command (`write` or `run`)."""
    p = argparse.ArgumentParser(prog=f"golden_losses.py {command}", description=__doc__.split("\n\n")[0])
    if command == "write":
        p.add_argument(
            "--out", default=golden_table.TABLE, help="the table (default tests/fixtures/golden_losses.json)"
        )
        return p
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--configs", default=",".join(golden_runs.CONFIGS), help="comma-separated (default: all)")
    p.add_argument(
        "--steps", type=int, default=golden_runs.STEPS, help=f"steps per config (default {golden_runs.STEPS})"
    )
    p.add_argument("--root", default=golden_runs.ROOT, help="the checkout whose configs/ and jaxpar/ run")
    p.add_argument("--override", action="append", default=[], help="a key=value after each config's own")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("write", "run"):
        top = argparse.ArgumentParser(prog="golden_losses.py", description=__doc__.split("\n\n")[0])
        top.add_argument("command", choices=("write", "run"), help="write the table, or run configs")
        top.parse_args(argv[:1])  # prints usage (or help) and exits 2 (0 for --help)
        return 2
    args = _parser(argv[0]).parse_args(argv[1:])
    if argv[0] == "write":
        return _write(args)
    if args.steps < 1:
        print(f"golden_losses.py run: --steps {args.steps}: give a number >= 1", file=sys.stderr)
        return 2
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
