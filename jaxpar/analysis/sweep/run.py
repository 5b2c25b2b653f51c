"""Mesh sweeps: plan (and optionally compile and time) every point of a grid of mesh shapes and config overrides.

A sweep file (YAML, read, its `base:` found and its values typed by the config loader, `jaxpar.config.load.read_yaml`,
`pop_base` and `jaxpar.config.decode.decode_value`: like `yaml.safe_load` but refusing duplicate keys; relative paths
are relative to the file, as a config's `base:` is):

    base: ../tiny.yaml                  # required: the config every point starts from
    overrides: [model.n_layers=2]       # optional: dotted overrides applied to every point
    devices: 8                          # every factorisation of 8 into data x fsdp x tensor x pipeline ...
    constraints: {max_tensor: 2, max_pipeline: 2}   # ... pruned by these (only with `devices`)
    meshes: [{data: 8}, {data: 4, fsdp: 2}]        # ... or an explicit list (missing axes are 1)
    vary: {optimizer.zero_stage: [1, 3], pipeline.microbatches: [1, 2]}   # cartesian product
    vary: {model.moe.expert_axes: [[], [fsdp], [data, fsdp]]}     # a list-valued key: a list of lists
    objective: memory                   # memory | comm_bytes | tokens_per_s | step_time | mfu
    memory_budget_gb: 24                # or memory_budget_bytes; see below for what is over budget
    measure_steps: 0                    # K > 0: also run K steps per point (tokens/s, step time, MFU)
    compile: true                       # compile each point's step (XLA memory analysis and HLO collectives)
    fast_compile: false                 # jaxpar-plan --fast-compile (measured steps then run that code)
    real_devices: false                 # compile/run on jax's own devices instead of simulated CPU devices
    platform: gpu                       # machine planned for: gpu, tpu or cpu (jaxpar-plan --platform)
    target: h100:8x8                    # a GPU cluster KIND:NODESxGPUS (jaxpar-plan --target; see below)
    timeout_s: 900                      # per point

Platform: the comm_bytes objective ranks by the plan for `platform` (compute_dtype auto and the width of
collectives resolved for it, `jaxpar.analysis.planner.plan`). A compiled point is planned for cpu as well, since it
compiles on simulated CPU devices: that plan sets the budget check and is compared with the CPU executable ("comm
ratio"), and the partitioned program (before any backend pass) is compared with the plan for `platform` ("partitioned
ratio"; gpu when platform is cpu).

Target: `target: KIND:NODESxGPUS` (kinds: `jaxpar.analysis.gpu.targets`) plans every point for platform gpu on the
cluster's GPU count (`devices:` may be left out; another count, in `devices` or in a mesh of `meshes`, is refused)
and, with `compile: true`, compiles it for that cluster with XLA's GPU compiler on this machine, without GPUs
(`jaxpar.analysis.sweep.gpu`, `jaxpar.analysis.gpu.deviceless`; needs the gpu-compile extra, checked before the first
point). The record keeps the GPU compiler's per-device bytes, whether the peak fits one GPU, fused attention and
materialised attention scores, and the GPU program's collectives beside the plan for gpu ("gpu_compiled"); the memory
objective ranks by the GPU-compiled peak, the budget is checked against it, and a point whose compiled peak does
not fit the GPU is marked over budget too. Nothing runs: measure_steps, measured objectives, real_devices and
fast_compile are refused with a target, and so is a platform other than gpu.

Constraints: max_data, max_fsdp, max_tensor, max_pipeline (ints), pipeline_divides_layers and
tensor_divides_heads (bools, default true). Every point is validated with `jaxpar.config.resolve_config`;
a point that fails is recorded with its error (status `invalid`), never stops the sweep. A point whose
analytic peak estimate (`jaxpar.analysis.planner.plan`, params + optimizer state + temp) exceeds the budget is recorded
as `over_budget` and not compiled or run; a compiled point whose compiled peak exceeds it is recorded as
`over_budget` too, and not measured. Compiling and measuring run `python -m jaxpar.cli.plan ... --json` in a
fresh subprocess per point, because the device count must be set before jax is imported.

Resume: results.json in the output directory is rewritten after every point; a rerun skips points whose key
(the point's full list of overrides) is already recorded as ok, over_budget or invalid, and retries failed ones.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from jaxpar.analysis.sweep.gpu import SweepTargetError, gpu_summary, parse_target, plugin_missing, target_command
from jaxpar.analysis.sweep.report import MEASURED_OBJECTIVES, OBJECTIVES, PLOT_FEATURE, write_markdown, write_plot
from jaxpar.config import ConfigError, check_unique_overrides, load_config, load_config_with_sources, resolve_config
from jaxpar.config.decode import decode_value
from jaxpar.config.extras import installed, missing_message
from jaxpar.config.load import pop_base, read_yaml
from jaxpar.config.mesh_axes import CONFIG_AXES, CONTEXT, DATA, FSDP, PIPELINE, TENSOR
from jaxpar.config.paths import output_dir_problem, write_atomic
from jaxpar.config.precision import PLATFORMS
from jaxpar.log import GB

DONE = ("ok", "over_budget", "invalid")
_KEYS = (
    "base",
    "overrides",
    "devices",
    "constraints",
    "meshes",
    "vary",
    "objective",
    "memory_budget_gb",
    "memory_budget_bytes",
    "measure_steps",
    "compile",
    "fast_compile",
    "real_devices",
    "platform",
    "target",
    "timeout_s",
)
_CONSTRAINTS = {
    "max_data": int,
    "max_fsdp": int,
    "max_tensor": int,
    "max_pipeline": int,
    "pipeline_divides_layers": bool,
    "tensor_divides_heads": bool,
}


class SweepError(ValueError):
    """A bad sweep file; the message names the key and the fix."""


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A parsed sweep file (see the module docstring); `meshes` is the expanded list of {axis: size}."""

    path: str
    base: str
    overrides: tuple[str, ...]
    meshes: tuple[dict, ...]
    vary: dict
    objective: str
    budget_bytes: float | None
    measure_steps: int
    compile: bool
    fast_compile: bool
    real_devices: bool
    platform: str
    timeout_s: float
    target: str | None = None  # the GPU cluster's name, e.g. "h100:8x8" (jaxpar.analysis.gpu.targets), or None


def factorisations(devices: int, constraints: dict, n_layers: int, n_heads: int) -> list[dict]:
    """Every {data, fsdp, tensor, pipeline} with product `devices` that meets `constraints` (module docstring),
    ordered by pipeline, tensor, fsdp (ascending); context 1 in each (context parallelism is a choice for long
    sequences: a sweep names it in `meshes`)."""
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    out = []
    for p, t, f in itertools.product(divisors, divisors, divisors):
        if devices % (p * t * f):
            continue
        mesh = {DATA: devices // (p * t * f), FSDP: f, TENSOR: t, PIPELINE: p, CONTEXT: 1}
        if any(mesh[a] > constraints.get(f"max_{a}", devices) for a in CONFIG_AXES):
            continue
        if constraints.get("pipeline_divides_layers", True) and n_layers % p:
            continue
        if constraints.get("tensor_divides_heads", True) and n_heads % t:
            continue
        out.append(mesh)
    return out


def _check_type(key: str, value: Any, kind: type) -> Any:
    """`value` decoded as a config value of type `kind` (`jaxpar.config.decode.decode_value`); SweepError if it is not
    one."""
    try:
        return decode_value(value, kind, key, fix="fix the value in the sweep file")
    except ConfigError as e:
        raise SweepError(str(e)) from e


def _meshes(raw: dict, base_cfg, cluster=None) -> list[dict]:
    if cluster is not None and "meshes" not in raw:  # the cluster's GPU count (parse_target checked `devices`)
        raw = {**raw, "devices": cluster.devices}
    if ("devices" in raw) == ("meshes" in raw):
        raise SweepError(
            "give exactly one of `devices: D` (all factorisations of D) or `meshes: [{data: 4, fsdp: 2}, ...]`"
        )
    if "devices" in raw:
        devices = _check_type("devices", raw["devices"], int)
        if devices < 1:
            raise SweepError(f"devices: must be >= 1, got {devices}")
        constraints = raw.get("constraints") or {}
        if not isinstance(constraints, dict):
            raise SweepError(f"constraints: must be a mapping such as {{max_tensor: 2}}, got {constraints!r}")
        for key, value in constraints.items():
            if key not in _CONSTRAINTS:
                raise SweepError(f"unknown constraint constraints.{key}; valid: {', '.join(_CONSTRAINTS)}")
            _check_type(f"constraints.{key}", value, _CONSTRAINTS[key])
        out = factorisations(devices, constraints, base_cfg.model.n_layers, base_cfg.model.n_heads)
        if not out:
            raise SweepError(f"no factorisation of {devices} devices meets constraints {constraints}; relax them")
        return out
    if "constraints" in raw:
        raise SweepError("constraints: only apply to `devices: D`; with `meshes` list the shapes you want")
    meshes = raw["meshes"]
    if not isinstance(meshes, list) or not meshes:
        raise SweepError(f"meshes: must be a non-empty list of mappings like {{data: 4, fsdp: 2}}, got {meshes!r}")
    out = []
    for i, mesh in enumerate(meshes):
        if not isinstance(mesh, dict) or not mesh:
            raise SweepError(f"meshes[{i}]: must be a mapping like {{data: 4, fsdp: 2}}, got {mesh!r}")
        for axis, size in mesh.items():
            if axis not in CONFIG_AXES:
                raise SweepError(f"meshes[{i}]: unknown mesh axis {axis!r}; valid: {', '.join(CONFIG_AXES)}")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise SweepError(f"meshes[{i}].{axis}: must be a positive integer, got {size!r}")
        out.append({a: mesh.get(a, 1) for a in CONFIG_AXES})
    return out


def _vary(raw: Any, base: str, fixed: list[str]) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise SweepError(f"vary: must be a mapping of dotted config keys to lists, got {raw!r}")
    out = {}
    for key, values in raw.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"vary.{key}: must be a non-empty list of values, e.g. [1, 3]")
        if str(key).startswith("mesh."):
            raise SweepError(f"vary.{key}: mesh sizes come from `devices` or `meshes`, not from vary")
        if any(text.split("=", 1)[0].strip() == str(key) for text in fixed):
            raise SweepError(f"vary.{key}: also set in `overrides`; name it in one of them")
        for value in values:  # the key must exist and every value have the right type
            try:
                load_config(base, [*fixed, f"{key}={_yaml_value(value)}"], validate=False)
            except ConfigError as e:
                raise SweepError(f"vary.{key}: {e}") from e
        out[str(key)] = list(values)
    return out


def _yaml_value(value: Any) -> str:
    """A vary value as the right-hand side of a dotted override (YAML): a list (e.g. model.moe.expert_axes:
    [data, fsdp]) as a flow sequence without spaces, [data,fsdp], so the override stays one word."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_yaml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def load_sweep(path: str) -> Sweep:
    """Reads and checks a sweep file (module docstring).

    Raises:
      SweepError: missing file, not YAML, not a mapping, unknown key, missing or bad base config, bad mesh list,
        unknown vary key or value, unknown objective, a measured objective without measure_steps; a bad `target`
        or a key that conflicts with it (`jaxpar.analysis.sweep.gpu.parse_target`).
    """
    try:
        document = read_yaml(path, "sweep", "configs/sweeps/tiny_mesh_8.yaml")
        raw, base = pop_base(document, path, "keys (base:, devices: or meshes:, vary:, ...)")
    except ConfigError as e:
        raise SweepError(str(e)) from e
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise SweepError(f"{path}: unknown sweep key {unknown[0]!r}; valid keys: {', '.join(_KEYS)}")
    if base is None:
        raise SweepError(f"{path}: `base:` must name the config every point starts from, e.g. base: ../tiny.yaml")
    fixed = raw.get("overrides") or []
    if not isinstance(fixed, list) or not all(isinstance(o, str) for o in fixed):
        raise SweepError(f"overrides: must be a list of strings like mesh.tensor=1, got {fixed!r}")
    try:
        check_unique_overrides(fixed)  # each point's jaxpar-plan command line refuses a repeated key
        base_cfg = load_config(base, fixed, validate=False)
    except ConfigError as e:
        raise SweepError(f"{path}: base config {document['base']!r}: {e}") from e
    for text in fixed:
        if text.split("=", 1)[0].strip().startswith("mesh."):
            raise SweepError(f"overrides: {text!r}: mesh sizes come from `devices` or `meshes`, not from overrides")
    try:
        cluster = parse_target(raw)
    except SweepTargetError as e:
        raise SweepError(f"{path}: {e}") from e
    objective = raw.get("objective", "memory")
    if objective not in OBJECTIVES:
        raise SweepError(f"objective: {objective!r} is not one of {', '.join(OBJECTIVES)}")
    measure = _check_type("measure_steps", raw.get("measure_steps", 0), int)
    if measure < 0:
        raise SweepError(f"measure_steps: must be >= 0, got {measure}")
    if objective in MEASURED_OBJECTIVES and not measure:
        raise SweepError(f"objective {objective} needs measured steps: set measure_steps: K (e.g. 3)")
    if "memory_budget_gb" in raw and "memory_budget_bytes" in raw:
        raise SweepError("give memory_budget_gb or memory_budget_bytes, not both")
    budget = None
    if "memory_budget_gb" in raw:
        budget = _check_type("memory_budget_gb", raw["memory_budget_gb"], float) * GB
    elif "memory_budget_bytes" in raw:
        budget = _check_type("memory_budget_bytes", raw["memory_budget_bytes"], float)
    if budget is not None and budget <= 0:
        raise SweepError(f"memory budget must be > 0, got {budget}")
    platform = raw.get("platform", "gpu")
    if platform not in PLATFORMS:
        raise SweepError(f"platform: {platform!r} is not one of {', '.join(PLATFORMS)}")
    return Sweep(
        path=path,
        base=base,
        overrides=tuple(fixed),
        meshes=tuple(_meshes(raw, base_cfg, cluster)),
        vary=_vary(raw.get("vary"), base, list(fixed)),
        objective=objective,
        budget_bytes=budget,
        measure_steps=measure,
        compile=_check_type("compile", raw.get("compile", True), bool),
        fast_compile=_check_type("fast_compile", raw.get("fast_compile", False), bool),
        real_devices=_check_type("real_devices", raw.get("real_devices", False), bool),
        platform=platform,
        timeout_s=_check_type("timeout_s", raw.get("timeout_s", 900), float),
        target=cluster.name if cluster else None,
    )


def points(sweep: Sweep) -> list[dict]:
    """The sweep's points: {"key" (all overrides, one string), "overrides" (mesh + varied, list), "devices",
    "mesh"}, meshes outermost, then the cartesian product of `vary` in file order."""
    out = []
    names = list(sweep.vary)
    for mesh in sweep.meshes:
        for values in itertools.product(*(sweep.vary[k] for k in names)):
            own = [f"mesh.{a}={mesh[a]}" for a in CONFIG_AXES] + [
                f"{k}={_yaml_value(v)}" for k, v in zip(names, values)
            ]
            out.append(
                {
                    "key": " ".join([*sweep.overrides, *own]),
                    "overrides": own,
                    "devices": math.prod(mesh.values()),
                    "mesh": dict(mesh),
                }
            )
    return out


def _planned_summary(analytic: dict, target: dict) -> dict:
    """Memory and communication of `analytic` (the plan the point is checked and budgeted with), the
    communication of `target` (the plan for the sweep's platform; the same plan when not compiling; its MoE
    all-to-all bytes too) and the pipeline bubble, (p - 1)/(v*m + p - 1) (0 without a pipeline;
    `jaxpar.parallel.schedule.bubble_fraction`)."""
    mem = analytic["memory"]
    return {
        "platform": analytic["platform"],
        "bubble": analytic["pipeline"]["bubble"],
        "model_state": mem["model_state"],
        "activations": mem["activations"],
        "total": mem["total"],
        "peak_estimate": mem["peak_estimate"],
        "comm_bytes": sum(analytic["by_axis"].values()),
        # MoE: the expert axes and the dispatch/combine all-to-all bytes per device and step (None when dense)
        "expert_axes": (analytic["experts"] or {}).get("axes"),
        "all_to_all_bytes": (target["experts"] or {}).get("all_to_all_bytes"),
        "by_axis": analytic["by_axis"],
        "target_platform": target["platform"],
        "target_comm_bytes": sum(target["by_axis"].values()),
    }


def _ratio(rows: list[dict]) -> tuple[float, float | None]:
    # like with like: the plan as the HLO reading counts it (`jaxpar.analysis.planner.compiled.compare_collectives`)
    planned = sum(r.get("planned_hlo_bytes", r["planned_bytes"]) for r in rows)
    got = sum(r["compiled_bytes"] for r in rows)
    return got, got / planned if planned else None


def _compiled_summary(compiled: dict) -> dict:
    ma = compiled["memory_analysis"]
    rows = compiled["collectives"]
    got, ratio = _ratio(rows)
    part = compiled.get("partitioned")
    part_got, part_ratio = _ratio(part["collectives"]) if part else (None, None)
    return {
        "params_plus_opt_state": compiled["state"]["params_plus_opt_state"],
        "state_ratio": compiled["state"]["ratio"],
        "temp_bytes": ma["temp_bytes"],
        "peak_bytes": ma["peak_bytes"],
        "comm_bytes": got,
        "comm_ratio": ratio,
        "partitioned_comm_bytes": part_got,
        "partitioned_comm_ratio": part_ratio,
        "collectives": [{k: r[k] for k in ("key", "planned_bytes", "compiled_bytes", "ratio")} for r in rows],
    }


def _subprocess(sweep: Sweep, point: dict) -> tuple[int, str, str]:
    n = point["devices"]
    if sweep.target is not None:  # compiled for the GPU cluster (jaxpar.analysis.sweep.gpu)
        cmd, extra = target_command(
            sweep.base, [*sweep.overrides, *point["overrides"]], sweep.target, sweep.budget_bytes
        )
        proc = subprocess.run(
            cmd, check=False, capture_output=True, text=True, timeout=sweep.timeout_s, env={**os.environ, **extra}
        )
        return proc.returncode, proc.stdout, proc.stderr
    cmd = [
        sys.executable,
        "-m",
        "jaxpar.cli.plan",
        sweep.base,
        *sweep.overrides,
        *point["overrides"],
        "--devices",
        str(n),
        "--json",
        "--compile",
        "--platform",
        sweep.platform,
    ]
    cmd += ["--fast-compile"] if sweep.fast_compile else []
    cmd += ["--measure-steps", str(sweep.measure_steps)] if sweep.measure_steps else []
    cmd += ["--memory-budget-gb", repr(sweep.budget_bytes / GB)] if sweep.budget_bytes else []
    env = dict(os.environ)
    if sweep.real_devices:
        cmd.append("--real-devices")
    else:  # simulated CPU devices: the count must be set before jax starts, hence a fresh process
        env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(n))
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=sweep.timeout_s, env=env)
    return proc.returncode, proc.stdout, proc.stderr


def run_point(sweep: Sweep, point: dict, runner: Callable[[Sweep, dict], tuple[int, str, str]] = _subprocess) -> dict:
    """Plans one point and, if the sweep asks and it fits the budget, compiles (and times) it in a subprocess.

    Returns the point with "status" (ok | over_budget | invalid | failed), "error" (message or None),
    "planned" (analytic summary, bytes per device), "compiled" and "measured" (on simulated CPU devices or the
    real ones), "gpu_compiled" (for the sweep's `target`, `jaxpar.analysis.sweep.gpu.gpu_summary`) (each None when not
    done) and "seconds" (wall time of this point).
    """
    from jaxpar.analysis.planner.plan import plan

    t0 = time.perf_counter()
    rec = {
        **point,
        "status": "ok",
        "error": None,
        "planned": None,
        "compiled": None,
        "measured": None,
        "gpu_compiled": None,
    }
    try:  # errors name the base config's file or the sweep's override that set each key
        cfg, sources = load_config_with_sources(
            sweep.base, [*sweep.overrides, *point["overrides"]], overrides_are="the sweep's override"
        )
        try:
            cfg = resolve_config(cfg, point["devices"])
        except ConfigError as e:
            raise sources.explain(e) from e
    except ConfigError as e:
        return {**rec, "status": "invalid", "error": str(e), "seconds": time.perf_counter() - t0}
    run = sweep.compile or sweep.measure_steps > 0
    target = plan(cfg, sweep.platform)
    on_cpu = run and not sweep.real_devices and sweep.target is None  # compiled on simulated CPU devices
    analytic = plan(cfg, "cpu") if on_cpu else target
    rec["planned"] = _planned_summary(analytic, target)
    budget = sweep.budget_bytes
    if budget is not None and analytic["memory"]["peak_estimate"] > budget:
        rec.update(
            status="over_budget",
            error=f"skipped: over budget (planned peak "
            f"{analytic['memory']['peak_estimate']:,.0f} B > {budget:,.0f} B per device)",
        )
    elif run:
        try:
            code, stdout, stderr = runner(sweep, point)
        except subprocess.TimeoutExpired:
            code, stdout, stderr = -1, "", f"timed out after {sweep.timeout_s:g} s (timeout_s)"
        lines = [line for line in stdout.splitlines() if line.strip()]
        if code != 0 or not lines:
            tail = "\n".join(stderr.strip().splitlines()[-5:]) or f"exit status {code}"
            rec.update(status="invalid" if code == 2 else "failed", error=tail)
        else:
            out = json.loads(lines[-1])
            if sweep.target is not None:
                rec["gpu_compiled"] = gpu = gpu_summary(out["gpu_compiled"])
                compiled_peak, what = gpu["peak_bytes"], f"GPU-compiled peak for {sweep.target}"
            else:
                rec["compiled"] = _compiled_summary(out["compiled"])
                rec["measured"] = out["measured"]
                compiled_peak, what = rec["compiled"]["peak_bytes"], "compiled peak"
            if out["over_budget"]:
                rec.update(
                    status="over_budget",
                    error=f"skipped: over budget ({what} {compiled_peak:,} B > "
                    f"{budget:,.0f} B per device); not measured",
                )
            elif sweep.target is not None and not gpu["fits"]:
                rec.update(
                    status="over_budget",
                    error=f"does not fit: {what} {compiled_peak:,} B = "
                    f"{gpu['fraction_of_memory']:.0%} of the {gpu['memory_bytes']:,} B of one "
                    f"{gpu['device_kind']}",
                )
    rec["seconds"] = time.perf_counter() - t0
    return rec


def _write_json(path: str, data: dict) -> None:
    write_atomic(path, json.dumps(data, indent=1))  # an interrupted sweep never leaves half a results.json


def load_results(path: str, sweep: Sweep) -> dict[str, dict]:
    """Earlier records of this sweep in results.json, by point key ({} if the file does not exist).

    Raises:
      SweepError: the file is not a results.json of jaxpar-sweep, or was written for another base config.
    """
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        records = data["points"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SweepError(f"{path} is not a jaxpar-sweep results file ({e}); delete it or pick another --out") from e
    if data.get("base") != sweep.base:
        raise SweepError(f"{path} holds results for base {data.get('base')!r}, not {sweep.base!r}; pick another --out")
    saved, now = data.get("settings", {}), _settings(sweep)
    changed = [f"{k} {saved.get(k)!r} -> {v!r}" for k, v in now.items() if saved.get(k) != v]
    if changed:
        raise SweepError(
            f"{path} holds results measured with other settings ({'; '.join(changed)}); finished "
            f"points would not be comparable: pick another --out, or delete it to start over"
        )
    return {r["key"]: r for r in records}


def _settings(sweep: Sweep) -> dict:
    """What each point's numbers depend on besides its overrides (a resumed sweep must match them)."""
    return {
        "measure_steps": sweep.measure_steps,
        "compile": sweep.compile,
        "fast_compile": sweep.fast_compile,
        "real_devices": sweep.real_devices,
        "platform": sweep.platform,
        "target": sweep.target,
    }


def _target_header(name: str | None) -> dict | None:
    if name is None:
        return None
    from jaxpar.analysis.gpu.targets import parse_cluster
    from jaxpar.analysis.sweep.gpu import target_header

    return target_header(parse_cluster(name))


def run_sweep(
    sweep: Sweep,
    out_dir: str,
    log: Callable[[str], None] = print,
    runner: Callable[[Sweep, dict], tuple[int, str, str]] = _subprocess,
) -> list[dict]:
    """Runs every point not finished earlier, rewriting out_dir/results.json and results.md after each and
    drawing plot.png at the end (`jaxpar.analysis.sweep.report`); without matplotlib (the `plot` extra) it says
    so before the first point and draws no plot. Returns the records in point order.

    `runner(sweep, point) -> (exit status, stdout, stderr)` compiles/measures one point (default: a
    `python -m jaxpar.cli.plan ... --json` subprocess).

    Raises:
      SweepError: a foreign results.json or an out_dir that cannot be created.
      jaxpar.analysis.gpu.deviceless.GpuCompileUnavailable: a `target` with `compile: true` where jax's CUDA plugin is
      missing (the message names the extra to install); raised before any point, with out_dir untouched.
    """
    if sweep.target is not None and sweep.compile:
        reason = plugin_missing(sweep.target)
        if reason is not None:
            from jaxpar.analysis.gpu.deviceless import GpuCompileUnavailable

            raise GpuCompileUnavailable(reason)

    plot = installed("matplotlib")
    if not plot:
        log(f"plot.png is skipped: {missing_message('matplotlib', PLOT_FEATURE)}")
    problem = output_dir_problem(out_dir, keep_created=True)  # a file in the way, a read-only parent, ...
    if problem is not None:
        raise SweepError(f"--out {out_dir!r} {problem}; pick another --out, a directory you can write")
    path = os.path.join(out_dir, "results.json")
    records = load_results(path, sweep)
    todo = points(sweep)
    header = {
        "sweep": os.path.abspath(sweep.path),
        "base": sweep.base,
        "objective": sweep.objective,
        "budget_bytes": sweep.budget_bytes,
        "measure_steps": sweep.measure_steps,
        "settings": _settings(sweep),
        "target": _target_header(sweep.target),
    }

    def ordered() -> list[dict]:
        return [records[p["key"]] for p in todo if p["key"] in records]

    for i, point in enumerate(todo, 1):
        label = f"[{i}/{len(todo)}] {' '.join(point['overrides'])}"
        old = records.get(point["key"])
        if old and old["status"] in DONE:
            log(f"{label}: done earlier ({old['status']}), skipped")
            continue
        rec = run_point(sweep, point, runner)
        records[point["key"]] = rec
        _write_json(path, {**header, "points": ordered()})
        write_markdown(os.path.join(out_dir, "results.md"), header, ordered())
        log(
            f"{label}: {rec['status']}{': ' + rec['error'].splitlines()[-1] if rec['error'] else ''} "
            f"({rec['seconds']:.1f} s)"
        )
    _write_json(path, {**header, "points": ordered()})
    write_markdown(os.path.join(out_dir, "results.md"), header, ordered())
    if plot:
        write_plot(os.path.join(out_dir, "plot.png"), header, ordered())
    return ordered()
