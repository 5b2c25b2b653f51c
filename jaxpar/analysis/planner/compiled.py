"""The plan checked against XLA: compile the real train step ahead of time, read its memory analysis and HLO.

Nothing runs on a device for `compiled_plan`: the state and batch are ShapeDtypeStructs carrying their
shardings, and `jit(...).lower(...).compile()` gives XLA's buffer assignment (`memory_analysis()`, per device for
an SPMD program) and the optimized HLO, whose collectives `jaxpar.analysis.hlo.collectives` reads by mesh axis.
`measure_steps` does run K steps (random tokens) for sweeps that ask for throughput.

Two programs are read. The executable's optimized HLO is what the compiling backend runs: on CPU, XLA:CPU has
widened every bf16 collective to fp32 (`jaxpar.analysis.planner.plan`), so it is compared with the plan for cpu. The
partitioned program -- the HLO right after XLA's SPMD partitioner (pass `spmd-partitioning`), dumped during the same
compile -- is the last program CPU and GPU compilers share: every collective of the step exists there (jaxpar's explicit
ones and those the partitioner inserts, e.g. ZeRO-1/2's gather of updated parameters) in the dtype the program
gives it, and everything after it is a backend's own pipeline. It is compared with the plan for the target
platform (gpu unless told otherwise) at the compute dtype the step was compiled with. For pipeline layouts it
still holds the loop-invariant weight gathers, common subexpressions and unread shifts that the backends' generic
simplification later hoists or drops (`jaxpar.analysis.planner.comm` counts after that), so there the two differ in
counts.

Needs as many jax devices as the mesh: the CLI (`jaxpar.cli.plan`) sets the simulated CPU device count before
jax is imported.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import statistics
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.analysis.hlo.collectives import classify_groups, parse_collectives
from jaxpar.analysis.hlo.compile_options import COMPILER_OPTIONS
from jaxpar.analysis.hlo.text import compiled_hlo_text
from jaxpar.analysis.planner.memory import persistent_state_bytes
from jaxpar.analysis.planner.plan import plan as analytic_plan
from jaxpar.config.mesh_axes import mesh_sizes
from jaxpar.config.precision import check_platform
from jaxpar.config.schema import Config
from jaxpar.data.batch import abstract_batch, random_batch
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.compiled_memory import memory_analysis_bytes
from jaxpar.training.plan import build_plan
from jaxpar.training.state import abstract_state, init_state
from jaxpar.training.step import make_train_step

# The pass after which the program is "partitioned" (module docstring): StatefulRngSpmdPartitioner's name in
# XLA's CPU and GPU SPMD pipelines.
PARTITIONER_PASS = "spmd-partitioning"


def _label(axes) -> str:
    return "?" if axes is None else ",".join(axes) or "(size 1)"


def _step_plan(cfg: Config):
    devices = jax.devices()
    n = math.prod(mesh_sizes(cfg.mesh).values())
    if len(devices) < n:
        raise RuntimeError(
            f"the mesh needs {n} devices but jax has {len(devices)}; set JAX_NUM_CPU_DEVICES={n} "
            f"before jax is imported (jaxpar-plan --compile does)"
        )
    return build_plan(cfg, build_mesh(cfg, devices[:n]))


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """The train step compiled ahead of time for abstract (state, batch), with what produced it."""

    plan: Any  # jaxpar.training.plan.StepPlan
    state: dict  # abstract state (ShapeDtypeStructs with shardings)
    batch: dict  # abstract batch
    executable: Any  # jax.stages.Compiled; callable on real arrays with the same shardings
    seconds: float  # compile wall time
    partitioned_hlo: str | None = None  # HLO text after the SPMD partitioner (module docstring); None if absent


def compile_step(cfg: Config, compiler_options: dict | None = None) -> CompiledStep:
    """Lowers and compiles `make_train_step` of resolved `cfg` on the first N jax devices (nothing runs), and
    keeps the partitioned program: XLA dumps the module after `PARTITIONER_PASS` into a temporary directory
    (compile options `xla_dump_to`, `xla_dump_hlo_pass_re`; removed after). `partitioned_hlo` is None when no
    dump was written (a hit in jax's persistent compilation cache skips XLA).

    Raises:
      RuntimeError: fewer jax devices than the mesh needs.
    """
    plan = _step_plan(cfg)
    state = abstract_state(plan)
    batch = abstract_batch(cfg.train.global_batch_size, cfg.data.seq_len, plan.batch_sharding)
    options = dict(COMPILER_OPTIONS if compiler_options is None else compiler_options)
    with tempfile.TemporaryDirectory(prefix="jaxpar-hlo-") as dump:
        options.update(xla_dump_to=dump, xla_dump_hlo_pass_re=PARTITIONER_PASS, xla_dump_hlo_as_text=True)
        t0 = time.perf_counter()
        executable = make_train_step(plan).lower(state, batch).compile(options)
        seconds = time.perf_counter() - t0
        partitioned = read_partitioned_hlo(dump)
    return CompiledStep(plan, state, batch, executable, seconds, partitioned)


def read_partitioned_hlo(dump_dir: str, function: str = "train_step") -> str | None:
    """The HLO text of jitted `function` after `PARTITIONER_PASS` from an XLA dump directory (file
    `*.jit_<function>.*.after_spmd-partitioning.*.txt`), or None if there is none.

    Raises:
      RuntimeError: several such files (several modules of that name compiled into one directory).
    """
    found = glob.glob(os.path.join(dump_dir, f"*.jit_{function}.*after_{PARTITIONER_PASS}.*.txt"))
    if len(found) > 1:
        raise RuntimeError(f"{len(found)} partitioned {function} modules in {dump_dir}: {sorted(found)[:3]}")
    if not found:
        return None
    with open(found[0], encoding="utf-8") as f:
        return f.read()


def hlo_collectives(hlo_text: str, mesh) -> dict:
    """Collectives of compiled HLO per step: {"by_axis": {"axes kind": {"count", "bytes"}} for collectives with
    an array operand, "scalars": {"count", "bytes", "kinds", "axes"} for those whose operands are all 0-d (loss,
    token count, grad-norm and finite-check partial sums)}. Bytes are ring bytes sent per device."""
    by_axis: dict = {}
    scalars: dict[str, Any] = {"count": 0, "bytes": 0.0, "kinds": set(), "axes": set()}
    for c in parse_collectives(hlo_text):
        axes = classify_groups(c.groups, mesh, c.kind)
        if axes == ():
            continue  # a group of one device moves nothing
        if all(len(a.shape) == 0 for a in c.operands + c.results):
            scalars["count"] += c.times_per_step
            scalars["bytes"] += c.times_per_step * c.bytes_per_device
            scalars["kinds"].add(c.kind)
            scalars["axes"].add(_label(axes))
            continue
        entry = by_axis.setdefault(f"{_label(axes)} {c.kind}", {"count": 0, "bytes": 0.0})
        entry["count"] += c.times_per_step
        entry["bytes"] += c.times_per_step * c.bytes_per_device
    scalars["kinds"], scalars["axes"] = sorted(scalars["kinds"]), sorted(scalars["axes"])
    return {"by_axis": by_axis, "scalars": scalars}


def compare_collectives(hlo: dict, analytic: dict) -> list[dict]:
    """Rows of `hlo_collectives(...)["by_axis"]` beside the plan's (`jaxpar.analysis.planner.plan.plan`) over the union
    of both keys: {"key" ("axes kind"), "compiled_bytes", "compiled_count" (in the HLO), "planned_bytes",
    "planned_count", "planned_hlo_bytes" (the plan counted as the HLO reading counts, the plan's "by_axis_hlo":
    the same as "planned_bytes" except under interleaved 1F1B, whose edge conds the reading counts in every tick
    that evaluates them), "ratio" (HLO / planned_hlo_bytes, like with like; None where nothing is planned)}."""
    planned_counts: dict = {}
    for row in analytic["collectives"]:
        key = f"{','.join(row['axes'])} {row['kind']}"
        planned_counts[key] = planned_counts.get(key, 0) + row["count"]
    as_read = analytic.get("by_axis_hlo", analytic["by_axis"])
    rows = []
    for key in sorted(set(hlo) | set(analytic["by_axis"]) | set(as_read)):
        got = hlo.get(key, {"count": 0, "bytes": 0.0})
        want = as_read.get(key, 0.0)
        rows.append(
            {
                "key": key,
                "compiled_bytes": got["bytes"],
                "compiled_count": got["count"],
                "planned_bytes": analytic["by_axis"].get(key, 0.0),
                "planned_count": planned_counts.get(key, 0),
                "planned_hlo_bytes": want,
                "ratio": got["bytes"] / want if want else None,
            }
        )
    return rows


def partitioned_check(cfg: Config, step: CompiledStep, target: str = "gpu") -> dict | None:
    """The partitioned program's collectives (module docstring) beside the plan for `target` at the compute
    dtype `step` was compiled with (`precision.compute_dtype: auto` pinned to it, so that a CPU compile of an
    `auto` config is compared at float32 while the target's collective widths apply) and with its MoE transport
    (`model.moe.all_to_all` as the step resolved it: emulated on cpu).

    Returns:
      None when `step` holds no partitioned program, else {"platform" (target), "compute_dtype",
      "collectives" (`compare_collectives` rows), "scalars" (see `hlo_collectives`)}.

    Raises:
      ValueError: target is `cpu` (the partitioned program is not what XLA:CPU runs: compare the executable)
        or not one of `jaxpar.config.precision.PLATFORMS`.
    """
    if check_platform(target) == "cpu":
        raise ValueError(
            "the partitioned program is compared with a plan for gpu or tpu; for cpu compare the "
            "executable (compiled_plan's collectives)"
        )
    if step.partitioned_hlo is None:
        return None
    dtype = jnp.dtype(step.plan.compute_dtype).name
    pinned = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, compute_dtype=dtype))
    # the MoE transport the step was built with (emulated on cpu), not the target's: the program is this step's
    moe = dataclasses.replace(cfg.model.moe, all_to_all=step.plan.mdef.cfg.moe.all_to_all)
    pinned = dataclasses.replace(pinned, model=dataclasses.replace(cfg.model, moe=moe))
    coll = hlo_collectives(step.partitioned_hlo, step.plan.mesh)
    analytic = analytic_plan(pinned, target)
    analytic = analytic | {"by_axis": analytic["by_axis_partitioned"], "by_axis_hlo": analytic["by_axis_partitioned"]}
    return {
        "platform": target,
        "compute_dtype": dtype,
        "collectives": compare_collectives(coll["by_axis"], analytic),
        "scalars": coll["scalars"],
    }


def compiled_plan(
    cfg: Config,
    analytic: dict,
    compiler_options: dict | None = None,
    step: CompiledStep | None = None,
    target: str = "gpu",
) -> dict:
    """Compiles the train step of resolved `cfg` on the first N jax devices (`compile_step`; or takes `step`,
    compiled earlier) and sets it beside `analytic` (`jaxpar.analysis.planner.plan.plan(cfg, platform="cpu")` for a CPU
    compile), and its partitioned program beside the plan for `target` (`partitioned_check`).

    Returns:
      {"compile_seconds",
       "memory_analysis": XLA's per-device bytes (`jaxpar.training.compiled_memory.memory_analysis_bytes`: arguments,
         outputs, aliased, temp, generated code, "peak_bytes" = arguments + outputs - aliased + temp),
       "state": {"persistent" (arguments minus the batch), "scalars" (0-d leaves, not in the formula),
         "params", "params_plus_opt_state" (persistent - scalars), "planned" (plan params + opt_state),
         "ratio" (compiled / planned)},
       "temp": {"compiled" (XLA temp), "planned" (`jaxpar.analysis.planner.plan.temp_bytes` total), "ratio"},
       "collectives": the executable's, `compare_collectives` rows against `analytic`, "scalars" (see
         `hlo_collectives`),
       "partitioned": `partitioned_check(cfg, step, target)` (None when the dump is missing)}.

    Raises:
      RuntimeError: fewer jax devices than the mesh needs; the backend gives no memory analysis.
      ValueError: target is cpu or unknown (`partitioned_check`).
    """
    check_platform(target)
    step = step or compile_step(cfg, compiler_options)
    plan, state, batch, compiled, seconds = step.plan, step.state, step.batch, step.executable, step.seconds
    memory = memory_analysis_bytes(compiled)
    if memory is None:
        raise RuntimeError(f"the {jax.default_backend()} backend gives no memory_analysis() for compiled code")
    persistent = persistent_state_bytes(plan, compiled, state, batch)
    mem = analytic["memory"]
    planned_state = mem["params"] + mem["opt_state"] + mem.get("fp8_history", 0)
    state_bytes = persistent["persistent"] - persistent["scalars"]
    planned_temp = mem["temp_estimate"]["total"]
    coll = hlo_collectives(compiled_hlo_text(compiled), plan.mesh)
    return {
        "compile_seconds": seconds,
        "memory_analysis": memory,
        "state": {
            "persistent": persistent["persistent"],
            "scalars": persistent["scalars"],
            "params": persistent["params"],
            "params_plus_opt_state": state_bytes,
            "planned": planned_state,
            "ratio": state_bytes / planned_state,
        },
        "temp": {
            "compiled": memory["temp_bytes"],
            "planned": planned_temp,
            "ratio": memory["temp_bytes"] / planned_temp if planned_temp else None,
        },
        "collectives": compare_collectives(coll["by_axis"], analytic),
        "scalars": coll["scalars"],
        "partitioned": partitioned_check(cfg, step, target),
    }


def measure_steps(cfg: Config, steps: int, peak_flops_override: float = 0.0, step: CompiledStep | None = None) -> dict:
    """Runs `steps` train steps (after one untimed warm-up step) on random tokens and times them, with the
    executable of `step` when given (no second compile; its compiler options then apply to the timing), else a
    fresh `jax.jit` of the step.

    Returns:
      {"steps", "step_time_s" (median seconds), "tokens_per_s" (global tokens per second), "mfu" (model FLOPs
       utilisation with `jaxpar.model.flops.model_flops` per token over devices x peak; None when the device's
       peak is unknown, e.g. CPU), "peak_flops_per_device", "peak_memory_bytes" (device 0's allocator peak;
       None where the backend keeps no statistics, e.g. CPU), "device_kind"}.

    Raises:
      ValueError: steps < 1.
    """
    from jaxpar.model import flops

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    plan = step.plan if step else _step_plan(cfg)
    run = step.executable if step else make_train_step(plan)
    state = init_state(plan, cfg.train.seed)
    g, t = cfg.train.global_batch_size, cfg.data.seq_len
    batch = random_batch(g, t, cfg.model.vocab_size, plan.batch_sharding)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        state, metrics = run(state, batch)
        jax.block_until_ready(metrics)
        if i:
            times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    tokens_per_s = g * t / seconds
    device = plan.mesh.devices.flat[0]
    peak = flops.peak_flops(device.device_kind, peak_flops_override or cfg.train.peak_flops_per_device)
    per_token, _ = flops.model_flops(cfg, state["params"])
    stats = device.memory_stats() or {}
    return {
        "steps": steps,
        "step_time_s": seconds,
        "tokens_per_s": tokens_per_s,
        "mfu": flops.mfu(tokens_per_s, per_token, plan.mesh.size, peak),
        "peak_flops_per_device": peak,
        "peak_memory_bytes": stats.get("peak_bytes_in_use"),
        "device_kind": device.device_kind,
    }
