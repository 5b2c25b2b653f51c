"""One process of tests/system/test_mixture_processes.py: read global batches of a two-source mixture of shard
sets, record what it read.

    jaxpar-launch -n K --devices-per-process D -- python tests/mixture_worker.py WEB_SET CODE_SET OUT_DIR
        --batches B [--resume STATE_JSON]

Joins the run, builds the trainer's mesh (data = process count, fsdp = devices per process) and batch sharding,
and a `MixtureLoader` over the two sets' training splits (weights WEIGHTS, T = SEQ_LEN, G = GLOBAL_BATCH, seed
SEED, document masking on), whose row reads it records. Writes OUT_DIR/process_<index>.json:
    {"process_index", "process_count", "local_devices",
     "batches": [[[row, inputs, targets, loss_mask, segment_ids], ...] per batch, sorted by row],
     "asked": [[[source, sequence id], ...] per batch: the rows this process read],
     "states": [loader.get_state() after each batch]}
"""

from __future__ import annotations

import argparse
import json
import os

import jax
from jax.sharding import NamedSharding
from stream_worker import GLOBAL_BATCH, SEED, SEQ_LEN, local_rows

from jaxpar.config.schema import Config, DataConfig, DistributedConfig, MeshConfig
from jaxpar.data import MixtureLoader
from jaxpar.data.stream import shard_splits
from jaxpar.parallel import distributed
from jaxpar.parallel.mesh import build_mesh
from jaxpar.parallel.sharding import activation_spec

WEIGHTS = {"web": 0.7, "code": 0.3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("web")
    ap.add_argument("code")
    ap.add_argument("out_dir")
    ap.add_argument("--batches", type=int, required=True)
    ap.add_argument("--resume", default=None, help="JSON file holding a loader state to resume from")
    args = ap.parse_args()

    distributed.initialize(DistributedConfig(initialization_timeout_s=60))
    mesh = build_mesh(Config(mesh=MeshConfig(data=jax.process_count(), fsdp=-1, tensor=1, pipeline=1)))
    sharding = NamedSharding(mesh, activation_spec("batch", "seq"))
    asked, sources = [], {}
    for name, path in (("web", args.web), ("code", args.code)):
        train, _, _ = shard_splits(DataConfig(source="shards", path=path, seq_len=SEQ_LEN))
        read = train.rows
        train.rows = lambda ids, read=read, name=name: asked[-1].extend([name, int(i)] for i in ids) or read(ids)
        sources[name] = train
    loader = MixtureLoader(sources, WEIGHTS, GLOBAL_BATCH, sharding, seed=SEED)
    if args.resume:
        with open(args.resume) as f:
            loader.set_state(json.load(f))
    batches, states = [], []
    for _ in range(args.batches):
        asked.append([])
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
