"""One process of tests/system/test_stream_processes.py: read global batches of a shard set, record what it read.

    jaxpar-launch -n K --devices-per-process D -- python tests/stream_worker.py SHARD_SET OUT_DIR --batches B
        [--resume STATE_JSON]

Joins the run (`jaxpar.parallel.distributed.initialize`), builds the trainer's mesh over all devices (data = process
count, fsdp = devices per process) and batch sharding, and a `DataLoader` over the shard set's training split
(`data.source: shards`, T = SEQ_LEN, G = GLOBAL_BATCH, seed SEED, document masking on), whose row reads it
records. Writes OUT_DIR/process_<index>.json (JSON):
    {"process_index", "process_count", "local_devices",
     "batches": [[[row, inputs, targets, loss_mask, segment_ids], ...] per batch: the global-batch rows this
                 process's shards hold, sorted by row],
     "asked": [[sample id, ...] per batch: the rows this process read from the shard set],
     "states": [loader.get_state() after each batch]}
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxpar.config.schema import Config, DataConfig, DistributedConfig, MeshConfig
from jaxpar.data import DataLoader
from jaxpar.data.stream import shard_splits
from jaxpar.parallel import distributed
from jaxpar.parallel.mesh import build_mesh
from jaxpar.parallel.sharding import activation_spec

SEQ_LEN, GLOBAL_BATCH, SEED = 16, 8, 7
KEYS = ("inputs", "targets", "loss_mask", "segment_ids")


def local_rows(batch: dict) -> list[list]:
    """[row, inputs, targets, loss_mask, segment_ids] for every global-batch row this process's shards hold."""
    held = {}
    shards = [batch[k].addressable_shards for k in KEYS]
    for pieces in zip(*shards):
        start = pieces[0].index[0].start or 0
        arrays = [np.asarray(p.data).tolist() for p in pieces]
        for r in range(len(arrays[0])):
            held[start + r] = [a[r] for a in arrays]
    return [[row, *held[row]] for row in sorted(held)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shard_set")
    ap.add_argument("out_dir")
    ap.add_argument("--batches", type=int, required=True)
    ap.add_argument("--resume", default=None, help="JSON file holding a loader state to resume from")
    args = ap.parse_args()

    distributed.initialize(DistributedConfig(initialization_timeout_s=60))
    mesh = build_mesh(Config(mesh=MeshConfig(data=jax.process_count(), fsdp=-1, tensor=1, pipeline=1)))
    sharding = NamedSharding(mesh, activation_spec("batch", "seq"))
    train, _, _ = shard_splits(DataConfig(source="shards", path=args.shard_set, seq_len=SEQ_LEN))
    asked = []
    read = train.rows
    train.rows = lambda ids: asked.append([int(i) for i in ids]) or read(ids)
    loader = DataLoader(train, GLOBAL_BATCH, sharding, seed=SEED)
    if args.resume:
        with open(args.resume) as f:
            loader.set_state(json.load(f))
    batches, states = [], []
    for _ in range(args.batches):
        batches.append(local_rows(loader.next_batch()))
        states.append(loader.get_state())
    result = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "batches": batches,
        "asked": asked,
        "states": states,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"process_{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
