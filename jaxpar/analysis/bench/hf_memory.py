"""Peak host memory of Hugging Face weights in and out of jaxpar, per process (benchmarks/hf_load_memory.py and the
slow test tests/system/test_hf_load_memory.py).

`write_synthetic` writes a random Llama of the given shape with `jaxpar.model.hf.save_hf`. `measure` starts fresh
processes (one, or several joined by `jax.distributed` through `jaxpar-launch`, each with its own CPU devices) that
each run one `MODES` case on a mesh of fsdp over every device of every process and report (`child`):

    baseline  resident memory once jax is imported, the mesh is built and each local device has held an array
              (VmRSS, bytes): the program
    peak      the process's peak resident memory (VmHWM of /proc/self/status, bytes: `ru_maxrss` of getrusage
              would do, but Linux carries it over from the parent that forked the process, across exec)
    held      bytes of the arrays its devices hold at the end: on the CPU backend a device's memory is the host's,
              so these weights are in the process's RSS however they were loaded
    staging   peak - baseline - held: what the load held on the host besides the program and the placed weights
    block     the largest block one device holds of one parameter, float32 (the "shard-slice")
    read      bytes this process read from the safetensors files (lazy modes)

Modes:
    eager     `jaxpar.model.hf.load_hf` (every tensor into host numpy, float32), then each parameter placed with
              `jax.make_array_from_callback`: the path model.init_from took before. With several processes they
              take turns (process i reads once process i-1 has placed its weights and freed its host copy) so that
              all fit one machine; each process's peak is what it would be running at once.
    lazy      `jaxpar.model.hf.place.place_hf_params` (positioned reads of each process's slices)
    lazy-pread the same through positioned reads (`os.preadv`) instead of safetensors' `get_slice`
    import    `jaxpar.training.hf_checkpoint.import_hf` with `optax.sgd` (no optimizer moments: the placed
              parameters and a step-0 checkpoint of them)
    export    `jaxpar.training.hf_checkpoint.export_hf` of the import's checkpoint, bfloat16
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

MODES = ("eager", "lazy", "lazy-pread", "import", "export")
ONE_BILLION = {"d_model": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "d_ff": 8192, "vocab_size": 32000}


def model_config(**shape):
    """A Llama ModelConfig of `shape` (d_model, n_layers, n_heads, n_kv_heads, d_ff, vocab_size), untied."""
    from jaxpar.config.schema import ModelConfig

    return dataclasses.replace(ModelConfig(), name="llama", tie_embeddings=False, **shape)


def write_synthetic(out_dir: str, model, dtype: str = "bfloat16", seed: int = 0) -> int:
    """Writes a random model (normal, std 0.02) as a Hugging Face directory of `dtype` with `save_hf`; returns its
    parameter count. Host memory: the float32 parameters and their cast."""
    import jax

    from jaxpar.model import init_params
    from jaxpar.model.hf import save_hf

    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: init_params(model, 0))
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape, dtype=np.float32) * np.float32(0.02), shapes)
    save_hf(params, model, out_dir, dtype=dtype)
    return sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))


def _status(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM), bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _held(tree) -> int:
    import jax

    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards)


def _target(model):
    """The model's float32 parameters on a mesh of fsdp over every device (`abstract_params`)."""
    import jax

    from jaxpar.config import load_config
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.training.plan import build_plan
    from jaxpar.training.state import abstract_params

    mesh = ["mesh.data=1", "mesh.fsdp=-1", "mesh.tensor=1", "mesh.pipeline=1", "optimizer.zero_stage=0"]
    cfg = load_config({"model": dataclasses.asdict(model)}, [*mesh, f"train.global_batch_size={jax.device_count()}"])
    return abstract_params(build_plan(cfg, build_mesh(cfg)))


def _largest_block(target) -> int:
    import jax

    from jaxpar.model.hf.place import addressable_blocks

    return max(
        int(np.prod([b - a for a, b in bounds])) * 4
        for t in jax.tree.leaves(target)
        for bounds in addressable_blocks(tuple(t.shape), t.sharding)
    )


def _eager(hf_dir: str, target, turns: str) -> dict:
    import jax

    from jaxpar.model.hf import load_hf

    index, count = jax.process_index(), jax.process_count()
    while count > 1 and index and not os.path.exists(os.path.join(turns, f"turn{index}")):
        time.sleep(0.2)
    params = load_hf(hf_dir).params
    placed = jax.tree.map(
        lambda p, t: jax.make_array_from_callback(p.shape, t.sharding, lambda i: p[i]), params, target
    )
    jax.block_until_ready(placed)
    del params
    if count > 1:
        with open(os.path.join(turns, f"turn{index + 1}"), "w"):
            pass
    return {"placed": placed}


def child(mode: str, hf_dir: str, work: str, records: str) -> None:
    """One measured process (module docstring): writes RECORDS/<process index>.json. The import writes WORK/run,
    the export reads it and writes RECORDS/export."""
    import jax

    from jaxpar.parallel import distributed

    distributed.initialize()
    from jaxpar.model.hf import check_hf
    from jaxpar.model.hf.lazy import HFSliceReader
    from jaxpar.model.hf.place import place_hf_params
    from jaxpar.training import hf_checkpoint

    model = check_hf(hf_dir)
    target = _target(model)
    jax.block_until_ready([jax.device_put(np.zeros(1024, np.float32), d) for d in jax.local_devices()])
    baseline, start, out = _status("VmRSS"), time.perf_counter(), {}
    if mode == "eager":
        out = _eager(hf_dir, target, records)
    elif mode.startswith("lazy"):
        with HFSliceReader(hf_dir, model, backend="pread" if mode == "lazy-pread" else "safetensors") as reader:
            out = {"placed": place_hf_params(reader, target), "read": reader.bytes_read}
    elif mode == "import":
        import optax

        hf_checkpoint.import_hf(hf_dir, os.path.join(work, "run"), optimizer=optax.sgd(1e-3))
    else:
        hf_checkpoint.export_hf(os.path.join(work, "run"), os.path.join(records, "export"), dtype="bfloat16")
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    held = _held(out.pop("placed")) if "placed" in out else 0
    if mode in ("import", "export"):  # the parameters they spread evenly over every device
        held = sum(int(np.prod(t.shape)) * 4 for t in jax.tree.leaves(target)) // jax.process_count()
    record = {"mode": mode, "process": jax.process_index(), "processes": jax.process_count()}
    record |= {"devices": jax.local_device_count(), "baseline": baseline, "peak": peak, "held": held}
    record |= {"staging": peak - baseline - held, "block": _largest_block(target), "read": out.get("read")}
    record["seconds"] = seconds
    with open(os.path.join(records, f"{jax.process_index()}.json"), "w") as f:
        json.dump(record, f)


def measure(mode: str, hf_dir: str, work: str, processes: int, devices: int, timeout: float = 1800) -> list[dict]:
    """Runs `mode` in `processes` fresh processes of `devices` CPU devices each (several: through jaxpar-launch),
    with records in WORK/MODE_xPROCESSES (made anew); returns each process's record (`child`), by process index.
    "export" needs an "import" run before it in the same `work`.

    Raises:
      RuntimeError: a process failed (its output's tail in the message).
    """
    records = os.path.join(work, f"{mode}_x{processes}")
    shutil.rmtree(records, ignore_errors=True)
    os.makedirs(records)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "jaxpar.analysis.bench.hf_memory", mode, hf_dir, work, records]
    if processes == 1:
        env["JAX_NUM_CPU_DEVICES"] = str(devices)
    else:
        launch = [
            sys.executable,
            "-m",
            "jaxpar.cli.launch",
            "-n",
            str(processes),
            "--devices-per-process",
            str(devices),
        ]
        cmd = [*launch, "--", *cmd]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode:
        raise RuntimeError(f"{mode} x {processes} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    out = []
    for i in range(processes):
        with open(os.path.join(records, f"{i}.json")) as f:
            out.append(json.load(f))
    return out


def format_rows(rows: list[dict]) -> str:
    """The table: one line per (mode, processes), the process with the largest peak; sizes in MiB (the kernel
    counts resident memory in KiB)."""
    mib = 2**20
    head = f"{'mode':<10} {'procs x dev':>11} {'baseline':>9} {'held':>9} {'peak':>9} {'staging':>9} {'block':>8}"
    lines = [head + f" {'staging/block':>13} {'read':>9} {'s':>6}", "-" * 104]
    for r in rows:
        read = "-" if r["read"] is None else f"{r['read'] / mib:.0f}"
        lines.append(
            f"{r['mode']:<10} {r['processes']:>5} x {r['devices']:<3} {r['baseline'] / mib:>9.0f}"
            f" {r['held'] / mib:>9.0f} {r['peak'] / mib:>9.0f} {r['staging'] / mib:>9.0f} {r['block'] / mib:>8.1f}"
            f" {r['staging'] / r['block']:>13.2f} {read:>9} {r['seconds']:>6.1f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    child(*sys.argv[1:5])
