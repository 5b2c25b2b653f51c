"""Activation-collective bytes per step of jaxpar's explicit tensor parallelism against the compiler-chosen
partitioning of the same model, for each mesh layout and remat policy (`jaxpar.analysis.bench.tensor_bytes`).

    python benchmarks/tensor_bytes.py [--target CLUSTER] [--remat POLICY ...] [CONFIG] [key=value ...]

Without `--target` both programs compile for 8 simulated CPU devices (CONFIG defaults to configs/tiny.yaml with 4
key/value heads); with `--target h100:1x8` they compile for that GPU cluster without a GPU (the gpu-compile extra,
`jaxpar.analysis.gpu.deviceless`; CONFIG defaults to configs/llama_1b.yaml), nothing runs. Every layout uses
`train.global_batch_size=8`, one accumulation step and ZeRO-1:

    data=2 x tensor=4        tensor parallelism without sequence parallelism
    data=2 x tensor=4 SP     with sequence parallelism
    fsdp=8                   FSDP over all devices (no tensor axis: the "all" columns compare)

For each layout and `model.remat` policy (default all four) it prints the ring bytes per device per step of the
collectives over `tensor` (activation collectives, loop trip counts included) of the explicit step and of
`jaxpar.analysis.bench.baselines.compiler_chosen_step` and their ratio (explicit / compiler), the bytes of every
collective of each, the dtypes of the gradient reductions (jaxpar's fp32, the compiler's bf16 under the 16p
layout) and XLA's temporary memory of each program. Compiles run one after another (about 10 s each for the
llama_1b shape on 2 CPU cores).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before jax is imported: 8 simulated CPU devices
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # with --target: compile-only CUDA devices, never a GPU backend

import argparse
import sys

LAYOUTS = {
    "data=2 x tensor=4": ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=4", "tensor.sequence_parallel=false"],
    "data=2 x tensor=4 SP": ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=4", "tensor.sequence_parallel=true"],
    "fsdp=8": ["mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1"],
}
COMMON = ["train.global_batch_size=8", "train.grad_accum_steps=1", "optimizer.zero_stage=1"]
CPU_DEFAULT = ("configs/tiny.yaml", ["model.n_kv_heads=4"])
GPU_DEFAULT = ("configs/llama_1b.yaml", [])
POLICIES = ("none", "dots", "names", "full")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default=None, help="default: tiny.yaml on CPU, llama_1b.yaml with --target")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides applied to every layout")
    ap.add_argument("--target", default=None, help="compile for this GPU cluster, e.g. h100:1x8 (8 devices)")
    ap.add_argument("--remat", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = ap.parse_args()

    import jax

    from jaxpar.analysis.bench.tensor_bytes import compile_steps, format_table
    from jaxpar.config import ConfigError, load_config
    from jaxpar.config.validate import resolve_config

    if args.target is None:
        config, extra = CPU_DEFAULT if args.config is None else (args.config, [])
        devices, platform = jax.devices()[:8], "cpu"
        if len(devices) < 8:
            print("bench_tensor_bytes: needs 8 devices (JAX_NUM_CPU_DEVICES=8)", file=sys.stderr)
            return 2
    else:
        from jaxpar.analysis.gpu.deviceless import GpuCompileUnavailable, compile_devices
        from jaxpar.analysis.gpu.targets import parse_cluster

        clu = parse_cluster(args.target)
        if clu.devices != 8:
            print(f"bench_tensor_bytes: the layouts span 8 devices; {clu.name} has {clu.devices}", file=sys.stderr)
            return 2
        try:
            devices = compile_devices(clu)
        except GpuCompileUnavailable as e:
            print(f"bench_tensor_bytes: {e}", file=sys.stderr)
            return 2
        config, extra = GPU_DEFAULT if args.config is None else (args.config, [])
        platform = clu.name

    rows = []
    for layout in args.layouts:
        for remat in args.remat:
            overrides = [*extra, *COMMON, *LAYOUTS[layout], f"model.remat={remat}", *args.overrides]
            try:
                cfg = load_config(config, overrides, validate=False)
                cfg = resolve_config(cfg, len(devices))
            except ConfigError as e:
                print(f"bench_tensor_bytes: {layout}, remat={remat}: {e}", file=sys.stderr)
                return 2
            out = compile_steps(cfg, devices)
            rows.append({"layout": layout, "remat": remat, "explicit": out["explicit"], "compiler": out["compiler"]})
            print(f"compiled {layout}, remat={remat}", file=sys.stderr, flush=True)
    print(
        f"\n{config} on {platform}: bytes sent per device per step (ring formulas); act. = collectives over the "
        f"tensor axis alone; ratio = explicit / compiler-chosen; temp = XLA's temporary memory per device"
    )
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
