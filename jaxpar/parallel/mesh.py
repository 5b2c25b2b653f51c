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
from jax.sharding import AxisType, Mesh

from jaxpar.config.mesh_axes import DATA_PARALLEL_AXES, MESH_AXES
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


def describe(mesh: Mesh) -> str:
    """One line such as `data=2 pipeline=1 fsdp=4 context=1 tensor=1 (8 devices)`."""
    sizes = " ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
    return f"{sizes} ({mesh.size} devices)"
