"""jaxpar's train step against a minimal hand-written Flax NNX + optax step on one device, then the ZeRO
memory table (measured vs formula) for ZeRO stages 0-3 on data=8.

    python benchmarks/overhead.py --config configs/tiny.yaml --steps 20 --rounds 3 [key=value ...]

Prints the median per-step time of each, the ratio jaxpar / reference (target <= 1.03), and the tables.
The measurements live in `jaxpar.analysis.bench.report` (`measure_overhead`, `zero_memory_tables`) and the reference
step in `jaxpar.analysis.bench.baselines`; benchmarks/all.py reports them with the other benchmarks.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before jax is imported: 8 simulated CPU devices

import argparse
import statistics

import jax

from jaxpar.analysis.bench.report import ONE_DEVICE, measure_overhead, zero_memory_tables
from jaxpar.analysis.bench.timing import median_seconds, round_medians
from jaxpar.analysis.planner.memory import format_memory_table
from jaxpar.config import load_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round and contender")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.n_layers=2")
    args = ap.parse_args()

    cfg = load_config(args.config, args.overrides + ONE_DEVICE, num_devices=1)
    result = measure_overhead(cfg, args.steps, args.rounds)
    print(
        f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}); model {cfg.model.n_layers} layers, "
        f"d_model {cfg.model.d_model}, batch {cfg.train.global_batch_size} x {cfg.data.seq_len} tokens, "
        f"layout {cfg.precision.layout}, compute {result['compute_dtype']}"
    )
    jc, rc = result["cost"]["jaxpar"], result["cost"]["reference"]
    print(
        f"XLA cost estimate jaxpar/reference: FLOPs {jc['flops'] / rc['flops']:.4f}, "
        f"bytes accessed {jc['bytes_accessed'] / rc['bytes_accessed']:.4f}"
    )
    first = result["first_loss"]
    print(f"first-step loss: jaxpar {first['jaxpar']:.6f}  reference {first['reference']:.6f}")
    times = result["times"]
    med = {name: median_seconds(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"  {name:<9} per-round medians (ms): " + " ".join(f"{m * 1e3:.2f}" for m in round_medians(t)))
    ratio = med["jaxpar"] / med["reference"]
    paired = statistics.median(j / r for j, r in zip(round_medians(times["jaxpar"]), round_medians(times["reference"])))
    print(
        f"median step ({args.rounds} rounds x {args.steps} steps): jaxpar {med['jaxpar'] * 1e3:.2f} ms, "
        f"reference {med['reference'] * 1e3:.2f} ms"
    )
    print(
        f"ratio jaxpar/reference: {ratio:.3f} (of medians), {paired:.3f} (median of per-round ratios; "
        "robust to load drift with many short rounds); target <= 1.03"
    )

    if len(jax.devices()) < 8:
        print(f"memory table skipped: needs 8 devices, have {len(jax.devices())}")
        return
    for table in zero_memory_tables(args.config, args.overrides, data=8).values():
        print()
        print(format_memory_table(table))


if __name__ == "__main__":
    main()
