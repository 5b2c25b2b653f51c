"""Hugging Face weights straight into sharded jax arrays: each process reads only the blocks of each parameter that
its own (addressable) devices hold and places them, one parameter at a time (`place_hf_params`). No host holds
the whole model, nor one whole parameter unless its devices hold all of it.

Not `jax.make_array_from_callback`: that calls back once per addressable device and keeps every returned block on
the host until all are placed (a whole parameter, on a host whose devices hold all of it), reading a block that
several local devices hold (a replica) once per device. Here each distinct block is read once, put on every local
device that holds it, and dropped before the next is read.
"""

from __future__ import annotations

import logging

import jax
import numpy as np

from jaxpar.log import human_bytes
from jaxpar.model.hf.lazy import Bounds, HFSliceReader

_LOGGER = logging.getLogger("jaxpar.model.hf")


def _bounds(index: tuple[slice, ...] | None, shape: tuple[int, ...]) -> Bounds:
    """A shard's index (slices; None: the whole array) as [start, stop) per axis."""
    out = []
    for s, size in zip(index or (slice(None),) * len(shape), shape):
        start, stop, step = s.indices(size)
        if step != 1:
            raise ValueError(f"a shard index with step {step} ({index}) is not a block")
        out.append((start, stop))
    return tuple(out)


def addressable_blocks(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> dict[Bounds, list[jax.Device]]:
    """The distinct blocks (bounds) of an array of `shape` that this process's devices hold under `sharding`, each
    with the local devices that hold it (several where it is replicated), in the sharding's device order."""
    blocks: dict[Bounds, list[jax.Device]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        blocks.setdefault(_bounds(index, shape), []).append(device)
    return blocks


def _place(reader: HFSliceReader, path: tuple[str, ...], target: jax.ShapeDtypeStruct) -> jax.Array:
    shape, sharding = tuple(target.shape), target.sharding
    placed = {}
    for bounds, devices in addressable_blocks(shape, sharding).items():
        block = reader.read(path, bounds).astype(target.dtype, copy=False)
        for device in devices:
            placed[device] = jax.device_put(block, device)
        del block
    arrays = [placed[d] for d in sharding.addressable_devices_indices_map(shape)]
    out = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
    return out.block_until_ready()  # this parameter's host buffers are free before the next is read


def place_hf_params(reader: HFSliceReader, target: dict) -> dict:
    """The parameters of `reader`'s directory placed onto `target`'s shardings, reading only this process's blocks.

    Args:
      reader: the model's `jaxpar.model.hf.lazy.HFSliceReader` (its `bytes_read` counts what this reads).
      target: the model's parameter tree (`jaxpar.model.init_params`' structure) of `jax.ShapeDtypeStruct`s with
        shardings: each parameter's shape, dtype (float32: the stored values exactly; another float dtype: rounded
        from float32) and sharding.

    Returns:
      The tree of `jax.Array`s of the target's dtypes and shardings.

    Host memory: one block (one device's shard of one parameter, float32) and its read buffer in the stored dtype
    at a time, besides the blocks already placed (on the CPU backend a device's memory is the host's).

    Raises:
      ValueError: the target and the directory's parameters differ (the message names the paths).
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    paths = [tuple(str(getattr(k, "key", k)) for k in keys) for keys, _ in flat]
    missing, extra = sorted(set(paths) - set(reader.paths())), sorted(set(reader.paths()) - set(paths))
    if missing or extra:
        raise ValueError(
            f"the target parameters and the {reader.cfg.name} weights of {reader.hf_dir} differ: "
            f"not in the directory: {['/'.join(p) for p in missing]}; not in the target: {['/'.join(p) for p in extra]}"
        )
    start = reader.bytes_read
    leaves = [_place(reader, path, spec) for path, (_, spec) in zip(paths, flat)]
    held = sum(int(np.prod(s.data.shape)) * s.data.dtype.itemsize for x in leaves for s in x.addressable_shards)
    _LOGGER.info(
        "read %s of the %s of %s (this process's slices, %s); its devices hold %s",
        human_bytes(reader.bytes_read - start),
        human_bytes(reader.total_bytes),
        reader.hf_dir,
        reader.stored_dtype,
        human_bytes(held),
    )
    return jax.tree_util.tree_unflatten(treedef, leaves)
