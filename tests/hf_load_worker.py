"""One process of tests/system/test_hf_processes.py: Hugging Face weights in and out of a multi-process job.

    jaxpar-launch -n K --devices-per-process D -- python tests/hf_load_worker.py OUT_DIR HF_DIR ...

Joins the job through `jaxpar.parallel.distributed.initialize`. For each HF_DIR (named N by its basename):
  1. places its parameters lazily (`jaxpar.model.hf.place.place_hf_params`) on the float32 layout of a plan over
     every device (data = K outermost, so across the processes; fsdp x tensor within; ZeRO-3: the parameters split
     over data too) and writes OUT_DIR/N/process_<index>.json: {"process_index", "read": bytes this process read
     from the safetensors, "blocks": bytes (stored dtype) of the distinct blocks its devices hold, "total": bytes of
     the whole model in the files, "equal": whether every shard it holds is the eager `load_hf`'s bit for bit};
  2. `import_hf` into OUT_DIR/N/run and `export_hf` of that run into OUT_DIR/N/export (float32), every process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import numpy as np

from jaxpar.config import load_config
from jaxpar.config.schema import DistributedConfig
from jaxpar.model.hf import check_hf, load_hf
from jaxpar.model.hf.lazy import HFSliceReader
from jaxpar.model.hf.place import addressable_blocks, place_hf_params
from jaxpar.parallel import distributed
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.hf_checkpoint import export_hf, import_hf
from jaxpar.training.plan import build_plan
from jaxpar.training.state import abstract_params


def _place(hf_dir: str) -> dict:
    model = check_hf(hf_dir)
    tensor = 2 if model.kv_heads % 2 == 0 else 1
    mesh = [f"mesh.data={jax.process_count()}", "mesh.fsdp=-1", f"mesh.tensor={tensor}", "mesh.pipeline=1"]
    cfg = load_config({"model": dataclasses.asdict(model)}, [*mesh, "optimizer.zero_stage=3"])
    target = abstract_params(build_plan(cfg, build_mesh(cfg)))
    with HFSliceReader(hf_dir, model) as reader:
        params = place_hf_params(reader, target)
        itemsize = 4 if reader.stored_dtype == "float32" else 2
        record = {"read": reader.bytes_read, "total": reader.total_bytes}
    record["blocks"] = sum(
        int(np.prod([b - a for a, b in bounds])) * itemsize
        for t in jax.tree.leaves(target)
        for bounds in addressable_blocks(tuple(t.shape), t.sharding)
    )
    eager = load_hf(hf_dir).params
    record["equal"] = all(
        np.asarray(shard.data).tobytes() == want[shard.index].astype(np.float32).tobytes()
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(eager))
        for shard in got.addressable_shards
    )
    return record


def main() -> None:
    out_dir, hf_dirs = sys.argv[1], sys.argv[2:]
    distributed.initialize(DistributedConfig(initialization_timeout_s=60))
    for hf_dir in hf_dirs:
        here = os.path.join(out_dir, os.path.basename(hf_dir))
        os.makedirs(here, exist_ok=True)
        record = {"process_index": jax.process_index(), **_place(hf_dir)}
        with open(os.path.join(here, f"process_{jax.process_index()}.json"), "w") as f:
            json.dump(record, f)
        import_hf(hf_dir, os.path.join(here, "run"))
        export_hf(os.path.join(here, "run"), os.path.join(here, "export"))


if __name__ == "__main__":
    main()
