"""Pipeline schedules (1F1B keeping residuals, 1F1B recomputing the stage forward, interleaved 1F1B, the zero-bubble
ZB-H1 and ZB-V, GPipe) against data parallelism on the same devices: compiled temp memory, activations in flight,
clock ticks, bubble, matmul FLOPs and step time.

    python benchmarks/pipeline.py [--config configs/tiny.yaml] [--stages 2 4] [--microbatches 4 8 16 32]
        [--steps 5] [--rounds 3] [--micro-rows 2] [--optimized] [key=value ...]

For each p (stages) and m (microbatches) the microbatch size is fixed (global batch = m * micro_rows), and
four train steps run on the same p simulated CPU devices, interleaved and timed in one run:
  * 1F1B (pipeline.recompute=false, "1f1b"; true, "1f1b-rc"), interleaved 1F1B (pipeline.virtual_stages=2,
    "1f1b-v2"; skipped where the layers or m do not divide), 1F1B with the stages' layers balanced by FLOPs
    (pipeline.balance_stages=true, "1f1b-bal", its split named in the row), 1F1B with the head split over the
    stages by vocabulary (pipeline.vocab_parallel=true, "1f1b-vp"), zb-h1, zb-v (2 chunks per device) and
    GPipe on mesh pipeline=p (data=fsdp=tensor=1), pipeline.microbatches=m (`--schedules` picks some);
  * the baseline, pure data parallelism on mesh data=p (pipeline=1), one microbatch per device
    (pipeline.microbatches=1), ZeRO-0 unless overridden.
"meas t/dp" is the median step time over the baseline's; "ideal t/dp" the compute-bound prediction of
`jaxpar.analysis.planner.pipeline.ideal_time_ratio`. "FLOPs/dp" is the matmul FLOPs per device (mean over the
devices) of the compiled step over the baseline's, counted with loop trip counts and each device's own branch of
the stage conds (`jaxpar.analysis.hlo.flops`; for 1f1b-v2 the blocks' FLOPs plus the heads' formula, since its
conds select on the tick too; for zb-h1 and zb-v the slot switch's branches weighted by the table's counts of
F, B, W and idle slots per device; for an uneven split its skip conds weighted by the device's share of rows
holding a layer), next to 1/(1 - bubble), the tick ratio; "max FLOPs/dp" the busiest device's, which sets a
lockstep pipeline's pace on a compute-bound accelerator, next to "max/mean formula", the busiest device's FLOPs
over the mean device's by PaLM's counts (`jaxpar.analysis.bench.report.busiest_device_formula`); "1-dp/FLOPs"
and "1-dp/t" are the measured bubbles, next to the formula (p - 1)/(vm + p - 1), or the table's idle share for
zb-h1 and zb-v (`jaxpar.parallel.zero_bubble`). Row formulas live in
`jaxpar.analysis.planner.pipeline`; the model (`PIPELINE_MODEL`) and mesh overrides in
`jaxpar.analysis.bench.report`, which benchmarks/all.py also uses for its 1F1B / GPipe memory rows; the
fast XLA:CPU compile options (`FAST_COMPILER_OPTIONS`: temp bytes within a few percent of an optimised build, step
times about 2x for every contender alike) in `jaxpar.analysis.hlo.compile_options`.

Llama-3-8B's shape (32 layers, vocabulary 128,256, 4096 tokens per row), compiled without running (no step times),
its even split against the balanced one:

    python benchmarks/pipeline.py --config configs/llama3_8b.yaml --model-from-config --compile-only --stages 4
        --microbatches 32 --micro-rows 1 --schedules 1f1b 1f1b-bal 1f1b-vp

A model with a 32,000-token vocabulary (d_model 256, 4 layers, 8 microbatches of 2 x 128 tokens on 2 devices),
where the head outweighs the layers:

    python benchmarks/pipeline.py --stages 2 --microbatches 8 --steps 3 model.vocab_size=32000
        model.d_model=256 model.d_ff=768 data.seq_len=128
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before jax is imported: 8 simulated CPU devices

import argparse
import time

import jax
import jax.numpy as jnp

from jaxpar.analysis.bench.report import (
    PIPELINE_MODEL,
    busiest_device_formula,
    pipeline_branch_weights,
    pipeline_overrides,
)
from jaxpar.analysis.bench.timing import interleaved_step_times, median_seconds
from jaxpar.analysis.hlo.compile_options import FAST_COMPILER_OPTIONS
from jaxpar.analysis.hlo.flops import dot_flops_per_device
from jaxpar.analysis.planner.pipeline import ZERO_BUBBLE, format_table, report_row
from jaxpar.config import ConfigError, load_config
from jaxpar.data.batch import BATCH_KEYS, abstract_batch, random_batch
from jaxpar.log import human_bytes
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.pipelined import stage_layout
from jaxpar.training.plan import build_plan
from jaxpar.training.state import abstract_state, init_state
from jaxpar.training.step import make_train_step

# -rc: pipeline.recompute=true; -v2: pipeline.virtual_stages=2 (zb-v always runs 2 chunks per device); -bal:
# pipeline.balance_stages=true (the whole-layer split that balances the stages' FLOPs, `jaxpar.parallel.layer_split`);
# -vp: pipeline.vocab_parallel=true (the head split over the stages by vocabulary)
SCHEDULES = ("1f1b", "1f1b-rc", "1f1b-v2", "1f1b-bal", "1f1b-vp", "zb-h1", "zb-v", "gpipe")


class Contender:
    """One compiled train step with its own state (the step donates it) and batch on its mesh.

    `states` caches one initial state per state sharding, so each mesh's init compiles once; every contender
    runs on its own copy."""

    def __init__(self, cfg, devices, batch: dict | None, compiler_options: dict, states: dict, rows: int = 0):
        self.plan = build_plan(cfg, build_mesh(cfg, devices))
        if batch is None:  # compile only: nothing allocated, nothing run
            self.batch = abstract_batch(cfg.train.global_batch_size, cfg.data.seq_len, self.plan.batch_sharding)
            self.state = abstract_state(self.plan)
        else:
            self.batch = {k: jax.device_put(batch[k], self.plan.batch_sharding) for k in BATCH_KEYS}
            key = (len(devices), cfg.mesh.pipeline)
            if key not in states:
                states[key] = init_state(self.plan, cfg.train.seed)
            self.state = jax.tree.map(lambda x: x.copy(), states[key])
        t0 = time.perf_counter()
        self.step = make_train_step(self.plan).lower(self.state, self.batch).compile(compiler_options=compiler_options)
        self.compile_s = time.perf_counter() - t0
        self.temp_bytes = int(self.step.memory_analysis().temp_size_in_bytes)
        pipe = cfg.pipeline
        if cfg.mesh.pipeline > 1 and (pipe.schedule in ZERO_BUBBLE or pipe.stage_layers or pipe.balance_stages):
            # The slot switch selects on the slot too, and an uneven split's skip conds on the row: their branches
            # weighted by the table's counts per device and by the device's share of rows holding a layer.
            per_device = dot_flops_per_device(self.step.as_text(), branch_weights=pipeline_branch_weights(self.plan))
            self.flops, self.busiest = sum(per_device) / len(devices), max(per_device)
        elif pipe.virtual_stages == 1:
            per_device = dot_flops_per_device(self.step.as_text())
            self.flops, self.busiest = sum(per_device) / len(devices), max(per_device)  # mean and busiest
        else:
            # The edge conds select on the tick too, which the FLOPs reader cannot evaluate: the blocks' FLOPs
            # without the conds, plus the m heads' 6 b T D V each (jaxpar.analysis.bench.report does the same).
            mdl, m = cfg.model, cfg.pipeline.microbatches
            heads = m * 6 * rows * cfg.data.seq_len * mdl.d_model * mdl.vocab_size
            blocks = dot_flops_per_device(self.step.as_text(), skip_conditionals=True)
            self.flops = (sum(blocks) + heads) / len(devices)
            self.busiest = max(blocks) + heads  # the heads all run on the last stage

    def __call__(self):
        self.state, metrics = self.step(self.state, self.batch)
        return metrics["loss"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round and contender")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--micro-rows", type=int, default=2, help="rows (sequences) per microbatch, b")
    ap.add_argument("--optimized", action="store_true", help="compile with XLA's default options (slower)")
    ap.add_argument(
        "--model-from-config",
        action="store_true",
        help="keep the config's model and sequence length (default: the small PIPELINE_MODEL over it)",
    )
    ap.add_argument(
        "--compile-only",
        action="store_true",
        help="compile and count FLOPs and temp bytes without running (no step times): for shapes too large to run",
    )
    ap.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES), help="contenders to run")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.n_layers=8")
    args = ap.parse_args()

    rows, all_rows, states = args.micro_rows, [], {}
    options = {} if args.optimized else FAST_COMPILER_OPTIONS
    t_start = time.perf_counter()
    for p in args.stages:
        devices = jax.devices()[:p]
        for m in args.microbatches:

            def load(pipelined: bool, sched: str = "1f1b", p=p, m=m):
                flags = [
                    f"pipeline.recompute={str(sched == '1f1b-rc').lower()}",
                    f"pipeline.virtual_stages={2 if sched in ('1f1b-v2', 'zb-v') else 1}",
                    f"pipeline.balance_stages={str(sched.endswith('-bal')).lower()}",
                    f"pipeline.vocab_parallel={str(sched.endswith('-vp')).lower()}",
                ]
                base = sched if sched in ZERO_BUBBLE else sched.split("-")[0]
                overrides = pipeline_overrides(p, pipelined, base, m, rows) + flags
                model = [] if args.model_from_config else PIPELINE_MODEL
                return load_config(args.config, model + args.overrides + overrides, num_devices=p)

            cfg = load(False)
            batch = None
            if not args.compile_only:
                batch = random_batch(m * rows, cfg.data.seq_len, cfg.model.vocab_size, devices[0], cfg.train.seed)
            contenders = {"dp": Contender(cfg, devices, batch, options, states)}
            for sched in args.schedules:
                try:
                    sched_cfg = load(True, sched)
                except ConfigError as e:  # interleaving needs n_layers % 2p == 0 and m % p == 0
                    print(f"p={p} m={m}: {sched} skipped: {e}", flush=True)
                    continue
                contenders[sched] = Contender(sched_cfg, devices, batch, options, states, rows)
            losses, med = {}, {}
            if not args.compile_only:
                losses = {name: float(c()) for name, c in contenders.items()}  # first step: same loss expected
                times = interleaved_step_times(contenders, args.steps, args.rounds)
                med = {name: median_seconds(t) for name, t in times.items()}
            plan = contenders["dp"].plan
            for sched in (s for s in args.schedules if s in contenders):
                row = report_row(
                    sched if sched in ZERO_BUBBLE else sched.split("-")[0],
                    p,
                    m,
                    rows,
                    cfg.data.seq_len,
                    cfg.model.d_model,
                    jnp.dtype(plan.compute_dtype).itemsize,
                    recompute=sched == "1f1b-rc",
                    v=2 if sched in ("1f1b-v2", "zb-v") else 1,
                )
                row.update(
                    temp_bytes=contenders[sched].temp_bytes,
                    time_ratio=med[sched] / med["dp"] if med else None,
                    flops_ratio=contenders[sched].flops / contenders["dp"].flops,
                    busiest_ratio=contenders[sched].busiest / contenders["dp"].flops,
                    busiest_formula=busiest_device_formula(contenders[sched].plan),
                )
                if sched.endswith("-vp"):
                    row["schedule"] += " vocab"
                if sched.endswith("-bal"):
                    layout = stage_layout(contenders[sched].plan)
                    split = layout.counts if layout else "even"
                    row["schedule"] += f" {split}"
                all_rows.append(row)
            print(
                f"p={p} m={m}: median step ms "
                + ", ".join(f"{n} {t * 1e3:.2f}" for n, t in med.items())
                + f"; dp temp {human_bytes(contenders['dp'].temp_bytes)}; "
                f"compile s "
                + " ".join(f"{n} {c.compile_s:.1f}" for n, c in contenders.items())
                + "; first-step loss "
                + " ".join(f"{n} {v:.6f}" for n, v in losses.items()),
                flush=True,
            )

    print(
        f"\nmodel {cfg.model.n_layers} layers, d_model {cfg.model.d_model}, seq {cfg.data.seq_len}, "
        f"b = {rows} rows per microbatch, compute {jnp.dtype(plan.compute_dtype).name}, "
        f"{jax.devices()[0].device_kind} ({jax.default_backend()}); {args.rounds} rounds x {args.steps} steps; "
        f"baseline dp = mesh data=p, same global batch m*b; "
        f"{'optimised' if args.optimized else 'fast (unoptimised) XLA:CPU'} compile; "
        f"total {time.perf_counter() - t_start:.0f} s"
    )
    print(
        "temp bytes: memory_analysis().temp_size_in_bytes of the compiled step (per device); live/alloc: "
        "microbatches whose stage inputs (1f1b-rc) or residuals (1f1b, gpipe) are kept for the backward on stage "
        "0 (live at once / buffers reserved), live bytes counting stage inputs only; ticks (half): clock ticks run "
        "(of which forward-only or backward-only); FLOPs/dp: matmul FLOPs per device over data parallelism's"
    )
    print(format_table(all_rows))


if __name__ == "__main__":
    main()
