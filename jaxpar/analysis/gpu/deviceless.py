"""The real train step compiled for a GPU cluster on a machine without GPUs (deviceless ahead-of-time compilation).

jax's CUDA plugin (the gpu-compile extra, `pip install 'jaxpar[gpu-compile]'`) builds compile-only devices from a
target description (`jaxpar.analysis.gpu.targets`) and a topology, without a GPU or a driver:

    devices = topologies.get_topology_desc(platform="cuda", target_config=text, topology="1x8x8").devices

The step is then lowered on a mesh over those devices with abstract (ShapeDtypeStruct) state and batch carrying
their `NamedSharding`s, as `jaxpar.analysis.planner.compiled` does on simulated CPU devices, and XLA's GPU compiler (the
same passes, scheduler and buffer assignment as on the cluster; ptxas from the extra turns the kernels into
cubins) gives the executable's per-device memory analysis and optimized HLO. Nothing runs.

The jax process must not try to start a CUDA backend: with the plugin installed, jax on a machine without a
driver fails the plugin's CUDA checks and never registers it, unless `JAX_PLATFORMS=cpu` (or
`JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`) is set before jax initialises its backends. The compile-only devices' platform
is `gpu`, so the step plan resolves `precision.compute_dtype: auto` (bfloat16) and `model.attention: auto` (cuDNN
where it can run) as on the cluster (`jaxpar.training.plan.build_plan`), not as the CPU process would.

jax decides from the local GPU whether cuDNN's fused attention takes heads wider than 128 (Hopper and newer: 256)
and the packed layout; the step is traced with those checks answering for the target's compute capability
(`jaxpar.parallel.jax_private.cudnn_compute_capability`), as on the cluster.

Differences from the cluster's own compile: no autotuning (no device to time kernels on), so GEMM fusions use
the compiler's default tile configurations; their scratch may differ a little from an autotuned build.
"""

from __future__ import annotations

import importlib.metadata
import math
import re
import time

from jaxpar.analysis.gpu.targets import Cluster
from jaxpar.analysis.gpu.targets import cluster as make_cluster
from jaxpar.analysis.hlo import overlap
from jaxpar.analysis.hlo.gemms import gemm_flops_by_format, gemm_kernels
from jaxpar.analysis.hlo.text import compiled_hlo_text
from jaxpar.config.extras import install_command
from jaxpar.config.schema import Config

EXTRA = install_command("gpu-compile")
# jax's CUDA PJRT plugin distributions; either provides the "cuda" platform's compile-only topology.
CUDA_PLUGIN_DISTRIBUTIONS = ("jax-cuda12-plugin", "jax-cuda13-plugin")
# An HLO instruction whose result is one array and whose opcode is dot: (dtype, dims, the rest of the line).
_DOT = re.compile(r"=\s*([a-z]+\d*)\[([\d,]+)\]\S*\s+dot\((.*)$", re.MULTILINE)
# Any instruction with one array result whose op_name names one of the einsums of jax's XLA attention
# (jax.nn.dot_product_attention: logits "BTNH,BSNH->BNTS", context "BNTS,BSNH->BTNH", and their transposes) or of
# jaxpar's soft-capped attention (`jaxpar.model.attention._xla_softcapped`: "btgrk,bsgk->bgrts", "bgrts,bsgk->btgrk").
_ATTENTION_OP = re.compile(
    r"=\s*([a-z]+\d*)\[([\d,]+)\]\S*\s+[\w.-]+\(.*op_name=\"[^\"]*"
    r"(?:BTNH,BSNH->BNTS|BNTS,BSNH->BTNH|btgrk,bsgk->bgrts|bgrts,bsgk->btgrk)",
    re.MULTILINE,
)
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


class GpuCompileUnavailable(RuntimeError):
    """The deviceless GPU compile cannot run in this environment (the message says what to install or set)."""


def cuda_plugin_version() -> str:
    """The installed CUDA plugin's version (`CUDA_PLUGIN_DISTRIBUTIONS`), checked against jaxlib's.

    Raises:
      GpuCompileUnavailable: no CUDA plugin installed, or one of another version than jaxlib (the message names
        the extra to install).
    """
    try:
        jaxlib_version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        jaxlib_version = None
    for dist in CUDA_PLUGIN_DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        if jaxlib_version is not None and version != jaxlib_version:
            raise GpuCompileUnavailable(
                f"{dist} {version} does not match jaxlib {jaxlib_version}; install the plugin of jaxlib's version: "
                f"{EXTRA}"
            )
        return version
    raise GpuCompileUnavailable(
        f"compiling for a GPU cluster needs jax's CUDA plugin (no GPU needed), which is not installed: {EXTRA} "
        f"(about 2.7 GB: the CUDA plugin of the installed jax's version, ptxas and cuDNN)"
    )


def unavailable_reason() -> str | None:
    """Why the deviceless GPU compile cannot run here (what to install), or None when it can."""
    try:
        cuda_plugin_version()
    except GpuCompileUnavailable as e:
        return str(e)
    return None


def compile_devices(clu: Cluster) -> list:
    """The cluster's compile-only jax devices (`clu.devices` of them, device_kind = the target's).

    Raises:
      GpuCompileUnavailable: no (matching) CUDA plugin; the plugin did not register because jax tried to start
        CUDA (set JAX_PLATFORMS=cpu before jax starts).
      ValueError: the plugin refused the target description (the message carries XLA's reason).
    """
    cuda_plugin_version()
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=clu.target.text, topology=clu.topology)
    except NotImplementedError as e:
        raise GpuCompileUnavailable(
            f"jax's CUDA plugin is installed but not registered ({e}): on a machine without a usable GPU driver "
            f"set JAX_PLATFORMS=cpu (or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1) before jax starts"
        ) from e
    except Exception as e:  # jax's JaxRuntimeError: the description or topology was refused
        raise ValueError(f"the CUDA plugin refused target {clu.target.name!r} topology {clu.topology}: {e}") from e
    devices = list(topo.devices)
    if len(devices) != clu.devices:
        raise RuntimeError(f"topology {clu.topology} gave {len(devices)} devices, expected {clu.devices}")
    return devices


def _batch_dims(dot_operands: str) -> int:
    found = re.search(r"lhs_batch_dims=\{([\d,]*)\}", dot_operands)
    return len([d for d in found.group(1).split(",") if d]) if found else 0


def attention_scores(hlo_text: str, seq_len: int) -> dict:
    """The attention score tensors the program materialises: arrays of rank >= 3 ending in [.., seq_len, seq_len]
    that are results of batched matmuls over batch and heads (`dot` with at least two batch dimensions; QK^T
    and, in the backward, dO V^T: a projection's weight gradient [K, D, T] has one, and ends in [T, T] when
    D = T) or of instructions whose op_name is one of jax's XLA-attention einsums (with grouped key/value heads
    the logits come out of a fusion, not a bare dot). XLA's attention path writes them to memory; a fused
    attention kernel (cuDNN) keeps them on chip, so none appear. Shapes alone would not do: with seq_len ==
    d_model (Llama 7B at 4096) the layer scan's stacked block inputs [L, b, T, D] end in [T, T] too.

    Returns:
      {"materialised" (any found), "shapes" (sorted distinct "dtype[dims]"), "largest_bytes" (the biggest, per
       device)}.
    """
    from jaxpar.analysis.hlo.collectives import Array

    shapes, largest = set(), 0
    found = [(dtype, dims) for dtype, dims, rest in _DOT.findall(hlo_text) if _batch_dims(rest) >= 2]
    found += _ATTENTION_OP.findall(hlo_text)
    for dtype, dims in found:
        shape = tuple(int(x) for x in dims.split(","))
        if len(shape) >= 3 and shape[-2:] == (seq_len, seq_len):
            shapes.add(f"{dtype}[{dims}]")
            largest = max(largest, int(Array(dtype, shape).bytes))
    return {"materialised": bool(shapes), "shapes": sorted(shapes), "largest_bytes": largest}


def overlap_report(hlo_text: str) -> dict:
    """Which collectives of the scheduled GPU HLO run under compute (`jaxpar.analysis.hlo.overlap`):
    {"by_kind": {kind: {"count", "overlapped", "under_gemm"}}, "pipeline_permutes": [{"trips", "direction",
    "name", "compute", "gemms"}, ...] (the permutes of the pipeline's tick loops, in schedule order)}."""
    rows = overlap.async_collectives(hlo_text)
    return {
        "by_kind": overlap.summary(rows),
        "pipeline_permutes": [
            {"trips": r.trips, "direction": r.direction, "name": r.name, "compute": r.compute, "gemms": r.gemms}
            for r in overlap.pipeline_permutes(rows)
        ],
    }


def gemm_report(hlo_text: str) -> dict:
    """{"kernels": {kind: count} (`jaxpar.analysis.hlo.gemms.gemm_kernels`: cuBLAS targets and GEMM fusion kinds,
    ` fp8` marking those on FP8 operands), "fp8_flops", "other_flops": GEMM FLOPs per step of the busiest device
    in FP8 and in any other format (`gemm_flops_by_format`; None where a loop's trip count or a conditional's
    branch cannot be read, as in the zero-bubble schedules' slot switch)}."""
    fp8: float | None
    other: float | None
    try:
        flops = gemm_flops_by_format(hlo_text)
        fp8, other = max(flops["fp8"]), max(flops["other"])
    except ValueError:
        fp8 = other = None
    return {"kernels": gemm_kernels(hlo_text), "fp8_flops": fp8, "other_flops": other}


def compile_for_gpu(
    cfg: Config,
    target: str,
    nodes: int,
    gpus_per_node: int,
    compiler_options: dict | None = None,
    keep_hlo: bool = False,
) -> dict:
    """Compiles the train step of `cfg` for `nodes` x `gpus_per_node` GPUs of `target` (module docstring) and
    reads what the GPU compiler decided. Bytes are per device; the batch is `cfg.train.global_batch_size` rows
    of `cfg.data.seq_len` tokens, split as the step splits it.

    Args:
      cfg: config (resolved here for the cluster's device count; the plan resolves `compute_dtype: auto` to
        bfloat16 from the GPU devices).
      target: a `jaxpar.analysis.gpu.targets` name ("h100", "h200", "a100", "b200").
      nodes, gpus_per_node: the cluster's shape (the mesh spans nodes * gpus_per_node devices).
      compiler_options: XLA options for `compile()` (default none).
      keep_hlo: also return the optimized HLO text under "hlo".

    Returns:
      {"cluster" ("h100:8x8"), "target", "device_kind", "devices", "mesh" (axis -> size), "compute_dtype",
       "compile_seconds",
       "memory": {"argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "generated_code_bytes",
         "peak_bytes" (XLA's peak; arguments + outputs - aliased + temporaries where it gives none)},
       "memory_bytes" (the target's, per GPU), "usable_bytes" (the share a jax process may use,
       `jaxpar.analysis.gpu.targets.MEMORY_FRACTION` of it), "fraction_of_memory" (peak / memory_bytes),
       "fits" (peak <= usable_bytes),
       "collectives": {"axes kind": {"count", "bytes"}} of the optimized GPU HLO per step (ring bytes per device,
         `jaxpar.analysis.planner.compiled.hlo_collectives`, built on
         `jaxpar.analysis.hlo.collectives.collectives_by_axis`' accounting),
       "scalars": the 0-d collectives (see `hlo_collectives`),
       "fused_attention": sorted cuDNN fused-attention custom-call targets in the HLO (empty: XLA's attention),
       "attention_scores": `attention_scores(hlo, seq_len)`,
       "overlap": `overlap_report(hlo)`: which asynchronous collectives run under compute,
       "gemms": `gemm_report(hlo)`: the GEMM kernels and their FLOPs by number format (FP8 or not),
       "planned": {"peak_bytes" (`jaxpar.analysis.planner.plan.plan(cfg, "gpu")` peak_estimate),
         "ratio" (compiled / planned), "collectives" (`jaxpar.analysis.planner.compiled.compare_collectives` rows:
         the GPU HLO's beside the plan's)}}.

    Raises:
      GpuCompileUnavailable: the CUDA plugin is missing, mismatched or not registered (before any compile).
      ValueError: unknown target, bad node/GPU counts, or a description the plugin refuses.
      ConfigError: the config does not fit the device count (mesh product, divisibility).
      RuntimeError: the compiler gives no memory analysis.
    """
    import jax.numpy as jnp

    from jaxpar.analysis.planner.compiled import compare_collectives, hlo_collectives
    from jaxpar.analysis.planner.plan import plan as analytic_plan
    from jaxpar.config.validate import resolve_config
    from jaxpar.data.batch import abstract_batch
    from jaxpar.parallel.jax_private import cudnn_compute_capability
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.training.compiled_memory import memory_analysis_bytes
    from jaxpar.training.plan import build_plan
    from jaxpar.training.state import abstract_state
    from jaxpar.training.step import make_train_step

    clu = make_cluster(target, nodes, gpus_per_node)
    cfg = resolve_config(cfg, clu.devices)
    devices = compile_devices(clu)
    mesh = build_mesh(cfg, devices)
    plan = build_plan(cfg, mesh)
    state = abstract_state(plan)
    t = cfg.data.seq_len
    batch = abstract_batch(cfg.train.global_batch_size, t, plan.batch_sharding)
    t0 = time.perf_counter()
    with cudnn_compute_capability(clu.target.compute_capability):  # jax asks the local GPU, which there is not
        lowered = make_train_step(plan).lower(state, batch)
    compiled = lowered.compile(compiler_options or {})
    seconds = time.perf_counter() - t0
    analysis = memory_analysis_bytes(compiled)
    if analysis is None:
        raise RuntimeError("the CUDA compiler gave no memory_analysis() for the compiled step")
    memory = {
        k: analysis[k] for k in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "generated_code_bytes")
    }
    memory["peak_bytes"] = analysis["xla_peak_bytes"] or analysis["peak_bytes"]
    hlo = compiled_hlo_text(compiled)
    coll = hlo_collectives(hlo, mesh)
    analytic = analytic_plan(cfg, "gpu")
    planned = analytic["memory"]["peak_estimate"]
    out = {
        "cluster": clu.name,
        "target": clu.target.name,
        "device_kind": clu.target.device_kind,
        "devices": clu.devices,
        "mesh": dict(mesh.shape),
        "compute_dtype": jnp.dtype(plan.compute_dtype).name,
        "compile_seconds": seconds,
        "memory": memory,
        "memory_bytes": clu.target.memory_bytes,
        "usable_bytes": clu.target.usable_bytes,
        "fraction_of_memory": memory["peak_bytes"] / clu.target.memory_bytes,
        "fits": memory["peak_bytes"] <= clu.target.usable_bytes,
        "collectives": coll["by_axis"],
        "scalars": coll["scalars"],
        "fused_attention": sorted({c for c in _CUSTOM_CALL.findall(hlo) if "fmha" in c.lower()}),
        "attention_scores": attention_scores(hlo, t),
        "overlap": overlap_report(hlo),
        "gemms": gemm_report(hlo),
        "planned": {
            "peak_bytes": planned,
            "ratio": memory["peak_bytes"] / planned if planned else math.nan,
            "collectives": compare_collectives(coll["by_axis"], analytic),
        },
    }
    if keep_hlo:
        out["hlo"] = hlo
    return out
