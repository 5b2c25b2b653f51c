"""The mesh axes' names and orders, and the axis groups the step treats alike. No jax: the commands that must set
jax's device count before jax starts (`jaxpar-plan`, `jaxpar-sweep`) import it too.

Two orders of the same five names:
  * `MESH_AXES`, the device mesh (`jaxpar.parallel.mesh.build_mesh`), outermost to innermost: `tensor`
    innermost because its collectives sit on every layer's critical path and need the fastest link, `data`
    outermost because its one gradient reduction per step tolerates the slowest (cross-host) one. `context`
    comes next to `tensor`: its K/V all-gather or ring permutes are on every layer's critical path too, but
    a ring's permute overlaps the block's attention and an all-gather moves only the key/value heads (a layer's
    K/V against tensor's two all-reduces or all-gather + reduce-scatter of the whole activation), so tensor
    keeps the fastest link and context takes the next (the Llama 3 report's order, Dubey et al. 2024, section
    3.3.2: TP, CP, PP, DP from innermost). A size-1 axis does not change the device order: with context 1 the
    devices lie as the other four axes alone place them. HLO replica groups follow this order.
  * `CONFIG_AXES`, the `mesh:` section (`jaxpar.config.schema.MeshConfig`'s fields): the order a config, a
    sweep point and a report name the sizes in ("data x fsdp x tensor x pipeline x context").
"""

from __future__ import annotations

import dataclasses

from jaxpar.config.schema import MeshConfig

MESH_AXES = ("data", "pipeline", "fsdp", "context", "tensor")
# Each axis's name: code names an axis (a PartitionSpec entry, a collective's axis_name, a {axis: size} key)
# through these, never by a string of its own (tests/unit/test_architecture.py checks).
DATA, PIPELINE, FSDP, CONTEXT, TENSOR = MESH_AXES
CONFIG_AXES = tuple(f.name for f in dataclasses.fields(MeshConfig))
DATA_PARALLEL_AXES = (DATA, FSDP)  # the axes that split the batch's rows
# The axes that split the batch's tokens: its rows over data x fsdp, each row's sequence over context. A sum over
# the batch's tokens (the loss, the token count, the MoE statistics) is a psum over these.
TOKEN_AXES = (DATA, FSDP, CONTEXT)
# The axes that split weight storage rather than computation: a parameter's shards over them are all-gathered
# right before use (`jaxpar.parallel.gather`). fsdp always, data under ZeRO-3; on a dimension split over both
# the shard order is fsdp-major, data-minor (`jaxpar.parallel.sharding`).
STORAGE_AXES = (FSDP, DATA)


def mesh_sizes(mesh: MeshConfig) -> dict[str, int]:
    """{axis: size} of a `mesh:` section in `CONFIG_AXES` order (sizes as given: -1 until resolved)."""
    return {a: getattr(mesh, a) for a in CONFIG_AXES}
