"""The five-axis device mesh: data, pipeline, fsdp, context, tensor (outermost to innermost; the names, the order and
why are `jaxpar.config.mesh_axes`).

All axes are `AxisType.Auto` on purpose: the forward/backward runs inside `jax.shard_map` where every
collective is written by hand, and the optimizer update outside it is elementwise on arrays whose
`NamedSharding`s are fixed at the jit boundary, so the compiler only has to insert the ZeRO all-gathers.
(Recent jax defaults `jax.make_mesh` to `Explicit` axes, which would make every sharding mismatch in the
update an error instead.)
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxpar.config.mesh_axes import DATA, DATA_PARALLEL_AXES, FSDP, MESH_AXES
from jaxpar.config.mesh_shape import resolve_mesh_shape
from jaxpar.config.schema import Config

__all__ = ["DATA_PARALLEL_AXES", "MESH_AXES", "build_mesh", "describe"]


def build_mesh(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Creates the mesh for `cfg.mesh` over `devices` (default: all devices of all processes).

    Raises:
      ConfigError: the sizes do not multiply to the device count (see `resolve_mesh_shape`).
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(cfg, len(devices))
    return jax.make_mesh(
        tuple(shape[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def process_mesh() -> Mesh:
    """A mesh of every device of every process with `data` over the processes and `fsdp` over each process's own
    devices (the other axes of size 1), whatever the cluster's topology: an array split over (data, fsdp) spreads
    over every device, and one split over `fsdp` alone is whole on every process. For moving whole tensors in and
    out of a job (Hugging Face import and export), not for training.

    Raises:
      ValueError: the processes hold different numbers of devices.
    """
    by_process: dict[int, list[jax.Device]] = {}
    for device in jax.devices():
        by_process.setdefault(device.process_index, []).append(device)
    counts = {len(devices) for devices in by_process.values()}
    if len(counts) != 1:
        raise ValueError(f"the processes hold different numbers of devices ({sorted(counts)}): no process mesh")
    rows = [sorted(by_process[p], key=lambda d: d.id) for p in sorted(by_process)]
    shape = {DATA: len(rows), FSDP: len(rows[0])}
    grid = np.array(rows, dtype=object).reshape([shape.get(a, 1) for a in MESH_AXES])
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def describe(mesh: Mesh) -> str:
    """One line such as `data=2 pipeline=1 fsdp=4 context=1 tensor=1 (8 devices)`."""
    sizes = " ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
    return f"{sizes} ({mesh.size} devices)"
