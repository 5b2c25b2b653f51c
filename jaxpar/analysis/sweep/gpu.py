"""Sweeps for a GPU cluster (`target: KIND:NODESxGPUS` in a sweep file, `jaxpar.analysis.sweep.run`).

With a target every point is planned for platform gpu on the cluster's GPU count and, with `compile: true`,
compiled for that cluster by XLA's GPU compiler on this machine, without GPUs (`jaxpar.analysis.gpu.deviceless`), in a
fresh `python -m jaxpar.cli.plan ... --target CLUSTER --compile --json` subprocess per point (`JAX_PLATFORMS=cpu` in its
environment, so that jax does not try to start CUDA). Nothing can run: measured steps, real devices and XLA:CPU
options do not apply. This module checks those keys, says when the CUDA plugin is missing, and condenses the GPU
compile of one point (`gpu_summary`).
"""

from __future__ import annotations

import sys

from jaxpar.analysis.sweep.report import MEASURED_OBJECTIVES
from jaxpar.log import GB


class SweepTargetError(ValueError):
    """A sweep-file key that conflicts with `target:` (the message names both keys and the fix)."""


def parse_target(raw: dict):
    """The `jaxpar.analysis.gpu.targets.Cluster` of a sweep file's `target:` (None without one), checked against the
    other keys that a GPU target decides or excludes.

    Args:
      raw: the sweep file's top-level mapping (as read from YAML).

    Raises:
      SweepTargetError: `target` not a string of the form KIND:NODESxGPUS with a shipped kind (the message lists
        the kinds); `devices` other than the cluster's GPU count; a mesh of `meshes` spanning another count;
        `platform` other than gpu; `measure_steps` > 0 or a measured objective; `real_devices` or
        `fast_compile` true.
    """
    if "target" not in raw:
        return None
    from jaxpar.analysis.gpu.targets import parse_cluster, target_names

    text = raw["target"]
    if not isinstance(text, str):
        raise SweepTargetError(
            f"target: expected KIND:NODESxGPUS such as h100:8x8 (kinds: {', '.join(target_names())}), got {text!r}"
        )
    try:
        clu = parse_cluster(text)
    except ValueError as e:
        raise SweepTargetError(f"target: {e}") from e
    name, n = clu.name, clu.devices
    shape = f"{clu.nodes} x {clu.gpus_per_node} = {n} GPUs"
    platform = raw.get("platform", "gpu")
    if platform != "gpu":
        raise SweepTargetError(
            f"platform: {platform!r} with target: {name}: a GPU cluster is planned for platform "
            f"gpu; drop platform: (or target:)"
        )
    devices = raw.get("devices")
    if "devices" in raw and (isinstance(devices, bool) or devices != n):
        raise SweepTargetError(
            f"devices: {devices!r} conflicts with target: {name} ({shape}): the device count "
            f"follows from the cluster; drop devices: or change the cluster"
        )
    meshes = raw.get("meshes")
    for i, mesh in enumerate(meshes if isinstance(meshes, list) else []):
        sizes = list(mesh.values()) if isinstance(mesh, dict) else []
        if sizes and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
            span = 1
            for s in sizes:
                span *= s
            if span != n:
                raise SweepTargetError(
                    f"meshes[{i}]: {mesh} spans {span} devices, but target: {name} has {shape}; "
                    f"list meshes whose sizes multiply to {n}"
                )
    measure = raw.get("measure_steps", 0)
    if measure:
        raise SweepTargetError(
            f"measure_steps: {measure!r} with target: {name}: nothing can run without the "
            f"cluster's GPUs (a target only compiles); set measure_steps: 0, or drop target: to "
            f"time the steps on simulated CPU devices"
        )
    if raw.get("objective") in MEASURED_OBJECTIVES:
        raise SweepTargetError(
            f"objective: {raw['objective']} needs measured steps, which target: {name} cannot "
            f"run (it only compiles); use objective: memory or comm_bytes"
        )
    for key, why in (
        ("real_devices", "compiles on this machine's devices, target: for GPUs it does not have"),
        ("fast_compile", "sets XLA:CPU options; the GPU compiler takes none"),
    ):
        if raw.get(key):
            raise SweepTargetError(f"{key}: true does not apply with target: {name}: it {why}; drop one of them")
    return clu


def plugin_missing(cluster_name: str) -> str | None:
    """Why `compile: true` cannot compile for `cluster_name` here (`jaxpar.analysis.gpu.deviceless.unavailable_reason`,
    which names the extra to install), worded for a sweep file; None when the CUDA plugin is usable."""
    from jaxpar.analysis.gpu import deviceless as plan_gpu

    reason = plan_gpu.unavailable_reason()
    if reason is None:
        return None
    return (
        f"target: {cluster_name} with compile: true: {reason}; or set compile: false to plan the points "
        f"analytically, which needs no plugin"
    )


def target_command(
    base: str, overrides: list[str], cluster_name: str, budget_bytes: float | None
) -> tuple[list[str], dict]:
    """The per-point command line and the environment entries it needs: `python -m jaxpar.cli.plan BASE
    OVERRIDES --target CLUSTER --compile --json [--memory-budget-gb GB]` with `JAX_PLATFORMS=cpu`."""
    cmd = [sys.executable, "-m", "jaxpar.cli.plan", base, *overrides, "--target", cluster_name, "--compile", "--json"]
    cmd += ["--memory-budget-gb", repr(budget_bytes / GB)] if budget_bytes else []
    return cmd, {"JAX_PLATFORMS": "cpu"}


def gpu_summary(gpu: dict) -> dict:
    """One point's GPU compile (`jaxpar.analysis.gpu.deviceless.compile_for_gpu`'s result, JSON "gpu_compiled" of
    jaxpar-plan --target --compile) as the sweep records it. Bytes are per device.

    Returns:
      {"cluster", "device_kind", "compute_dtype", "argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
       "peak_bytes" (XLA's), "memory_bytes" (one GPU's), "fraction_of_memory", "fits" (both as compile_for_gpu
       decides them), "planned_peak_bytes" (the plan for gpu), "peak_ratio" (compiled / planned),
       "fused_attention" (cuDNN custom-call targets; [] = XLA's attention), "scores_materialised",
       "largest_scores_bytes", "comm_bytes" (the GPU HLO's collectives, bytes sent per device per step),
       "comm_ratio" (that / the plan for gpu), "collectives" (rows: "key", "planned_bytes", "compiled_bytes",
       "ratio", the counts), "compile_seconds"}.
    """
    mem, planned = gpu["memory"], gpu["planned"]
    rows = planned["collectives"]
    got = sum(r["compiled_bytes"] for r in rows)
    want = sum(r.get("planned_hlo_bytes", r["planned_bytes"]) for r in rows)  # like with like (compare_collectives)
    scores = gpu["attention_scores"]
    keys = ("key", "planned_bytes", "compiled_bytes", "ratio", "planned_count", "compiled_count")
    return {
        "cluster": gpu["cluster"],
        "device_kind": gpu["device_kind"],
        "compute_dtype": gpu["compute_dtype"],
        **{k: mem[k] for k in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes")},
        "memory_bytes": gpu["memory_bytes"],
        "fraction_of_memory": gpu["fraction_of_memory"],
        "fits": gpu["fits"],
        "planned_peak_bytes": planned["peak_bytes"],
        "peak_ratio": planned["ratio"],
        "fused_attention": list(gpu["fused_attention"]),
        "scores_materialised": scores["materialised"],
        "largest_scores_bytes": scores["largest_bytes"],
        "comm_bytes": got,
        "comm_ratio": got / want if want else None,
        "collectives": [{k: r[k] for k in keys} for r in rows],
        "compile_seconds": gpu["compile_seconds"],
    }


def target_header(cluster) -> dict:
    """What a sweep's outputs say about its cluster: {"cluster", "device_kind", "devices", "memory_bytes"}."""
    return {
        "cluster": cluster.name,
        "device_kind": cluster.target.device_kind,
        "devices": cluster.devices,
        "memory_bytes": cluster.target.memory_bytes,
    }
