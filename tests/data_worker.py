"""One process of tests/system/test_data_processes.py: read global batches of integer ids, write the rows held locally.

    jaxpar-launch -n K --devices-per-process D -- python tests/data_worker.py OUT_DIR --batches B
        [--num-sequences N] [--global-batch G] [--seed S] [--resume STATE_JSON] [--context C]

Joins the run through `jaxpar.parallel.distributed.initialize` (the JAXPAR_* variables the launcher sets), builds the
trainer's mesh over all devices (data = process count, fsdp = devices per process) and batch sharding
(`activation_spec("batch", "seq")`), and a `DataLoader` over N sequences where every token of sequence i is i.
Each process writes OUT_DIR/process_<index>.json (JSON, never pickle):
    {"process_index", "process_count", "local_devices", "mesh": {axis: size}, "batches_per_epoch",
     "batches": [[[row, id], ...] per batch: the rows of the global batch this process's shards hold],
     "states": [loader.get_state() after each batch], "start_state": the state it resumed from or null,
     "eval_batches": [[[row, id, valid tokens], ...] per batch of one `EvalLoader` pass over the same N
                      sequences (id -1: a padding row)]}
With --context C (C = every device of every process): the mesh is context = C alone, each sequence has 2C
tokens, token t of sequence i is 1000 i + t, and the process writes only {"process_index", "mesh", "shards":
[[first row, first position, tokens [rows, positions]] per addressable shard of one batch's inputs]}.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxpar.config.schema import Config, DistributedConfig, MeshConfig
from jaxpar.data import PAD_ID, DataLoader, EvalLoader
from jaxpar.parallel import distributed
from jaxpar.parallel.mesh import build_mesh
from jaxpar.parallel.sharding import activation_spec

SEQ_LEN = 2


def local_rows(batch_GT: jax.Array) -> list[list[int]]:
    """[row, id] for every global-batch row this process's shards hold (deduplicated, sorted by row)."""
    held = {}
    for shard in batch_GT.addressable_shards:
        start = shard.index[0].start or 0
        tokens = np.asarray(shard.data)
        assert (tokens == tokens[:, :1]).all(), "a row mixes two sequences"
        for r, sample_id in enumerate(tokens[:, 0].tolist()):
            held[start + r] = sample_id
    return [[row, held[row]] for row in sorted(held)]


def local_eval_rows(batch: dict) -> list[list[int]]:
    """[row, id, valid tokens] for every global-batch row this process's shards hold; id -1 for padding."""
    held = {}
    for inputs, mask in zip(batch["inputs"].addressable_shards, batch["loss_mask"].addressable_shards):
        assert inputs.index == mask.index
        start = inputs.index[0].start or 0
        tokens, valid = np.asarray(inputs.data), np.asarray(mask.data).sum(axis=1)
        assert (tokens == tokens[:, :1]).all(), "a row mixes two sequences"
        for r, (sample_id, n) in enumerate(zip(tokens[:, 0].tolist(), valid.tolist())):
            held[start + r] = [-1 if sample_id == PAD_ID else sample_id, int(n)]
    return [[row, *held[row]] for row in sorted(held)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--batches", type=int, required=True)
    ap.add_argument("--num-sequences", type=int, default=37)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--resume", default=None, help="JSON file holding a loader state to resume from")
    ap.add_argument("--context", type=int, default=1, help="mesh.context over every device (sequences split)")
    args = ap.parse_args()

    distributed.initialize(DistributedConfig(initialization_timeout_s=60))
    if args.context > 1:
        _context_shards(args)
        return
    cfg = Config(mesh=MeshConfig(data=jax.process_count(), fsdp=-1, tensor=1, pipeline=1))
    mesh = build_mesh(cfg)  # every device of every process
    sharding = NamedSharding(mesh, activation_spec("batch", "seq"))
    ids_N = np.arange(args.num_sequences, dtype=np.int32)
    inputs_NT = np.repeat(ids_N[:, None], SEQ_LEN, axis=1)
    packed = {"inputs": inputs_NT, "targets": inputs_NT + 1, "loss_mask": np.ones(inputs_NT.shape, np.float32)}
    loader = DataLoader(packed, args.global_batch, sharding, seed=args.seed)
    start_state = None
    if args.resume:
        with open(args.resume) as f:
            start_state = json.load(f)
        loader.set_state(start_state)

    batches, states = [], []
    for _ in range(args.batches):
        batch = loader.next_batch()
        np.testing.assert_array_equal(
            np.asarray(batch["targets"].addressable_shards[0].data),
            np.asarray(batch["inputs"].addressable_shards[0].data) + 1,
        )
        batches.append(local_rows(batch["inputs"]))
        states.append(loader.get_state())
    eval_batches = [local_eval_rows(batch) for batch in EvalLoader(packed, args.global_batch, sharding).batches()]
    result = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "mesh": {a: int(n) for a, n in mesh.shape.items()},
        "batches_per_epoch": loader.batches_per_epoch,
        "batches": batches,
        "states": states,
        "start_state": start_state,
        "eval_batches": eval_batches,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"process_{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)
    print(f"process {jax.process_index()}/{jax.process_count()}: wrote {len(batches)} batches", flush=True)


def _context_shards(args) -> None:
    """--context C: one batch of a loader whose sequences are split over C devices of several processes."""
    c = args.context
    mesh = build_mesh(Config(mesh=MeshConfig(data=1, fsdp=1, tensor=1, pipeline=1, context=c)))
    sharding = NamedSharding(mesh, activation_spec("batch", "seq"))
    t = 2 * c
    inputs_NT = (1000 * np.arange(args.num_sequences, dtype=np.int32)[:, None] + np.arange(t, dtype=np.int32)).copy()
    packed = {"inputs": inputs_NT, "targets": inputs_NT + 1, "loss_mask": np.ones(inputs_NT.shape, np.float32)}
    batch = DataLoader(packed, args.global_batch, sharding, seed=args.seed).next_batch()
    shards = [
        [s.index[0].start or 0, s.index[1].start or 0, np.asarray(s.data).tolist()]
        for s in batch["inputs"].addressable_shards
    ]
    result = {
        "process_index": jax.process_index(),
        "mesh": {a: int(n) for a, n in mesh.shape.items()},
        "shards": shards,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"process_{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
