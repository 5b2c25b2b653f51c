"""Collectives of one train step read from the compiled HLO, against the Megatron analytic count, and the explicit
(shard_map) tensor parallelism against the compiler's own choice from sharding annotations.

    python benchmarks/tensor_collectives.py [CONFIG] [--steps 5 --rounds 3] [key=value ...]

CONFIG defaults to configs/tiny.yaml with mesh.tensor=2; without a `tensor.sequence_parallel=` override both
settings are measured. For each: bytes per device per step by (mesh axes, collective) from the HLO of the
jaxpar step, next to the same for a step where the compiler picks the collectives (one jit over global arrays,
parameters placed by plan.specs["params"], no shard_map, no tensor-parallel context); then the tensor-axis
bytes against the planner's count for that axis (`jaxpar.analysis.planner.comm`; ratio HLO / analytic, target
<= 1.02), and the median step time explicit / compiler-chosen measured in one interleaved run. The
compiler-chosen step is `jaxpar.analysis.bench.baselines.compiler_chosen_step` and the analytic count
`jaxpar.analysis.bench.report.tensor_analytic`;
benchmarks/all.py reports the HLO / analytic ratios with the other benchmarks.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before jax is imported: 8 simulated CPU devices

import argparse

import jax
import jax.numpy as jnp

from jaxpar.analysis.bench.baselines import compiler_chosen_step
from jaxpar.analysis.bench.report import tensor_analytic, tensor_axis_bytes
from jaxpar.analysis.bench.timing import interleaved_step_times, median_seconds, round_medians
from jaxpar.analysis.hlo.collectives import collectives_by_axis, format_axis_table
from jaxpar.config import load_config
from jaxpar.data.batch import random_batch
from jaxpar.parallel.mesh import build_mesh, describe
from jaxpar.training.plan import build_plan
from jaxpar.training.state import abstract_state, init_state
from jaxpar.training.step import make_train_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default="configs/tiny.yaml")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides (default adds mesh.tensor=2)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round and contender")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    overrides = args.overrides or ["mesh.tensor=2"]
    sp_settings = [None] if any(o.startswith("tensor.sequence_parallel=") for o in overrides) else [False, True]

    compiler = None
    for sp in sp_settings:
        extra = [] if sp is None else [f"tensor.sequence_parallel={str(sp).lower()}"]
        cfg = load_config(args.config, overrides + extra, num_devices=jax.device_count())
        plan = build_plan(cfg, build_mesh(cfg))
        batch = random_batch(cfg.train.global_batch_size, cfg.data.seq_len, cfg.model.vocab_size, plan.batch_sharding)
        explicit = make_train_step(plan).lower(abstract_state(plan), batch).compile()
        if compiler is None:  # independent of sequence parallelism: compile and keep once
            compiler = compiler_chosen_step(plan).lower(abstract_state(plan), batch).compile()
        tables = {
            "explicit": collectives_by_axis(explicit.as_text(), plan.mesh),
            "compiler": collectives_by_axis(compiler.as_text(), plan.mesh),
        }
        print(
            f"\n=== {describe(plan.mesh)}  sequence_parallel={plan.tensor_parallel.sequence_parallel}  "
            f"remat={cfg.model.remat}  compute={jnp.dtype(plan.compute_dtype).name}"
        )
        print("Per step, bytes sent per device (ring formulas, jaxpar.analysis.hlo.ring.ring_bytes):")
        print(format_axis_table(tables))

        terms, want = tensor_analytic(plan)
        print("\nTensor axis, HLO (explicit step) vs Megatron analytic:")
        for t in terms:
            print(f"  analytic term {t.name:<34}{t.kind:<16}x{t.count:<4} S={t.size_bytes:,.0f} B")
        got = tensor_axis_bytes(tables["explicit"])
        for kind in sorted(set(want) | set(got)):
            g, w = got.get(kind, 0.0), want.get(kind, 0.0)
            ratio = f"{g / w:.4f}" if w else "n/a"
            print(f"  {kind:<16} HLO {g:>12,.0f}  analytic {w:>12,.0f}  ratio {ratio}")
        total_g, total_w = sum(got.values()), sum(want.values())
        if total_w:
            print(
                f"  {'total':<16} HLO {total_g:>12,.0f}  analytic {total_w:>12,.0f}  ratio {total_g / total_w:.4f}"
                f"  (target <= 1.02)"
            )

        state = {"explicit": init_state(plan, 0), "compiler": init_state(plan, 0)}
        programs = {"explicit": explicit, "compiler": compiler}

        def runner(name, state=state, programs=programs, batch=batch):
            def run():  # one step; keeps the (donated) state between calls
                state[name], metrics = programs[name](state[name], batch)
                return metrics

            return run

        times = interleaved_step_times({n: runner(n) for n in programs}, args.steps, args.rounds)
        med = {n: median_seconds(r) for n, r in times.items()}
        for n, r in times.items():
            print(
                f"  {n:<9} median step {med[n] * 1e3:8.2f} ms  (round medians "
                f"{', '.join(f'{x * 1e3:.2f}' for x in round_medians(r))} ms)"
            )
        print(f"  step time explicit / compiler-chosen: {med['explicit'] / med['compiler']:.3f}")


if __name__ == "__main__":
    main()
