"""The measurements behind benchmarks/all.py, each reduced to rows of one ratio table.

Every row is a dict {"group", "case", "metric", "measured", "reference", "ratio" (measured / reference),
"unit" ("s", "FLOPs", "bytes", "fraction"), "target"}: measured against an analytic formula or against a baseline, both
taken in the same run.

  overhead     jaxpar's train step / a hand-written NNX + optax step on one device (`jaxpar.analysis.bench.baselines`):
               median step time (target <= 1.03) and XLA's cost estimate (FLOPs, bytes accessed).
  memory       model-state bytes per device that XLA's buffer assignment gives the compiled step, over the
               ZeRO formula (`jaxpar.analysis.planner.memory`; Rajbhandari et al. 2019, section 3), per ZeRO stage on
               data=D.
  tensor       bytes per device per step of the collectives over the `tensor` axis in the compiled HLO
               (`jaxpar.analysis.hlo.collectives`), over the planner's Megatron count for that axis
               (`jaxpar.analysis.planner.comm`), with sequence parallelism off and on.
  pipeline     compiled temp bytes of the 1F1B step over the GPipe step on p devices; the target column gives
               the formula's ratio of stage inputs live on the worst stage (`jaxpar.analysis.planner.pipeline`), which
               the temp bytes approach as activations dominate (GPipe also keeps per-tick layer residuals);
               and per schedule (1F1B keeping residuals, 1F1B recomputing, GPipe) against data parallelism on
               the same p = 2 devices: matmul FLOPs per device over the tick ratio (m + p - 1)/m, step time,
               and the bubbles 1 - 1/ratio over (p - 1)/(m + p - 1) (`pipeline_schedule_rows`).

Memory, tensor and pipeline rows compile ahead of time on abstract states and never run a step.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.analysis.bench.baselines import reference_step
from jaxpar.analysis.bench.timing import (
    compiled_cost,
    interleaved_step_times,
    median_seconds,
    round_medians,
)
from jaxpar.analysis.hlo.collectives import collectives_by_axis
from jaxpar.analysis.hlo.compile_options import FAST_COMPILER_OPTIONS
from jaxpar.analysis.hlo.flops import BranchWeights, dot_flops_per_device
from jaxpar.analysis.hlo.text import compiled_hlo_text
from jaxpar.analysis.planner.comm import collective_terms
from jaxpar.analysis.planner.memory import memory_table
from jaxpar.analysis.planner.pipeline import ZERO_BUBBLE, schedule_bubble, stage_inputs_in_flight
from jaxpar.config import Config, load_config, resolve_config
from jaxpar.config.mesh_axes import DATA, FSDP, PIPELINE, TENSOR
from jaxpar.config.precision import LAYOUTS
from jaxpar.data.batch import abstract_batch, random_batch
from jaxpar.model.flops import row_flops_per_token
from jaxpar.model.stack import ACTIVE_ROWS_SCOPE
from jaxpar.parallel import layer_split, zero_bubble
from jaxpar.parallel.layer_split import stage_flops
from jaxpar.parallel.mesh import build_mesh
from jaxpar.parallel.sharding import STATE_KINDS
from jaxpar.parallel.slot_program import branch_shares
from jaxpar.parallel.slot_program import program as slot_program
from jaxpar.training.compiled_memory import memory_analysis_bytes
from jaxpar.training.pipelined import stage_layout
from jaxpar.training.plan import StepPlan, build_plan
from jaxpar.training.state import abstract_state, init_state
from jaxpar.training.step import make_train_step

ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipeline=1"]
# The pipeline grid's model: small enough that every (p, m) point compiles in seconds on 2 CPU cores.
PIPELINE_MODEL = [
    "model.n_layers=4",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=128",
    "data.seq_len=32",
    "optimizer.zero_stage=0",
]


def row(group: str, case: str, metric: str, measured: float, reference: float, unit: str, target: str) -> dict:
    """One report row; ratio = measured / reference (NaN when reference is 0)."""
    ratio = measured / reference if reference else math.nan
    return {
        "group": group,
        "case": case,
        "metric": metric,
        "measured": float(measured),
        "reference": float(reference),
        "ratio": float(ratio),
        "unit": unit,
        "target": target,
    }


def _abstract_batch(plan: StepPlan) -> dict:
    """`jaxpar.data.batch.abstract_batch` of one global batch on the plan's mesh."""
    return abstract_batch(plan.cfg.train.global_batch_size, plan.cfg.data.seq_len, plan.batch_sharding)


# --- overhead ----------------------------------------------------------------------------------------------


def measure_overhead(cfg: Config, steps: int, rounds: int) -> dict:
    """jaxpar's step against `reference_step` on one device, both compiled ahead of time and timed interleaved.

    Args:
      cfg: a config whose mesh has one device (see ONE_DEVICE); steps: timed steps per round and contender.

    Returns:
      {"cost": {name: compiled_cost}, "first_loss": {name: float}, "times": {name: rounds of per-step seconds}}
      for name in ("jaxpar", "reference"), and "compute_dtype" (the name of the dtype both compute in: the plan's).
    """
    devices = jax.devices()[:1]
    plan = build_plan(cfg, build_mesh(cfg, devices))
    batch = random_batch(
        cfg.train.global_batch_size,
        cfg.data.seq_len,
        cfg.model.vocab_size,
        plan.batch_sharding,
        masked_prefix=cfg.data.seq_len // 8,
    )
    jp: dict[str, Any] = {"state": init_state(plan, cfg.train.seed)}
    ref_step, params, opt_state = reference_step(cfg, plan.compute_dtype)
    ref = {"params": jax.device_put(params, devices[0]), "opt": jax.device_put(opt_state, devices[0])}
    jp["step"] = make_train_step(plan).lower(jp["state"], batch).compile()
    ref_step = ref_step.lower(ref["params"], ref["opt"], batch).compile()

    def run_jaxpar():
        jp["state"], metrics = jp["step"](jp["state"], batch)
        return metrics["loss"]

    def run_reference():
        ref["params"], ref["opt"], loss = ref_step(ref["params"], ref["opt"], batch)
        return loss

    first = {"jaxpar": float(run_jaxpar()), "reference": float(run_reference())}
    times = interleaved_step_times({"jaxpar": run_jaxpar, "reference": run_reference}, steps, rounds)
    return {
        "cost": {"jaxpar": compiled_cost(jp["step"]), "reference": compiled_cost(ref_step)},
        "first_loss": first,
        "times": times,
        "compute_dtype": jnp.dtype(plan.compute_dtype).name,
    }


def overhead_rows(result: dict, case: str) -> list[dict]:
    """Rows of a `measure_overhead` result: median step time, then XLA's FLOPs and bytes accessed."""
    med = {n: median_seconds(t) for n, t in result["times"].items()}
    paired = statistics.median(
        j / r for j, r in zip(round_medians(result["times"]["jaxpar"]), round_medians(result["times"]["reference"]))
    )
    c = result["cost"]
    return [
        row(
            "overhead",
            case,
            "step time jaxpar/reference",
            med["jaxpar"],
            med["reference"],
            "s",
            f"<= 1.03 (per-round median ratio {paired:.3f})",
        ),
        row(
            "overhead", case, "XLA FLOPs jaxpar/reference", c["jaxpar"]["flops"], c["reference"]["flops"], "FLOPs", "~1"
        ),
        row(
            "overhead",
            case,
            "XLA bytes accessed",
            c["jaxpar"]["bytes_accessed"],
            c["reference"]["bytes_accessed"],
            "bytes",
            "~1",
        ),
    ]


# --- memory ------------------------------------------------------------------------------------------------


def zero_memory_tables(
    config: str,
    overrides: Sequence[str],
    data: int,
    stages: Sequence[int] = (0, 1, 2, 3),
    compiler_options: dict | None = None,
) -> dict[int, list[dict]]:
    """`jaxpar.analysis.planner.memory.memory_table` per ZeRO stage on mesh data=`data` (fsdp = tensor = pipeline = 1),
    compiled on abstract state and batch (nothing runs). Uses the first `data` devices.

    Returns:
      {zero_stage: memory_table rows}.
    Raises:
      ConfigError: the overrides do not fit data=`data` (e.g. a global batch it does not divide).
    """
    tables = {}
    for zero in stages:
        mesh_axes = [
            f"mesh.data={data}",
            "mesh.fsdp=1",
            "mesh.tensor=1",
            "mesh.pipeline=1",
            f"optimizer.zero_stage={zero}",
        ]
        cfg = load_config(config, [*overrides, *mesh_axes], num_devices=data)
        plan = build_plan(cfg, build_mesh(cfg, jax.devices()[:data]))
        tables[zero] = memory_table(
            plan, abstract_state(plan), _abstract_batch(plan), compiler_options=compiler_options
        )
    return tables


def memory_rows(tables: dict[int, list[dict]]) -> list[dict]:
    """Rows measured / formula bytes per device for params, grads, opt_state and total of every stage."""
    out = []
    for table in tables.values():
        head = table[0]
        case = f"{head['expression'].split(':')[0]} data={head[DATA]}"
        for r in table:
            if r["kind"] in (*STATE_KINDS, "total"):
                out.append(
                    row(
                        "memory",
                        case,
                        f"{r['kind']} ({r['formula']})",
                        r["measured_bytes"],
                        r["formula_bytes"],
                        "bytes",
                        "1.000",
                    )
                )
    return out


# --- tensor-parallel collectives ---------------------------------------------------------------------------


def tensor_analytic(plan: StepPlan) -> tuple[list, dict[str, float]]:
    """The planner's collectives of `plan`'s step over exactly the `tensor` axis (Megatron with or without
    sequence parallelism; `jaxpar.analysis.planner.comm.collective_terms`, planned for the backend the step compiles
    on) and their bytes per device per step by collective kind."""
    cfg = resolve_config(plan.cfg, plan.mesh.size)
    terms = [t for t in collective_terms(cfg, jax.default_backend()) if t.axes == (TENSOR,)]
    out: dict[str, float] = {}
    for t in terms:
        out[t.kind] = out.get(t.kind, 0.0) + t.bytes
    return terms, out


def tensor_axis_bytes(table: dict) -> dict[str, float]:
    """Bytes per device per step of each collective kind over exactly the `tensor` axis, from a
    `collectives_by_axis` table."""
    return {kind: v["bytes"] for (axes, kind), v in table.items() if axes == (TENSOR,)}


def tensor_collective_rows(
    config: str, overrides: Sequence[str], num_devices: int, compiler_options: dict | None = None
) -> list[dict]:
    """HLO / analytic tensor-axis bytes per kind and in total, mesh tensor=2 x fsdp=num_devices/2, sequence
    parallelism off and on; compiled on abstract state and batch.

    Raises:
      ConfigError: num_devices is odd, or the overrides do not fit that mesh.
    """
    out = []
    mesh_axes = ["mesh.data=1", "mesh.fsdp=-1", "mesh.tensor=2", "mesh.pipeline=1"]
    for sp in (False, True):
        cfg = load_config(
            config, [*overrides, *mesh_axes, f"tensor.sequence_parallel={str(sp).lower()}"], num_devices=num_devices
        )
        plan = build_plan(cfg, build_mesh(cfg, jax.devices()[:num_devices]))
        lowered = make_train_step(plan).lower(abstract_state(plan), _abstract_batch(plan))
        compiled = lowered.compile(compiler_options)
        got = tensor_axis_bytes(collectives_by_axis(compiled_hlo_text(compiled), plan.mesh))
        _, want = tensor_analytic(plan)
        case = f"tensor=2 fsdp={plan.mesh_shape[FSDP]} sp={'on' if sp else 'off'}"
        for kind in sorted(set(want) | set(got)):
            target = "~1 (HLO adds grad-norm scalars)" if kind == "all-reduce" else "1.00"
            out.append(
                row("tensor", case, f"{kind} HLO/Megatron", got.get(kind, 0.0), want.get(kind, 0.0), "bytes", target)
            )
        out.append(
            row(
                "tensor",
                case,
                "total HLO/Megatron",
                sum(got.values()),
                sum(want.values()),
                "bytes",
                "<= 1.02 (HLO adds grad-norm scalars)",
            )
        )
    return out


# --- pipeline schedules ------------------------------------------------------------------------------------


def pipeline_overrides(p: int, pipelined: bool, schedule: str, m: int, rows: int) -> list[str]:
    """Mesh and batch overrides of one pipeline benchmark point: pipeline=p with m microbatches of `rows`
    sequences, or (not `pipelined`) the data=p baseline with the same global batch m * rows."""
    axes = ["mesh.fsdp=1", "mesh.tensor=1"]
    axes += ["mesh.data=1", f"mesh.pipeline={p}"] if pipelined else [f"mesh.data={p}", "mesh.pipeline=1"]
    return axes + [
        f"pipeline.schedule={schedule}",
        f"pipeline.microbatches={m if pipelined else 1}",
        f"train.global_batch_size={m * rows}",
        "train.grad_accum_steps=1",
    ]


def pipeline_temp_bytes(cfg: Config, devices: Sequence[jax.Device], compiler_options: dict | None = None) -> int:
    """Temp bytes per device (`memory_analysis().temp_size_in_bytes`) of the compiled train step; nothing runs.

    Raises:
      RuntimeError: the backend gives no memory analysis.
    """
    plan = build_plan(cfg, build_mesh(cfg, devices))
    lowered = make_train_step(plan).lower(abstract_state(plan), _abstract_batch(plan))
    memory = memory_analysis_bytes(lowered.compile(compiler_options))
    if memory is None:
        raise RuntimeError(f"the {jax.default_backend()} backend gives no memory_analysis() for compiled code")
    return memory["temp_bytes"]


# The memory rows compare the stash of 1F1B with GPipe's autodiff of the whole forward (benchmarks/pipeline.py has
# every schedule, the zero-bubble ones included).
MEMORY_ROW_SCHEDULES = ("1f1b", "gpipe")


def pipeline_memory_rows(
    config: str,
    overrides: Sequence[str],
    stages: Sequence[int],
    microbatches: Sequence[int],
    micro_rows: int = 2,
    compiler_options: dict | None = None,
) -> list[dict]:
    """Temp bytes 1F1B / GPipe for each (p, m), on the first p devices with PIPELINE_MODEL + `overrides`."""
    out = []
    for p in stages:
        for m in microbatches:
            temp = {}
            for sched in MEMORY_ROW_SCHEDULES:
                cfg = load_config(
                    config,
                    [*PIPELINE_MODEL, *overrides, *pipeline_overrides(p, True, sched, m, micro_rows)],
                    num_devices=p,
                )
                temp[sched] = pipeline_temp_bytes(cfg, jax.devices()[:p], compiler_options)
            live = {s: stage_inputs_in_flight(s, p, m)["live"] for s in MEMORY_ROW_SCHEDULES}
            out.append(
                row(
                    "pipeline",
                    f"p={p} m={m} b={micro_rows}",
                    "temp bytes 1F1B/GPipe",
                    temp["1f1b"],
                    temp["gpipe"],
                    "bytes",
                    f"< 1; live stage inputs {live['1f1b']}/{live['gpipe']} = {live['1f1b'] / live['gpipe']:.3f}",
                )
            )
    return out


# The pipeline variants compared with data parallelism: (row label, pipeline.schedule, pipeline.recompute,
# pipeline.virtual_stages). Not a vocabulary: each schedule of `jaxpar.config.choices.PIPELINE_SCHEDULES`, 1F1B
# also with recompute and interleaved.
PIPELINE_VARIANTS = (
    ("1F1B", "1f1b", False, 1),
    ("1F1B recompute", "1f1b", True, 1),
    ("interleaved 1F1B v=2", "1f1b", False, 2),
    ("ZB-H1", "zb-h1", False, 1),
    ("ZB-V", "zb-v", False, 2),
    ("GPipe", "gpipe", False, 1),
)


def pipeline_branch_weights(plan: StepPlan) -> BranchWeights | None:
    """`branch_weights` for `jaxpar.analysis.hlo.flops.dot_flops_per_device` of a pipelined step whose conds
    select on more than the stage (None where it needs none: 1F1B and GPipe with the even split). Partition ->
      * zb-h1, zb-v: its stage's shares of the slot switch's branches ([idle, F, B, W], `jaxpar.parallel.
        slot_program.branch_shares`) and of the head's cond after it ([no head, head]; the embedding's gradient,
        the other cond after the switch, has no matmul, so its branches cost the same and need no weights);
      * an uneven split (`jaxpar.training.pipelined.stage_layout`): the skip conds of the stage layout's rows
        (name scope `jaxpar.model.stack.ACTIVE_ROWS_SCOPE`), [skipped, run] in the share of the device's rows that
        hold a layer: exact where every slot of the device runs equally often, as in the zero-bubble tables and at
        v = 1.
    Interleaved 1F1B's edge conds select on the tick and have no weights here (read it with skip_conditionals)."""
    pipe, p = plan.cfg.pipeline, plan.mesh_shape[PIPELINE]
    layout = stage_layout(plan)
    zb = p > 1 and pipe.schedule in ZERO_BUBBLE
    if not zb and layout is None:
        return None
    axis = list(plan.mesh.axis_names).index(PIPELINE)
    stage = lambda pid: int(np.unravel_index(pid, plan.mesh.devices.shape)[axis])  # noqa: E731
    shares = []
    if zb:
        prog = slot_program(zero_bubble.build(pipe.schedule, p, pipe.microbatches, pipe.virtual_stages))
        shares = [branch_shares(prog, s) for s in range(p)]
    run = [] if layout is None else [r / (layout.v * layout.n_max) for r in layout.device_rows()]

    def weights(pid: int, n: int, op_name: str) -> list[float] | None:
        s = stage(pid)
        if run and n == 2 and f"/{ACTIVE_ROWS_SCOPE}/" in op_name:
            return [1 - run[s], run[s]]
        if not shares:
            return None
        kinds, head = shares[s]
        return kinds if n == 4 else [1 - head, head] if n == 2 else None

    return weights


def busiest_device_formula(plan: StepPlan) -> float:
    """The busiest device's training FLOPs over the mean device's, by formula: each model chunk's layers at
    `jaxpar.model.flops.row_flops_per_token` (6P/L + 12*D*T and what remat recomputes) and the head's 6*D*V on the
    last chunk, or 1/p of it on every device with `pipeline.vocab_parallel` (PaLM, Chowdhery et al. 2022, appendix
    B; `jaxpar.parallel.layer_split.stage_flops`), summed over the chunks each device holds, under the step's split
    (`jaxpar.training.pipelined.stage_layout`, else the even one). Pipelined over data parallelism on the same
    devices, this is the busiest device's FLOPs over data parallelism's when no idle tick computes."""
    cfg, p = plan.cfg, plan.mesh_shape[PIPELINE]
    v = cfg.pipeline.virtual_stages
    layout = stage_layout(plan)
    counts = layout.counts if layout is not None else (cfg.model.stack_depth // (p * v),) * (p * v)
    row = row_flops_per_token(cfg, nnx.to_pure_dict(plan.mdef.abstract_state))
    head = 6 * cfg.model.d_model * cfg.model.vocab_size
    spread = cfg.pipeline.vocab_parallel  # the head split over the stages alike
    loads = stage_flops(counts, row, 0.0 if spread else head)
    where = layer_split.placement(cfg.pipeline.schedule, p, v)
    per_device = [
        sum(load for c, load in enumerate(loads) if where[c] == d) + (head / p if spread else 0) for d in range(p)
    ]
    return max(per_device) / (sum(per_device) / p)


def pipeline_schedule_rows(
    config: str,
    overrides: Sequence[str],
    p: int,
    m: int,
    steps: int,
    rounds: int,
    micro_rows: int = 2,
    compiler_options: dict | None = None,
) -> list[dict]:
    """Each variant of PIPELINE_VARIANTS on mesh pipeline=p against data parallelism on mesh data=p, same devices and
    global batch m * micro_rows, PIPELINE_MODEL + `overrides`: matmul FLOPs per device (mean over the devices,
    `jaxpar.analysis.hlo.flops`) over data parallelism's, with 1/(1 - bubble) as reference ((v m + p - 1)/(v m) for
    1F1B and GPipe; target <= 1.03 x it, except with recompute: the stage forward twice, about 4/3 of the blocks);
    median step time over data parallelism's (steps interleaved in one run); and the measured bubbles 1 - 1/ratio of
    both next to the bubble (`jaxpar.analysis.planner.pipeline.schedule_bubble`: (p - 1)/(v m + p - 1), or the
    table's for zb-h1 and zb-v, whose slot switch is read with its branches weighted by the table's counts,
    `pipeline_branch_weights`; v = 1 except for interleaved 1F1B and ZB-V). Interleaved 1F1B's embedding and head
    conds select on the tick as well as the stage, which the FLOPs reader cannot evaluate: its blocks' FLOPs are
    read with the conds left out and its heads' added from the formula, 6 b T D V per microbatch on the last stage
    (b = micro_rows)."""
    devices = jax.devices()[:p]
    runs: dict[str, Callable[[], Any]] = {}
    flops: dict[str, float] = {}
    for name, sched, recompute, v in (("data parallel", "1f1b", False, 1), *PIPELINE_VARIANTS):
        pipelined = name != "data parallel"
        cfg = load_config(
            config,
            [
                *PIPELINE_MODEL,
                *overrides,
                *pipeline_overrides(p, pipelined, sched, m, micro_rows),
                f"pipeline.recompute={str(recompute).lower()}",
                f"pipeline.virtual_stages={v}",
            ],
            num_devices=p,
        )
        plan = build_plan(cfg, build_mesh(cfg, devices))
        batch = random_batch(m * micro_rows, cfg.data.seq_len, cfg.model.vocab_size, plan.batch_sharding)
        state = init_state(plan, cfg.train.seed)
        step = make_train_step(plan).lower(state, batch).compile(compiler_options)
        if sched in ("zb-h1", "zb-v"):  # the slot switch's branches by the table's counts
            weights = pipeline_branch_weights(plan)
            flops[name] = sum(dot_flops_per_device(compiled_hlo_text(step), branch_weights=weights)) / p
        elif v == 1:
            flops[name] = sum(dot_flops_per_device(compiled_hlo_text(step))) / p
        else:
            head = 6 * micro_rows * cfg.data.seq_len * cfg.model.d_model * cfg.model.vocab_size
            flops[name] = (sum(dot_flops_per_device(compiled_hlo_text(step), skip_conditionals=True)) + m * head) / p
        box = {"state": state}

        def run(step=step, batch=batch, box=box):
            box["state"], metrics = step(box["state"], batch)
            return metrics["loss"]

        runs[name] = run
    times = {name: median_seconds(t) for name, t in interleaved_step_times(runs, steps, rounds).items()}
    case = f"p={p} m={m} b={micro_rows}"
    out = []
    for name, sched, recompute, v in PIPELINE_VARIANTS:
        bubble = schedule_bubble(sched, p, m, v)
        ticks = 1 / (1 - bubble)
        f_ratio, t_ratio = flops[name] / flops["data parallel"], times[name] / times["data parallel"]
        bound = "~4/3 of the blocks' share" if recompute else "<= 1.03"
        tick_name = "1/(1-bubble)"
        out += [
            row("pipeline", case, f"{name} FLOPs/dp over {tick_name}", f_ratio, ticks, "FLOPs", bound),
            row("pipeline", case, f"{name} step time/dp", times[name], times["data parallel"], "s", "-"),
            row("pipeline", case, f"{name} bubble 1-dp/FLOPs over formula", 1 - 1 / f_ratio, bubble, "fraction", "-"),
            row("pipeline", case, f"{name} bubble 1-dp/time over formula", 1 - 1 / t_ratio, bubble, "fraction", "-"),
        ]
    return out


# --- the whole report --------------------------------------------------------------------------------------

# Quick mode's model: every measurement compiles in seconds on 2 CPU cores (d_model 64 divides every sharding).
QUICK_MODEL = [
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=128",
    "data.seq_len=32",
]


def run_report(
    config: str,
    overrides: Sequence[str] = (),
    quick: bool = False,
    steps: int | None = None,
    rounds: int = 3,
    log=print,
) -> list[dict]:
    """All four measurements on this process's devices (D = jax.device_count()); returns the report rows.

    quick: QUICK_MODEL, fp32 memory only, pipeline p=2 m=4, 5 timed steps per round, and (on CPU) FAST_COMPILER_OPTIONS
      for the compile-only rows. Otherwise the config's model, fp32 and 16p memory, pipeline p in (2, 4) and
      m in (4, 8, 16) where p <= D, 20 timed steps, default compiler options.
    Rows that need more devices than D have are left out (tensor: D even; pipeline: p <= D), and `log` says so.

    Raises:
      ConfigError: `overrides` that do not fit a measurement's mesh.
    """
    d, start = jax.device_count(), time.perf_counter()
    model = [*QUICK_MODEL, *overrides] if quick else list(overrides)
    options = FAST_COMPILER_OPTIONS if quick and jax.default_backend() == "cpu" else None
    steps = steps or (5 if quick else 20)
    batch = [f"train.global_batch_size={2 * d}"]
    log(
        f"benchmarks on {d} x {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"{'quick' if quick else 'full'} mode"
    )

    cfg = load_config(config, [*model, *ONE_DEVICE], num_devices=1)
    rows = overhead_rows(
        measure_overhead(cfg, steps, rounds),
        f"1 device, {cfg.model.n_layers}L d{cfg.model.d_model} {cfg.train.global_batch_size}x{cfg.data.seq_len}",
    )
    log(f"overhead done ({time.perf_counter() - start:.0f} s)")
    for layout in list(LAYOUTS)[:1] if quick else LAYOUTS:  # quick: fp32 only
        tables = zero_memory_tables(config, [*model, *batch, f"precision.layout={layout}"], d, compiler_options=options)
        rows += memory_rows(tables)
    log(f"memory done ({time.perf_counter() - start:.0f} s)")
    if d >= 2 and d % 2 == 0:
        rows += tensor_collective_rows(config, [*model, *batch], d, options)
        log(f"tensor collectives done ({time.perf_counter() - start:.0f} s)")
    else:
        log(f"tensor rows left out: need an even device count >= 2, have {d}")
    stages = [p for p in ((2,) if quick else (2, 4)) if p <= d]
    rows += pipeline_memory_rows(
        config, list(overrides), stages, (4,) if quick else (4, 8, 16), compiler_options=options
    )
    if stages:
        rows += pipeline_schedule_rows(config, list(overrides), 2, 4 if quick else 8, steps, rounds, 2, options)
    log(
        f"pipeline done ({time.perf_counter() - start:.0f} s)"
        if stages
        else f"pipeline rows left out: need >= 2 devices, have {d}"
    )
    return rows


# --- the table ---------------------------------------------------------------------------------------------


def _value(x: float, unit: str) -> str:
    if unit == "s":
        return f"{x * 1e3:.2f} ms"
    if unit == "FLOPs":
        return f"{x:.4g}"
    if unit == "fraction":
        return f"{x:.3f}"
    return f"{x:,.0f}"


def format_report(rows: list[dict]) -> str:
    """Fixed-width text table: group | case | metric | measured | reference | ratio | target."""
    head = ("group", "case", "metric", "measured", "reference", "ratio", "target")
    cells = [head] + [
        (
            r["group"],
            r["case"],
            r["metric"],
            _value(r["measured"], r["unit"]),
            _value(r["reference"], r["unit"]),
            f"{r['ratio']:.4f}",
            r["target"],
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    right = {3, 4, 5}
    lines = [
        "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
        for line in cells
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(line.rstrip() for line in lines)
