"""The README's main job under several XLA CPU instruction sets: each run's final validation loss and its ratio to
the unigram entropy, and their range (the figures README.md states).

    .venv/bin/python tools/loss_range.py [--isa native AVX2 SSE4_2] [--config configs/tiny.yaml] [key=value ...]

Runs `jaxpar-train CONFIG --cpu-devices 8` once per instruction set, each in a fresh temporary run directory, with
XLA_FLAGS=--xla_cpu_max_isa=ISA (`native`: the machine's own, XLA_FLAGS unset). Another CPU rounds fp32
differently (vector width, fused multiply-adds) and 200 steps amplify it, so the README states a range rather than
one loss. A run of the default config takes a few minutes on 2 cores. Exits 1 if a run fails or prints no final
loss.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# jaxpar-train's last evaluation line (jaxpar.training.hooks.evaluation.EvalHook.on_end)
FINAL = re.compile(r"final val_loss (\d+\.\d+) nats/token.* vs their unigram entropy (\d+\.\d+) \(ratio (\d+\.\d+)\)")


def run_one(isa: str, config: str, overrides: list[str]) -> tuple[float, float, float]:
    """(final val_loss nats/token, unigram entropy, ratio) of one training run under `isa`.

    Raises:
      RuntimeError: the run failed or printed no final val_loss line (its output's tail in the message).
    """
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    if isa != "native":
        env["XLA_FLAGS"] = f"--xla_cpu_max_isa={isa}"
    with tempfile.TemporaryDirectory(prefix="jaxpar-loss-range-") as run_dir:
        cmd = [sys.executable, "-m", "jaxpar.cli.train", config, "--cpu-devices", "8", f"train.run_dir={run_dir}"]
        proc = subprocess.run(
            [*cmd, "train.progress_bar=false", *overrides], capture_output=True, text=True, env=env, check=False
        )
    out = proc.stdout + proc.stderr
    found = FINAL.search(out)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"{isa}: jaxpar-train exited {proc.returncode}, no final val_loss:\n{out[-2000:]}")
    loss, entropy, ratio = (float(g) for g in found.groups())
    return loss, entropy, ratio


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", nargs="+", default=["native", "AVX2", "SSE4_2"], help="instruction sets (XLA's names)")
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny.yaml"))
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = ap.parse_args(argv)
    results = {}
    for isa in args.isa:
        try:
            results[isa] = run_one(isa, args.config, args.overrides)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        loss, entropy, ratio = results[isa]
        print(f"{isa:<8} final val_loss {loss:.4f} nats/token, unigram entropy {entropy:.4f}, ratio {ratio:.3f}")
    losses = [r[0] for r in results.values()]
    ratios = [r[2] for r in results.values()]
    print(
        f"range: val_loss {min(losses):.4f} to {max(losses):.4f}, ratio {min(ratios):.3f} to {max(ratios):.3f} "
        f"({len(results)} instruction sets)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
