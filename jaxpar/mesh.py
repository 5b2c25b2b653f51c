"""The four-axis device mesh: data, pipeline, fsdp, tensor (outermost to innermost).

`tensor` is innermost because its collectives sit on the critical path of every layer and need the fastest
link; `data` is outermost because its one gradient reduction per step tolerates the slowest (cross-host) link.
All axes are `AxisType.Auto` on purpose: the forward/backward runs inside `jax.shard_map` where every
collective is written by hand, and the optimizer update outside it is elementwise on arrays whose
`NamedSharding`s are fixed at the jit boundary, so the compiler only has to insert the ZeRO all-gathers.
(Recent jax defaults `jax.make_mesh` to `Explicit` axes, which would make every sharding mismatch in the
update an error instead.)
"""
from __future__ import annotations

from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh

from jaxpar.config.schema import Config
from jaxpar.config.validate import resolve_mesh_shape

AXES = ("data", "pipeline", "fsdp", "tensor")
DATA_PARALLEL_AXES = ("data", "fsdp")  # axes that split the batch


def build_mesh(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Creates the mesh for `cfg.mesh` over `devices` (default: all devices of all processes).

    Raises:
      ConfigError: the sizes do not multiply to the device count (see `resolve_mesh_shape`).
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(cfg, len(devices))
    return jax.make_mesh(tuple(shape[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES),
                         devices=devices)


def describe(mesh: Mesh) -> str:
    """One line such as `data=2 pipeline=1 fsdp=4 tensor=1 (8 devices)`."""
    sizes = " ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
    return f"{sizes} ({mesh.size} devices)"
