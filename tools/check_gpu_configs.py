"""Compile every shipped GPU-scale config (configs/llama_*.yaml) for the cluster its `# cluster:` line names,
with XLA's GPU compiler on this machine (no GPU), and record the per-device peak beside the plan.

    pip install -e ".[gpu-compile]"          # jax's CUDA plugin, ptxas, cuDNN (about 2.7 GB)
    .venv/bin/python tools/check_gpu_configs.py   # about 10 s per config on 2 CPU cores

Writes configs/gpu_check.json (the default test suite checks it against the configs and the planner) and prints
the table of docs/planning.md. Exit status 1 when a config does not fit its cluster or the plan is off by more than 15%,
2 when the CUDA plugin is missing. Logic: jaxpar/analysis/gpu/check.py.
"""

from __future__ import annotations

import glob
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only CUDA devices; never start a GPU backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    from jaxpar.analysis.gpu.check import RECORD_FILE, check_config, format_table, problems
    from jaxpar.analysis.gpu.deviceless import unavailable_reason
    from jaxpar.analysis.planner.dims import param_leaves
    from jaxpar.config import load_config
    from jaxpar.log import human_bytes

    reason = unavailable_reason()
    if reason:
        print(f"check_gpu_configs: {reason}", file=sys.stderr)
        return 2

    def n_params(path: str) -> int:
        return sum(leaf.size for leaf in param_leaves(load_config(path, validate=False).model))

    configs = sorted(glob.glob(os.path.join(ROOT, "configs", "llama_*.yaml")), key=n_params)  # smallest first
    records, bad = [], []
    for path in configs:
        rec = check_config(path)
        print(
            f"{rec['config']}: {rec['cluster']} peak {human_bytes(rec['peak_bytes'])} per device, planned "
            f"{human_bytes(rec['planned_peak_bytes'])} (ratio {rec['ratio']:.3f}), "
            f"{'fits' if rec['fits'] else 'DOES NOT FIT'}; compiled in {rec['compile_seconds']} s",
            flush=True,
        )
        records.append(rec)
        bad += problems(rec, path)
    with open(os.path.join(ROOT, "configs", RECORD_FILE), "w", encoding="utf-8") as f:
        json.dump(records, f, indent=1)
        f.write("\n")
    print(format_table(records))
    for line in bad:
        print(f"check_gpu_configs: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
