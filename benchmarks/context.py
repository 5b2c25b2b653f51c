"""Context parallelism on simulated CPU devices: step time, temporary memory and attention FLOPs per device for
mesh.context = 1, 2, 4 at the same global tokens per step, for both strategies, next to the planner's formulas.

    python benchmarks/context.py [--config configs/tiny.yaml] [--devices 4] [--contexts 1 2 4] [--seq-len 2048]
        [--steps 3] [--rounds 3] [--optimized] [key=value ...]

On `--devices` n devices and a global batch of n sequences of `--seq-len` tokens, each contender's mesh is
data = n / c x context = c: c = 1 is data parallelism (each device one whole sequence), c > 1 splits each sequence
over c devices (each device n / (n/c) = c rows of T/c tokens: the same tokens per device). Contenders: c = 1 and,
for each c > 1, context.strategy all_gather (XLA's attention with an explicit mask on CPU) and ring. The model is
small (`CONTEXT_MODEL`: 2 layers, width 128, 4 heads, 2 key/value heads) so that attention, quadratic in T, is
what grows.

Columns: "t/c1" the median step time over c = 1's; "temp" XLA's compiled temporaries per device beside "planned
temp" (`jaxpar.analysis.planner.plan`, for cpu); "attn FLOPs/c1": the compiled program's matmul FLOPs per device
(`jaxpar.analysis.hlo.flops`, the ring's sub-block conds weighted by whether the device computes them,
`jaxpar.analysis.bench.context_balance`) over c = 1's, beside "max/mean", the busiest device's over the mean
device's. XLA:CPU's simulated devices share the machine's cores, so step times measure the work, not the
overlap of communication a GPU would give.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before jax is imported: 8 simulated CPU devices

import argparse
import time

import jax
import numpy as np

from jaxpar.analysis.bench.context_balance import ring_blocks, ring_branch_weights
from jaxpar.analysis.bench.timing import interleaved_step_times, median_seconds
from jaxpar.analysis.hlo.compile_options import FAST_COMPILER_OPTIONS
from jaxpar.analysis.hlo.flops import dot_flops_per_device
from jaxpar.analysis.planner.plan import plan as analytic_plan
from jaxpar.config import load_config
from jaxpar.config.mesh_axes import CONTEXT
from jaxpar.config.validate import resolve_config
from jaxpar.data.batch import BATCH_KEYS, random_batch
from jaxpar.log import human_bytes
from jaxpar.parallel.context import balanced_order
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.plan import build_plan
from jaxpar.training.state import init_state
from jaxpar.training.step import make_train_step

CONTEXT_MODEL = [
    "model.n_layers=2",
    "model.d_model=128",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=256",
    "model.remat=none",
    "precision.compute_dtype=float32",
    "precision.layout=fp32",
    "optimizer.zero_stage=0",
]


class Contender:
    """One compiled train step on its mesh with its own state (the step donates it)."""

    def __init__(self, cfg, devices, host_batch: dict, options: dict):
        self.cfg = cfg
        self.plan = build_plan(cfg, build_mesh(cfg, devices))
        self.batch = {k: jax.device_put(host_batch[k], self.plan.batch_sharding) for k in BATCH_KEYS}
        self.state = init_state(self.plan, cfg.train.seed)
        t0 = time.perf_counter()
        self.step = make_train_step(self.plan).lower(self.state, self.batch).compile(compiler_options=options)
        self.compile_s = time.perf_counter() - t0
        self.temp_bytes = int(self.step.memory_analysis().temp_size_in_bytes)
        c = cfg.mesh.context
        weights = None
        if c > 1 and cfg.context.strategy == "ring":
            axis = list(self.plan.mesh.axis_names).index(CONTEXT)
            ranks = [int(np.unravel_index(pid, self.plan.mesh.devices.shape)[axis]) for pid in range(len(devices))]
            weights = ring_branch_weights(ring_blocks(balanced_order(cfg.data.seq_len, c), c), ranks)
        self.flops = np.asarray(dot_flops_per_device(self.step.as_text(), branch_weights=weights))
        self.planned_temp = analytic_plan(cfg, "cpu")["memory"]["temp_estimate"]["total"]

    def __call__(self):
        self.state, metrics = self.step(self.state, self.batch)
        return metrics["loss"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round and contender")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--optimized", action="store_true", help="compile with XLA's default options (slower)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = ap.parse_args()

    n, t = args.devices, args.seq_len
    devices = jax.devices()[:n]
    options = {} if args.optimized else FAST_COMPILER_OPTIONS
    t_start = time.perf_counter()
    contenders: dict[str, Contender] = {}
    host = None
    for c in args.contexts:
        for strategy in ("all_gather",) if c == 1 else ("all_gather", "ring"):
            mesh = [f"mesh.data={n // c}", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipeline=1", f"mesh.context={c}"]
            extra = [*mesh, f"context.strategy={strategy}", f"data.seq_len={t}", f"train.global_batch_size={n}"]
            cfg = resolve_config(load_config(args.config, [*CONTEXT_MODEL, *args.overrides, *extra], validate=False), n)
            if host is None:
                host = random_batch(n, t, cfg.model.vocab_size, jax.devices()[0], cfg.train.seed)
            name = "c1" if c == 1 else f"c{c}-{strategy}"
            contenders[name] = Contender(cfg, devices, host, options)
            print(f"{name}: compiled in {contenders[name].compile_s:.1f} s", flush=True)
    losses = {name: float(c()) for name, c in contenders.items()}
    times = interleaved_step_times(contenders, args.steps, args.rounds)
    med = {name: median_seconds(ts) for name, ts in times.items()}
    base = contenders["c1"]
    print(
        f"\n{n} devices, {n} sequences of {t} tokens per step ({n * t:,} tokens), model {' '.join(CONTEXT_MODEL[:5])}; "
        f"{args.rounds} rounds x {args.steps} steps, {'optimised' if args.optimized else 'fast'} compile; "
        f"first-step losses {min(losses.values()):.5f}..{max(losses.values()):.5f}\n"
    )
    print("| contender | step s | t/c1 | temp | planned temp | temp/planned | FLOPs/c1 | max/mean FLOPs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, con in contenders.items():
        print(
            f"| {name} | {med[name]:.3f} | {med[name] / med['c1']:.2f} | {human_bytes(con.temp_bytes)} | "
            f"{human_bytes(con.planned_temp)} | {con.temp_bytes / con.planned_temp:.2f} | "
            f"{con.flops.mean() / base.flops.mean():.3f} | {con.flops.max() / con.flops.mean():.3f} |"
        )
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
