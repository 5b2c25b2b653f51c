"""Logical-to-mesh axis rules, and the PartitionSpecs of parameters, gradients and optimizer state.

Two tables, kept apart: `PARAM_RULES` for weights, `ACTIVATION_RULES` for activations and batches.
Every parameter is sharded along its `embed` dimension over `fsdp` (always) and, for the state kinds that
the configured ZeRO stage partitions, over `data` as well:

    zero_stage   parameters      gradients       optimizer state (and fp32 master)
    0            fsdp            fsdp            fsdp
    1            fsdp            fsdp            fsdp x data
    2            fsdp            fsdp x data     fsdp x data
    3            fsdp x data     fsdp x data     fsdp x data

(Rajbhandari et al. 2019, "ZeRO", section 5: P_os, P_os+g, P_os+g+p.) On the combined dimension the shard
order is fsdp-major, data-minor: the layout a reduce-scatter over `data` of an fsdp shard produces.
"""
from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar.config.mesh_axes import STORAGE_AXES

PARAM_RULES: dict[str, tuple[str, ...]] = {
    "layers": ("pipeline",),
    "embed": ("fsdp",),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "mlp": ("tensor",),
    "kv": (),
}

ACTIVATION_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "seq": (),
    "embed": (),
    "heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
}

STATE_KINDS = ("params", "grads", "opt_state")
_ZERO_PARTITIONED = {  # kinds partitioned over `data` at each ZeRO stage
    0: (),
    1: ("opt_state",),
    2: ("opt_state", "grads"),
    3: ("opt_state", "grads", "params"),
}


def partitioned_over_data(kind: str, zero_stage: int) -> bool:
    """Whether state of `kind` (params, grads, opt_state) is partitioned over the `data` axis."""
    if kind not in STATE_KINDS:
        raise ValueError(f"state kind {kind!r} is not one of {STATE_KINDS}")
    return kind in _ZERO_PARTITIONED[zero_stage]


def storage_axes(kind: str, zero_stage: int) -> tuple[str, ...]:
    """The `STORAGE_AXES` that split state of `kind` along its `embed` dimension at `zero_stage`: ("fsdp",), and
    ("fsdp", "data") (fsdp-major) where the stage partitions the kind over `data`."""
    return tuple(a for a in STORAGE_AXES if a == "fsdp" or partitioned_over_data(kind, zero_stage))


def logical_to_spec(names: tuple[str, ...], rules: dict[str, tuple[str, ...]], over_data: bool) -> P:
    """PartitionSpec for one array from its logical axis names and a rules table (`embed` also over `data`
    when `over_data`)."""
    dims = []
    for name in names:
        mesh_axes = rules[name]
        if name == "embed" and over_data:
            mesh_axes = mesh_axes + ("data",)
        dims.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return P(*dims)


def param_specs(logical: dict, kind: str, zero_stage: int) -> dict:
    """PartitionSpec per leaf of a logical-axes dict (see `jaxpar.model.logical_axes`) for a state kind."""
    over_data = partitioned_over_data(kind, zero_stage)
    return jax.tree.map(lambda names: logical_to_spec(names, PARAM_RULES, over_data), logical,
                        is_leaf=lambda x: isinstance(x, tuple))


def activation_spec(*names: str) -> P:
    """PartitionSpec of an activation or batch array from its logical axis names, e.g. ("batch", "seq")."""
    return logical_to_spec(names, ACTIVATION_RULES, over_data=False)


def named(mesh: Mesh, specs):
    """Maps a pytree of PartitionSpecs to NamedShardings on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def gathered_axes(spec: P) -> list[tuple[int, tuple[str, ...]]]:
    """For a parameter's spec: (dimension, mesh axes) pairs that are all-gathered before use.

    Only `fsdp` and `data` shards are gathered; `tensor` and `pipeline` shards stay local (they are split
    computations, not split storage).
    """
    out = []
    for dim, axes in enumerate(spec):
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        storage = tuple(a for a in axes if a in STORAGE_AXES)
        if storage:
            out.append((dim, storage))
    return out
