"""Compile every shipped GPU-scale config (`CHECKED`: configs/llama_*.yaml and the published shapes of the other
families) for the cluster its `# cluster:` line names, with XLA's GPU compiler on this machine (no GPU), and record
the per-device peak beside the plan.

    pip install -e ".[gpu-compile]"          # jax's CUDA plugin, ptxas, cuDNN (about 2.7 GB)
    .venv/bin/python tools/check_gpu_configs.py                   # every config, about 10 s each on 2 CPU cores
    .venv/bin/python tools/check_gpu_configs.py qwen3_8b.yaml     # only the named ones; the other records are kept

Writes configs/gpu_check.json (the default test suite checks it against the configs and the planner; records
smallest model first) and prints the table of docs/planning.md. With --fp8 it compiles each config (or each named
one) with `precision.fp8.enabled=true` instead and prints its peak beside the bf16 record's (docs/fp8.md), writing
nothing. Exit status 1 when a config does not fit its cluster or the plan is off by more than 15%, 2 when the CUDA
plugin is missing or a named config is not one of `CHECKED`. Logic: jaxpar/analysis/gpu/check.py.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only CUDA devices; never start a GPU backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The configs with a record in configs/gpu_check.json (file name patterns in configs/); each names its cluster.
CHECKED = (
    "llama_*.yaml",
    "mistral_7b.yaml",
    "qwen2_5_7b.yaml",
    "qwen3_8b.yaml",
    "gemma2_9b.yaml",
    "mixtral_8x7b.yaml",
    "deepseek_v3.yaml",
)


def checked_configs() -> list[str]:
    """The paths of the `CHECKED` configs, sorted by file name."""
    return sorted({p for pattern in CHECKED for p in glob.glob(os.path.join(ROOT, "configs", pattern))})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", help="file names in configs/ to re-check (default: every CHECKED one)")
    parser.add_argument("--fp8", action="store_true", help="compile with FP8 GEMMs; print beside bf16, write nothing")
    args = parser.parse_args(argv)
    fp8, names = args.fp8, args.configs
    from jaxpar.analysis.gpu.check import RECORD_FILE, check_config, format_table, load_records, problems
    from jaxpar.analysis.gpu.deviceless import unavailable_reason
    from jaxpar.analysis.planner.dims import param_leaves
    from jaxpar.config import load_config
    from jaxpar.log import human_bytes

    paths = {os.path.basename(p): p for p in checked_configs()}
    unknown = [n for n in names if n not in paths]
    if unknown:
        print(f"check_gpu_configs: {unknown} not among the checked configs {sorted(paths)} (CHECKED)", file=sys.stderr)
        return 2
    reason = unavailable_reason()
    if reason:
        print(f"check_gpu_configs: {reason}", file=sys.stderr)
        return 2

    def n_params(name: str) -> int:
        return sum(leaf.size for leaf in param_leaves(load_config(paths[name], validate=False).model))

    configs = [paths[n] for n in sorted(names or paths, key=n_params)]  # smallest first
    if fp8:
        return _fp8_table(configs, check_config, human_bytes, RECORD_FILE)
    # with names, the other configs keep their records (in the file's order among equal sizes)
    kept = [r for r in load_records(os.path.join(ROOT, "configs")) if r["config"] in paths] if names else []
    fresh, bad = [], []
    for path in configs:
        rec = check_config(path)
        print(
            f"{rec['config']}: {rec['cluster']} peak {human_bytes(rec['peak_bytes'])} per device, planned "
            f"{human_bytes(rec['planned_peak_bytes'])} (ratio {rec['ratio']:.3f}), "
            f"{'fits' if rec['fits'] else 'DOES NOT FIT'}; compiled in {rec['compile_seconds']} s",
            flush=True,
        )
        fresh.append(rec)
        bad += problems(rec, path)
    new = {r["config"]: r for r in fresh}
    merged = [new.pop(r["config"], r) for r in kept] + list(new.values())  # a re-made record keeps its place
    records = sorted(merged, key=lambda r: n_params(r["config"]))
    with open(os.path.join(ROOT, "configs", RECORD_FILE), "w", encoding="utf-8") as f:
        json.dump(records, f, indent=1)
        f.write("\n")
    print(format_table(records))
    for line in bad:
        print(f"check_gpu_configs: {line}", file=sys.stderr)
    return 1 if bad else 0


def _fp8_table(configs, check_config, human_bytes, record_file) -> int:
    """Each config compiled with FP8 GEMMs, its peak beside the stored bf16 record's; 1 if one does not fit."""
    with open(os.path.join(ROOT, "configs", record_file), encoding="utf-8") as f:
        bf16 = {r["config"]: r for r in json.load(f)}
    rows = [
        "| config | cluster | bf16 peak | FP8 peak | FP8 / bf16 | fits |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    unfit = 0
    for path in configs:
        rec = check_config(path, overrides=("precision.fp8.enabled=true",))
        base = bf16[rec["config"]]["peak_bytes"]
        unfit += not rec["fits"]
        rows.append(
            f"| {rec['config']} | {rec['cluster']} | {human_bytes(base)} | {human_bytes(rec['peak_bytes'])} | "
            f"{rec['peak_bytes'] / base:.3f} | {rec['ratio']:.3f} | {'yes' if rec['fits'] else 'no'} |"
        )
        print(rows[-1], flush=True)
    print("\n".join(rows))
    return 1 if unfit else 0


if __name__ == "__main__":
    sys.exit(main())
