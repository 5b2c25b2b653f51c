"""Peak resident memory of a data-loading process over a 10M- and a 1B-token shard set (`data.source: shards`).

    python benchmarks/data_rss.py [--sizes 10000000 1000000000] [--batches 200] [--dir /tmp]

For each size it writes a synthetic shard set into a temporary directory (uint16 ids below 32,000, documents of
100 to 4,000 tokens, shards of at most 100M tokens, a manifest and checksums as the `jaxpar-data` tokenize command
writes them; 1B tokens = 2 GB, written in chunks with numpy), then starts a fresh Python process that builds the
training and validation loaders (`jaxpar.data.build_loaders`, one CPU device, G = --global-batch rows of
T = --seq-len tokens, document masking on), reads --batches training batches and one evaluation pass, and reports
its peak resident set size (VmHWM of /proc/self/status: everything the process holds, file pages it maps
included). The sets are deleted afterwards. Printed: one line per run and the ratio peak(largest) /
peak(smallest), goal <= 1.1.

Rows: "streamed" (`data.source: shards`, as training reads it), and for the smallest size only "in RAM" (the same
tokens as a flat `data.source: tokens` file, read and packed whole, as the text sources are), for comparison.

Linux only (/proc/self/status).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

VOCAB = 32_000
SHARD_TOKENS = 100_000_000
DOC_MIN, DOC_MAX = 100, 4000


def write_shard_set(directory: str, num_tokens: int, seed: int = 0) -> dict:
    """Writes a complete synthetic byte-free shard set of `num_tokens` uint16 tokens into `directory` (created);
    every document opens with BOS 1 and ends with EOS 2. Returns the manifest."""
    from jaxpar.data import shards

    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    entries, written, docs_total = [], 0, 0
    while written < num_tokens:
        n = min(SHARD_TOKENS, num_tokens - written)
        lengths = rng.integers(DOC_MIN, DOC_MAX + 1, size=n // DOC_MIN + 1)
        ends = np.cumsum(lengths)
        k = int(np.searchsorted(ends, n))  # documents 0..k, the last one cut to end the shard at n tokens
        offsets = np.concatenate([[0], ends[:k], [n]]).astype(np.int64)
        tokens = rng.integers(3, VOCAB, size=n, dtype=np.uint16)
        tokens[offsets[:-1]] = 1  # BOS
        tokens[offsets[1:] - 1] = 2  # EOS
        index = len(entries)
        tok_name, off_name = shards.shard_names(index)
        tok_sha = shards.write_npy(os.path.join(directory, tok_name), [tokens], np.uint16)
        off_sha = shards.write_npy(os.path.join(directory, off_name), [offsets], np.int64)
        entries.append(
            {
                "tokens_file": tok_name,
                "offsets_file": off_name,
                "tokens": n,
                "documents": len(offsets) - 1,
                "tokens_sha256": tok_sha,
                "offsets_sha256": off_sha,
                "empty_documents": 0,
                "invalid_utf8_documents": 0,
                "end": {"file": 0, "record": index, "input_bytes": 0},
            }
        )
        written += n
        docs_total += len(offsets) - 1
        del tokens, offsets
    manifest = {
        "format": shards.FORMAT,
        "format_version": shards.FORMAT_VERSION,
        "complete": True,
        "tokenizer": {
            "kind": "synthetic",
            "source_path": None,
            "sha256": None,
            "pattern": None,
            "vocab_size": VOCAB,
            "bos_id": 1,
            "eos_id": 2,
            "file": None,
        },
        "add_bos": True,
        "add_eos": True,
        "token_dtype": "uint16",
        "shard_tokens": SHARD_TOKENS,
        "input": {"format": "synthetic", "field": None, "root": directory, "files": [], "bytes": 0},
        "tokens": written,
        "documents": docs_total,
        "empty_documents": 0,
        "invalid_utf8_documents": 0,
        "shards": entries,
    }
    shards.write_json(os.path.join(directory, shards.MANIFEST), manifest)
    return manifest


def write_flat(directory: str, out: str) -> None:
    """The set's tokens as one flat uint16 file (`data.source: tokens`)."""
    from jaxpar.data.shards import ShardSet

    s = ShardSet(directory)
    with open(out, "wb") as f:
        for i in range(s.num_shards):
            f.write(np.asarray(s.tokens(i)).tobytes())


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(args) -> None:
    """One measured process: build the loaders, read the batches, print a JSON line."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpar.config.schema import DataConfig
    from jaxpar.data import build_loaders

    sharding = NamedSharding(jax.make_mesh((1,), ("data",)), P("data", None))
    cfg = DataConfig(source=args.source, path=args.child, seq_len=args.seq_len, validation_fraction=0.01)
    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    train, val, info = build_loaders(cfg, args.global_batch, sharding, vocab_size=VOCAB, eval_batches=2)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.batches):
        batch = train.next_batch()
    jax.block_until_ready(batch)
    for batch in val.batches():
        jax.block_until_ready(batch)
    seconds = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "tokens": info.train_tokens + info.val_tokens,
                "hwm_kib": _status_kib("VmHWM"),
                "rss_kib": _status_kib("VmRSS"),
                "rss_after_imports_kib": base,
                "build_s": built,
                "batch_ms": 1000 * seconds / args.batches,
            }
        ),
        flush=True,
    )


def measure(path: str, source: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", path, "--source", source]
    cmd += ["--batches", str(args.batches), "--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_NUM_CPU_DEVICES", None)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"measuring {path} failed:\n{out.stdout[-2000:]}{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000_000, 1_000_000_000], help="tokens per set")
    ap.add_argument("--batches", type=int, default=200, help="training batches each process reads")
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--dir", default=None, help="where the temporary sets go (default: the system temp dir)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--source", default="shards", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    sizes = sorted(args.sizes)
    results = {"streamed": {}, "in RAM": {}}
    for size in sizes:
        work = tempfile.mkdtemp(prefix="jaxpar_rss_", dir=args.dir)
        try:
            t0 = time.perf_counter()
            write_shard_set(os.path.join(work, "set"), size)
            print(f"wrote {size:,} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
            results["streamed"][size] = measure(os.path.join(work, "set"), "shards", args)
            if size == sizes[0]:
                write_flat(os.path.join(work, "set"), os.path.join(work, "flat.bin"))
                results["in RAM"][size] = measure(os.path.join(work, "flat.bin"), "tokens", args)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{args.batches} batches of {args.global_batch} x {args.seq_len} tokens, then one evaluation pass:")
    print(f"{'loader':<12} {'tokens':>15} {'peak RSS MiB':>13} {'RSS at start':>13} {'build s':>8} {'ms/batch':>9}")
    for name, by_size in results.items():
        for size, r in by_size.items():
            print(
                f"{name:<12} {size:>15,} {r['hwm_kib'] / 1024:>13.1f} {r['rss_after_imports_kib'] / 1024:>13.1f} "
                f"{r['build_s']:>8.2f} {r['batch_ms']:>9.2f}"
            )
    lo, hi = sizes[0], sizes[-1]
    ratio = results["streamed"][hi]["hwm_kib"] / results["streamed"][lo]["hwm_kib"]
    print(f"streamed: peak RSS ratio {hi:,} / {lo:,} tokens = {ratio:.3f} (goal <= 1.1)")


if __name__ == "__main__":
    main()
