"""`jaxpar-plan CONFIG [section.key=value ...]`: per-device memory and per-step communication of a config.

Examples:
  jaxpar-plan configs/tiny.yaml                      # analytic plan for 8 devices (mesh.fsdp=-1 fills them)
  jaxpar-plan configs/llama_7b.yaml --devices 64 mesh.tensor=8 mesh.fsdp=-1
  jaxpar-plan configs/tiny.yaml --compile            # + XLA's memory analysis and HLO collectives, with ratios
  jaxpar-plan configs/tiny.yaml mesh.data=8 mesh.fsdp=1 mesh.tensor=1 --compile --json
  jaxpar-plan configs/tiny.yaml mesh.fsdp=4 --compile --target h100:2x8   # for 2 nodes x 8 H100s, no GPU needed
  jaxpar-plan --exercise-13b                         # the seed exercise: 13B under DDP, ZeRO-1/2/3 on 8 devices

The analytic plan is arithmetic on the config (jaxpar.analysis.planner.plan): no devices needed, any --devices N.
--platform (gpu, tpu or cpu; default gpu) is the machine planned for, stated in the output ("planned for
platform ..."; JSON "platform"): it resolves `precision.compute_dtype: auto` (float32 on cpu, else bfloat16) and
the width of collectives (gpu, tpu: the partitioned program's dtypes, bf16 stays bf16; cpu: what XLA:CPU
compiles, every bf16 collective widened to fp32).
--compile lowers and compiles the real train step ahead of time on N simulated CPU devices (the count is set
before jax is imported) and compares like with like: the CPU executable with the plan for cpu (compute_dtype
auto = float32), and the partitioned program (the HLO after XLA's SPMD partitioner, before any backend pass)
with the plan for --platform (gpu when --platform cpu) at the compute dtype compiled; JSON "compiled" and
"compiled.partitioned".
--target KIND:NODESxGPUS (e.g. h100:8x8: 8 nodes of 8 H100s; kinds a100, b200, h100, h200; jaxpar.analysis.gpu.targets)
plans for platform gpu on that many devices and states the target's memory; with --compile it compiles the real
step for that cluster with XLA's GPU compiler on this machine, without GPUs (jaxpar.analysis.gpu.deviceless; needs the
gpu-compile extra: pip install 'jaxpar[gpu-compile]') and prints per-device argument, temporary and peak bytes,
the GPU HLO's collectives per mesh axis and kind beside the plan's, fused attention (cuDNN) and materialised
attention scores, and whether the peak fits the GPU's memory (JSON "target", "gpu_compiled"). The device count
follows from the cluster (--devices, if given, must equal it); --platform, --real-devices, --fast-compile and
--measure-steps do not apply.
--measure-steps K also runs K steps on random tokens (tokens/s, MFU where the device's peak is known).
--exercise-13b: P = 13e9, 16P layout, N = 8: DDP 208 GB, ZeRO-1 71.5 GB, ZeRO-2 48.75 GB, ZeRO-3 26 GB; smallest N
with ZeRO-3 state <= 24 GB = 9; and what activations add, for the shape of CONFIG (default configs/llama_13b.yaml).
Exit status: 0 ok, 2 bad arguments or config (the message names the key and the fix), 1 compile/run failure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

from jaxpar.config.mesh_axes import mesh_sizes
from jaxpar.config.precision import PLATFORMS

# Only jax-free modules at the top: the device count is set before jax starts.
from jaxpar.log import GB

PROG = "jaxpar-plan"
DEFAULT_DEVICES = 8
# jaxpar/configs links to the repository's configs/ and is shipped as package data (pyproject.toml), so the
# exercise finds its config in a source checkout, an editable install and a wheel alike.
EXERCISE_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "llama_13b.yaml")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="YAML config, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides such as mesh.fsdp=4 optimizer.zero_stage=3")
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help=f"devices to plan for (default: the mesh's product, or {DEFAULT_DEVICES} if an axis is -1)",
    )
    p.add_argument("--compile", action="store_true", help="compile the step on N simulated CPU devices and compare")
    p.add_argument(
        "--fast-compile",
        action="store_true",
        help="with --compile: skip XLA:CPU fusion emitters and LLVM passes (3x faster; same state bytes "
        "and collectives, temp may differ by a few percent; --measure-steps then times that code)",
    )
    p.add_argument("--measure-steps", type=int, default=0, help="also run K steps and time them (implies --compile)")
    p.add_argument(
        "--memory-budget-gb",
        type=float,
        default=None,
        help="per-device budget (1e9 bytes); if the planned or compiled peak exceeds it, --measure-steps is skipped",
    )
    p.add_argument(
        "--target",
        default=None,
        metavar="KIND:NODESxGPUS",
        help="GPU cluster, e.g. h100:8x8 (8 nodes of 8 H100s): plan for it and, with --compile, compile "
        "for it without its GPUs (needs the gpu-compile extra)",
    )
    p.add_argument(
        "--platform",
        default=None,
        choices=PLATFORMS,
        help="machine planned for (default gpu): resolves compute_dtype auto and the width of "
        "collectives (cpu: bf16 collectives widened to fp32 as XLA:CPU compiles them); "
        "with --compile the CPU executable is compared with the plan for cpu and the "
        "partitioned program with the plan for this platform",
    )
    p.add_argument(
        "--real-devices",
        action="store_true",
        help="compile/measure on jax's default devices instead of simulated CPU devices",
    )
    p.add_argument("--exercise-13b", action="store_true", help="print the seed exercise (see above)")
    p.add_argument("--budget-gb", type=float, default=24.0, help="budget of --exercise-13b, GB (default 24)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p.parse_intermixed_args(argv)


def _fail(msg: str, code: int = 2) -> int:
    print(f"{PROG}: {msg}", file=sys.stderr)
    return code


def _set_devices(n: int, argv: list[str], real: bool) -> int | None:
    """Make N jax devices available before jax starts; returns an exit code when a subprocess did the work."""
    if real:
        return None
    if "jax" not in sys.modules:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["JAX_NUM_CPU_DEVICES"] = str(n)
        return None
    import jax  # already imported (e.g. a test process): use its devices if there are enough CPU devices

    if jax.default_backend() == "cpu" and jax.device_count() >= n:
        return None
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(n))
    return subprocess.run([sys.executable, "-m", "jaxpar.cli.plan", *argv], check=False, env=env).returncode


def _exercise(args) -> int:
    from jaxpar.analysis.planner.plan import exercise_activations, zero_exercise
    from jaxpar.analysis.planner.report import format_exercise
    from jaxpar.config import ConfigError, load_config

    path = args.config or EXERCISE_CONFIG
    try:
        cfg = load_config(path, args.overrides, validate=False)
        ex = zero_exercise(13e9, args.devices or DEFAULT_DEVICES, args.budget_gb * GB, "16p")
    except (ConfigError, ValueError) as e:
        return _fail(f"config error: {e}")
    shown = os.path.relpath(path) if args.config else "configs/llama_13b.yaml"
    acts = {"config": shown, **exercise_activations(cfg, ex)}
    print(json.dumps({"exercise": ex, "activations": acts}) if args.json else format_exercise(ex, acts))
    return 0


def gpu_cluster(args: argparse.Namespace):
    """The `jaxpar.analysis.gpu.targets.Cluster` of --target (None without it), checked against the other flags.

    Imports jax (through jaxpar.analysis.gpu.targets): with --target, call it after `_deviceless()`.

    Raises:
      ValueError: not KIND:NODESxGPUS or an unknown kind; --devices other than the cluster's GPU count; a flag
        that does not apply to a GPU target (the message names it and the fix).
    """
    if args.target is None:
        return None
    from jaxpar.analysis.gpu.targets import parse_cluster

    try:
        clu = parse_cluster(args.target)
    except ValueError as e:
        raise ValueError(f"--target {args.target}: {e}") from e
    if args.devices is not None and args.devices != clu.devices:
        raise ValueError(
            f"--devices {args.devices} conflicts with --target {clu.name} ({clu.nodes} x "
            f"{clu.gpus_per_node} = {clu.devices} GPUs): the device count follows from the cluster; "
            f"drop --devices or change the cluster"
        )
    if args.platform not in (None, "gpu"):
        raise ValueError(
            f"--platform {args.platform} with --target {clu.name}: a GPU cluster is planned for "
            f"platform gpu; drop --platform"
        )
    for flag, why in (
        ("real_devices", "compiles on this machine's devices, --target for GPUs it does not have"),
        ("fast_compile", "sets XLA:CPU options; the GPU compiler takes none"),
        ("measure_steps", "runs steps, which needs the GPUs; --target only compiles"),
        ("exercise_13b", "is the fixed seed exercise"),
    ):
        if getattr(args, flag):
            raise ValueError(
                f"--{flag.replace('_', '-')} does not apply with --target {clu.name}: it {why}; use one or the other"
            )
    return clu


def _deviceless() -> None:
    """A compile-only GPU topology needs jax to start without trying CUDA (jaxpar.analysis.gpu.deviceless): set before
    jax starts; a process that already imported jax keeps its platforms (the compile then says what to set)."""
    if "jax" not in sys.modules:
        os.environ["JAX_PLATFORMS"] = "cpu"


def _devices(args, cfg, clu=None) -> int:
    if clu is not None:
        return clu.devices
    if args.devices is not None:
        return args.devices
    sizes = list(mesh_sizes(cfg.mesh).values())
    if -1 in sizes:
        if not args.json:
            print(f"(--devices not given: planning for {DEFAULT_DEVICES} devices; pass --devices N)")
        return DEFAULT_DEVICES
    return math.prod(sizes)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
    except SystemExit as e:  # argparse already printed the usage and the problem
        return int(e.code or 0)
    clu = None
    if args.target is not None:
        _deviceless()
        try:
            clu = gpu_cluster(args)
        except ValueError as e:
            return _fail(str(e))
        if args.compile:
            from jaxpar.analysis.gpu.deviceless import GpuCompileUnavailable, cuda_plugin_version

            try:
                cuda_plugin_version()
            except GpuCompileUnavailable as e:
                return _fail(f"--compile --target {clu.name}: {e}")
    args.platform = args.platform or "gpu"
    if args.exercise_13b:
        return _exercise(args)
    if not args.config:
        return _fail("give a CONFIG file (e.g. configs/tiny.yaml) or --exercise-13b")
    if args.devices is not None and args.devices < 1:
        return _fail(f"--devices must be >= 1, got {args.devices}")
    if args.measure_steps < 0:
        return _fail(f"--measure-steps must be >= 0, got {args.measure_steps}")
    from jaxpar.config import (  # no jax import here
        ConfigError,
        load_config_with_sources,
        resolve_config,
    )
    from jaxpar.config.attention import PLANNED_GPU_CAPABILITY, resolve_attention
    from jaxpar.config.precision import resolve_compute_dtype
    from jaxpar.config.sources import COMMAND_LINE

    compiles_here = (args.compile or args.measure_steps > 0) and not args.real_devices and clu is None
    try:
        cfg, sources = load_config_with_sources(args.config, args.overrides, overrides_are=COMMAND_LINE)
    except ConfigError as e:
        return _fail(f"config error: {e}")
    try:
        n = _devices(args, cfg, clu)
        cfg = resolve_config(cfg, n)
        # model.attention for the machine planned for (a GPU cluster, or this CPU when compiling here)
        where = "gpu" if clu is not None else "cpu" if compiles_here else args.platform
        dtype = resolve_compute_dtype(cfg.precision.compute_dtype, where)
        m = cfg.model
        capability = clu.target.compute_capability if clu is not None else PLANNED_GPU_CAPABILITY
        resolve_attention(m.attention, where, dtype, m.kernel_head_width, m.attention_softcap, capability)
        from jaxpar.model.params import model_def

        model_def(cfg.model)  # a registered family that takes the model's settings (abstract: no memory)
    except ValueError as e:  # a ConfigError, or resolve_attention's; named with the file or override of each key
        return _fail(f"config error: {sources.explain(e if isinstance(e, ConfigError) else ConfigError(str(e)))}")
    if clu is not None:
        from jaxpar.config.precision import check_fp8_capability

        if cfg.precision.fp8.enabled:
            try:
                check_fp8_capability(clu.target.device_kind, clu.target.compute_capability)
            except ConfigError as e:
                return _fail(f"config error: {e}")
        return _gpu_target(args, cfg, clu)
    compile_ = args.compile or args.measure_steps > 0
    if compile_:
        code = _set_devices(n, argv, args.real_devices)
        if code is not None:
            return code
    from jaxpar.analysis.planner.plan import plan
    from jaxpar.analysis.planner.report import format_plan

    platform = "cpu" if compile_ and not args.real_devices else args.platform
    analytic = plan(cfg, platform)
    budget = None if args.memory_budget_gb is None else args.memory_budget_gb * GB
    out = {
        "config": args.config,
        "overrides": args.overrides,
        "plan": analytic,
        "compiled": None,
        "measured": None,
        "over_budget": budget is not None and analytic["memory"]["peak_estimate"] > budget,
    }
    if compile_:
        from jaxpar.analysis.hlo.compile_options import FAST_COMPILER_OPTIONS
        from jaxpar.analysis.planner.compiled import (
            compile_step,
            compiled_plan,
            measure_steps,
        )

        try:
            step = compile_step(cfg, FAST_COMPILER_OPTIONS if args.fast_compile else None)
            target = "gpu" if args.platform == "cpu" else args.platform
            out["compiled"] = compiled = compiled_plan(cfg, analytic, step=step, target=target)
            peak = compiled["memory_analysis"]["peak_bytes"]
            out["over_budget"] = out["over_budget"] or (budget is not None and peak > budget)
            if args.measure_steps and not out["over_budget"]:
                out["measured"] = measure_steps(cfg, args.measure_steps, step=step)
        except ConfigError as e:
            return _fail(f"config error: {e}")
        except Exception as e:  # noqa: BLE001 -- a compile or run failure is reported, not a traceback
            return _fail(f"{'measuring' if out['compiled'] else 'compiling'} failed: {type(e).__name__}: {e}", 1)
    if args.json:
        print(json.dumps(out))
    else:
        title = " ".join([args.config, *args.overrides])
        print(format_plan(analytic, out["compiled"], out["measured"], title=title))
        if out["over_budget"]:
            print(f"  over budget: planned or compiled peak > {budget:,.0f} B per device; not measured")
    return 0


def _gpu_target(args, cfg, clu) -> int:
    """The plan for platform gpu on the cluster's devices, its target memory and (--compile) the GPU compile."""
    from jaxpar.analysis.planner.plan import plan
    from jaxpar.analysis.planner.report import format_gpu_target, format_plan
    from jaxpar.config import ConfigError

    analytic = plan(cfg, "gpu")
    peak = analytic["memory"]["peak_estimate"]
    mem = clu.target.memory_bytes
    target = {
        "cluster": clu.name,
        "target": clu.target.name,
        "device_kind": clu.target.device_kind,
        "devices": clu.devices,
        "memory_bytes": mem,
        "usable_bytes": clu.target.usable_bytes,
        "planned_peak_bytes": peak,
        "planned_fraction_of_memory": peak / mem,
        "planned_fits": peak <= clu.target.usable_bytes,
    }
    budget = None if args.memory_budget_gb is None else args.memory_budget_gb * GB
    out = {
        "config": args.config,
        "overrides": args.overrides,
        "plan": analytic,
        "target": target,
        "gpu_compiled": None,
        "compiled": None,
        "measured": None,
        "over_budget": budget is not None and peak > budget,
    }
    if args.compile:
        from jaxpar.analysis.gpu.deviceless import GpuCompileUnavailable, compile_for_gpu

        try:
            out["gpu_compiled"] = gpu = compile_for_gpu(cfg, clu.target.name, clu.nodes, clu.gpus_per_node)
        except (ConfigError, GpuCompileUnavailable) as e:
            return _fail(f"--compile --target {clu.name}: {e}")
        except Exception as e:  # noqa: BLE001 -- a compile failure is reported, not a traceback
            return _fail(f"compiling for {clu.name} failed: {type(e).__name__}: {e}", 1)
        out["over_budget"] = out["over_budget"] or (budget is not None and gpu["memory"]["peak_bytes"] > budget)
    if args.json:
        print(json.dumps(out))
    else:
        title = " ".join([args.config, *args.overrides])
        print(format_plan(analytic, title=title))
        print(format_gpu_target(target, out["gpu_compiled"]))
        if out["over_budget"]:
            print(f"  over budget: planned or compiled peak > {budget:,.0f} B per device")
    return 0


if __name__ == "__main__":
    sys.exit(main())
