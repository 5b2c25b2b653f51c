"""Sharded jaxpar parameters out to a Hugging Face directory one tensor at a time (`save_hf_gathered`), the reverse
of `jaxpar.model.hf.place`: for each Hugging Face tensor in turn, every process takes part in one jitted slice of its
parameter (one layer, one expert) that comes out whole on every process, split over that process's own devices;
process 0 copies it to the host, lays it out as Hugging Face does (`_to_hf`), casts it and streams it into its file
(`jaxpar.model.hf.files.write_streamed`), and drops it before the next. The processes never hold a parameter of
another process, and a host holds one tensor at a time, about twice: its gathered copy and its float32 host copy,
then the host copy and its cast (the largest tensor is the embedding or the output head, [V, D]).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config.mesh_axes import DATA, FSDP
from jaxpar.config.paths import write_atomic
from jaxpar.config.precision import DTYPE_BYTES
from jaxpar.config.schema import ModelConfig
from jaxpar.model import init_params
from jaxpar.model.hf.config import CONFIG_FILE, HFConfigError, hf_config_from_model
from jaxpar.model.hf.files import NUMPY_DTYPES, file_layout, write_streamed
from jaxpar.model.hf.lazy import hf_sources
from jaxpar.model.hf.weights import INDEX_FILE, _to_hf, export_dtype, hf_tensor_shapes

_LOGGER = logging.getLogger("jaxpar.model.hf")


def _lead(cfg: ModelConfig) -> dict[tuple[str, ...], int]:
    """Parameter path -> how many of its leading axes index a Hugging Face tensor (the stack row, the expert)."""
    return {s.path: (s.row is not None) + (s.expert is not None) for s in hf_sources(cfg)}


def _split(mesh: Mesh, shape: tuple[int, ...], axes: tuple[str, ...], skip: int = 0) -> NamedSharding | None:
    """`shape` split over the mesh axes `axes` along its first axis after the first `skip` that their size divides,
    or None."""
    size = int(np.prod([mesh.shape[a] for a in axes]))
    for dim in range(skip, len(shape)):
        if shape[dim] % size == 0:
            return NamedSharding(mesh, P(*([None] * dim), axes))
    return None


def export_shardings(cfg: ModelConfig, mesh: Mesh) -> dict:
    """Where an export keeps the parameters of a model of `cfg` on `jaxpar.parallel.mesh.process_mesh()` (a tree of
    NamedShardings): each split over every device (fsdp-major, data-minor) along its first axis after the stack row
    and expert axes that their count divides, else over each process's devices, else whole on each device. Taking
    one layer or expert out of such a parameter is then a slice on every device, and making it whole on each
    process an all-gather over the processes (`data`)."""
    lead = _lead(cfg)

    def place(path: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
        skip = lead[path]
        return _split(mesh, shape, (FSDP, DATA), skip) or _split(mesh, shape, (FSDP,), skip) or NamedSharding(mesh, P())

    shapes = jax.eval_shape(lambda: init_params(cfg, 0))
    return jax.tree_util.tree_map_with_path(lambda k, s: place(_path(k), tuple(s.shape)), shapes)


def _path(keys) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in keys)


def _whole_on_host(x: jax.Array) -> np.ndarray:
    """This process's copy of `x`, which its local devices hold whole between them."""
    out = np.empty(x.shape, x.dtype)
    seen = set()
    for shard in x.addressable_shards:
        key = tuple(s.indices(n)[:2] for s, n in zip(shard.index, x.shape))
        if key not in seen:
            seen.add(key)
            out[shard.index] = np.asarray(shard.data)
    return out


def _take(n: int, out: NamedSharding) -> jax.stages.Wrapped:
    """A program taking x[i[0], ..., i[n-1]] (the whole of x for n = 0) with the output sharding `out`."""
    return jax.jit(lambda x, i: x[tuple(i[j] for j in range(n))] if n else x, out_shardings=out)


def gathered_hf_tensors(params: dict, cfg: ModelConfig, dtype: str, mesh: Mesh) -> Iterator[np.ndarray | None]:
    """Every Hugging Face tensor of `params` (a model of `cfg` on `mesh`, a `process_mesh()`), in
    `hf_tensor_shapes`' order, one at a time: on process 0 a contiguous numpy array of `dtype` (or float32:
    `jaxpar.model.hf.weights.export_dtype`), on the others None.
    Every process must draw every tensor, in step: each is gathered by a program all of them run."""
    programs: dict[tuple[str, ...], jax.stages.Wrapped] = {}
    lead = _lead(cfg)
    for source in hf_sources(cfg):
        leaf: Any = params
        for key in source.path:
            leaf = leaf[key]
        index = [i for i in (source.row, source.expert) if i is not None]
        program = programs.get(source.path)
        if program is None:
            shape = tuple(leaf.shape[lead[source.path] :])
            split = leaf.sharding.spec[lead[source.path] :] if isinstance(leaf.sharding, NamedSharding) else ()
            dim = next((d for d, axes in enumerate(split) if axes), None)  # the parameter's split axis, if any
            out = NamedSharding(mesh, P())  # whole on each device
            if dim is not None and shape[dim] % mesh.shape[FSDP] == 0:  # whole on each process, split as it was
                out = NamedSharding(mesh, P(*([None] * dim), FSDP))
            program = programs[source.path] = _take(len(index), out)
        part = program(leaf, np.asarray(index, np.int32))
        if jax.process_index() != 0:
            part.block_until_ready()  # one gather at a time in every process: their collectives run in one order
            del part
            yield None
            continue
        host = _whole_on_host(part)
        del part  # the gathered copy on the devices
        # elementwise, so before the layout (a transposing cast of ml_dtypes' bfloat16 copies the float32 input
        # contiguous first); DeepseekV3's router in float32 whatever `dtype` (`export_dtype`)
        cast = host.astype(NUMPY_DTYPES[export_dtype(source.name, cfg, dtype)], copy=False)
        del host
        tensor = np.ascontiguousarray(_to_hf(cast, source.kind, cfg))
        del cast
        yield tensor
        del tensor  # before the next gather: one tensor at a time


def _check_params(params: dict, cfg: ModelConfig) -> None:
    """`params` has the paths and shapes of a model of `cfg`; raises HFConfigError naming the first difference."""
    want = jax.eval_shape(lambda: init_params(cfg, 0))
    got = {jax.tree_util.keystr(k): tuple(x.shape) for k, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    for keys, w in jax.tree_util.tree_flatten_with_path(want)[0]:
        name = jax.tree_util.keystr(keys)
        if got.get(name) != tuple(w.shape):
            raise HFConfigError(
                f"the parameters' {name} is {got.get(name, 'missing')}, a {cfg.name} model of this config has {w.shape}"
            )


def save_hf_gathered(
    params: dict,
    cfg: ModelConfig,
    out_dir: str,
    mesh: Mesh,
    *,
    dtype: str = "float32",
    base_config: dict | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Writes sharded jaxpar parameters of `cfg`'s family (jax arrays on `mesh`, a
    `jaxpar.parallel.mesh.process_mesh()`) as a Hugging Face directory, one tensor at a time (module docstring): what
    `jaxpar.model.hf.save_hf` writes, without the whole model on any host. Process 0 writes the files, config.json
    last; every process must call it. Returns the file names.

    Raises:
      HFConfigError: a model the family's transformers class cannot express, an unknown dtype or parameters shaped
        unlike `cfg` (before any file is written); `out_dir` is checked by the caller
        (`jaxpar.model.hf.check_export_dir`).
    """
    if dtype not in DTYPE_BYTES:
        raise HFConfigError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    hf = hf_config_from_model(cfg, dtype, base_config)
    _check_params(params, cfg)
    specs = {name: (export_dtype(name, cfg, dtype), shape) for name, shape in hf_tensor_shapes(cfg).items()}
    tensors = gathered_hf_tensors(params, cfg, dtype, mesh)
    if jax.process_index() == 0:
        files = write_streamed(out_dir, specs, (t for t in tensors if t is not None), max_shard_bytes)
        write_atomic(os.path.join(out_dir, CONFIG_FILE), json.dumps(hf, indent=2, sort_keys=True) + "\n")  # last
    else:
        for _ in tensors:  # gathers in step with process 0
            pass
        layout = list(file_layout(specs, max_shard_bytes))
        files = layout + ([INDEX_FILE] if len(layout) > 1 else [])
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jaxpar.model.hf.gather: written")
    return [CONFIG_FILE, *files]
