"""The mesh axes' names and orders, and the axis groups the step treats alike. No jax: the commands that must set
jax's device count before jax starts (`jaxpar-plan`, `jaxpar-sweep`) import it too.

Two orders of the same four names:
  * `MESH_AXES`, the device mesh (`jaxpar.parallel.mesh.build_mesh`), outermost to innermost: `tensor`
    innermost because its collectives sit on every layer's critical path and need the fastest link, `data`
    outermost because its one gradient reduction per step tolerates the slowest (cross-host) one. HLO replica
    groups follow this order.
  * `CONFIG_AXES`, the `mesh:` section (`jaxpar.config.schema.MeshConfig`'s fields): the order a config, a
    sweep point and a report name the sizes in ("data x fsdp x tensor x pipeline").
"""

from __future__ import annotations

import dataclasses

from jaxpar.config.schema import MeshConfig

MESH_AXES = ("data", "pipeline", "fsdp", "tensor")
# Each axis's name: code names an axis (a PartitionSpec entry, a collective's axis_name, a {axis: size} key)
# through these, never by a string of its own (tests/unit/test_architecture.py checks).
DATA, PIPELINE, FSDP, TENSOR = MESH_AXES
CONFIG_AXES = tuple(f.name for f in dataclasses.fields(MeshConfig))
DATA_PARALLEL_AXES = (DATA, FSDP)  # the axes that split the batch
# The axes that split weight storage rather than computation: a parameter's shards over them are all-gathered
# right before use (`jaxpar.parallel.gather`). fsdp always, data under ZeRO-3; on a dimension split over both
# the shard order is fsdp-major, data-minor (`jaxpar.parallel.sharding`).
STORAGE_AXES = (FSDP, DATA)


def mesh_sizes(mesh: MeshConfig) -> dict[str, int]:
    """{axis: size} of a `mesh:` section in `CONFIG_AXES` order (sizes as given: -1 until resolved)."""
    return {a: getattr(mesh, a) for a in CONFIG_AXES}
