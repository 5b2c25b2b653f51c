"""Peak host memory per process of Hugging Face weights in and out of jaxpar on a synthetic 1B Llama
(`jaxpar.analysis.bench.hf_memory`, whose docstring defines every column).

    python benchmarks/hf_load_memory.py [--dir /tmp] [--dtype bfloat16] [--processes 4] [--cases MODE ...] [--keep]

Writes the checkpoint (d_model 2048, 16 layers, 32/8 heads, d_ff 8192, vocab 32000, untied: 1,104,218,112
parameters; bfloat16 is 2.2 GB) into a temporary directory under --dir with `jaxpar.model.hf.save_hf`, then runs
each case in fresh processes on 8 CPU devices: one process of 8, and --processes processes of 8 / --processes
joined by `jax.distributed` on 127.0.0.1 (`jaxpar-launch`), the parameters placed with fsdp over all devices.
Prints one line per case (the process with the largest peak) and deletes the directory unless --keep. Needs about
14 GB of memory (the eager cases; their processes take turns) and 12 GB of disk (the import's checkpoint is
float32); Linux only (/proc/self/status).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from jaxpar.analysis.bench import hf_memory

CASES = ("lazy", "lazy-pread", "eager", "import", "export")
SMALL = {"d_model": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 512, "vocab_size": 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="where the temporary checkpoint goes (default: the system temp dir)")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="the safetensors' dtype")
    ap.add_argument("--processes", type=int, default=4, help="processes of the multi-process cases (divides 8)")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the outputs")
    ap.add_argument("--small", action="store_true", help="a 1.7M-parameter model instead (a smoke run)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="jaxpar_hf_rss_", dir=args.dir)
    hf_dir = os.path.join(work, "hf")
    try:
        start = time.perf_counter()
        shape = SMALL if args.small else hf_memory.ONE_BILLION
        count = hf_memory.write_synthetic(hf_dir, hf_memory.model_config(**shape), args.dtype)
        print(f"wrote {count:,} parameters ({args.dtype}) in {time.perf_counter() - start:.0f} s", flush=True)
        rows = []
        for mode in args.cases:
            for processes in (1, args.processes):
                records = hf_memory.measure(mode, hf_dir, work, processes, 8 // processes)
                rows.append(max(records, key=lambda r: r["peak"]))
                print(hf_memory.format_rows(rows[-1:]).splitlines()[-1], flush=True)
                if mode == "import" and processes == 1:
                    shutil.rmtree(os.path.join(work, "run"))  # the import of several processes writes it again
        print(
            f"\n{args.dtype} safetensors of {count:,} parameters; sizes in MiB; one line per case, the process of the"
        )
        print(
            "largest peak; staging = peak - baseline - held (held: this process's share of the weights, on its devices)"
        )
        print(hf_memory.format_rows(rows))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
