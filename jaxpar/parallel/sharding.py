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

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config.mesh_axes import CONTEXT, DATA, DATA_PARALLEL_AXES, FSDP, PIPELINE, STORAGE_AXES, TENSOR

EXPERTS_AXIS = "experts"  # the logical name of stacked experts' leading dimension (jaxpar.model.moe)

PARAM_RULES: dict[str, tuple[str, ...]] = {
    "layers": (PIPELINE,),
    "embed": (FSDP,),
    "vocab": (TENSOR,),
    "heads": (TENSOR,),
    "mlp": (TENSOR,),
    "kv": (),
    # Multi-head Latent Attention's compressed latents (jaxpar.model.mla) as a down-projection's output: never
    # split, every tensor rank computes the whole latent (the projection's embed input is what fsdp splits).
    "latent": (),
    # Mixture-of-experts weights stacked over experts (jaxpar.model.moe): split over the run's expert axes
    # (`model.moe.expert_axes`, passed as `expert_axes` below), none by default.
    EXPERTS_AXIS: (),
}

ACTIVATION_RULES: dict[str, tuple[str, ...]] = {
    "batch": DATA_PARALLEL_AXES,
    "seq": (CONTEXT,),  # context parallelism; the step lays each device's slice out load-balanced
    "embed": (),
    "heads": (TENSOR,),
    "mlp": (TENSOR,),
    "vocab": (TENSOR,),
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
    return tuple(a for a in STORAGE_AXES if a == FSDP or partitioned_over_data(kind, zero_stage))


def logical_to_spec(
    names: tuple[str, ...], rules: dict[str, tuple[str, ...]], over_data: bool, expert_axes: tuple[str, ...] = ()
) -> P:
    """PartitionSpec for one array from its logical axis names and a rules table (`embed` also over `data`
    when `over_data`).

    Expert parallelism: an array with an `experts` dimension has it split over `expert_axes` (mesh axes among
    data and fsdp, major to minor), and those axes leave its other dimensions: an expert's `embed` dimension is
    split only over the storage axes that are not expert axes. Every device then holds whole experts, and the
    expert split replaces the fsdp / ZeRO split on those axes (same bytes per device)."""
    taken = set(expert_axes) if EXPERTS_AXIS in names else set()
    dims = []
    for name in names:
        if name == EXPERTS_AXIS:
            mesh_axes = tuple(expert_axes)
        else:
            mesh_axes = () if name is None else rules[name]  # None: a dimension never sharded
            if name == "embed" and over_data:
                mesh_axes = mesh_axes + (DATA,)
            mesh_axes = tuple(a for a in mesh_axes if a not in taken)
        dims.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return P(*dims)


def param_specs(logical: dict, kind: str, zero_stage: int, expert_axes: tuple[str, ...] = ()) -> dict:
    """PartitionSpec per leaf of a logical-axes dict (see `jaxpar.model.logical_axes`) for a state kind; experts
    split over `expert_axes` (`logical_to_spec`)."""
    over_data = partitioned_over_data(kind, zero_stage)
    return jax.tree.map(
        lambda names: logical_to_spec(names, PARAM_RULES, over_data, expert_axes),
        logical,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def activation_spec(*names: str) -> P:
    """PartitionSpec of an activation or batch array from its logical axis names, e.g. ("batch", "seq")."""
    return logical_to_spec(names, ACTIVATION_RULES, over_data=False)


def named(mesh: Mesh, specs):
    """Maps a pytree of PartitionSpecs to NamedShardings on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def dim_axes(entry) -> tuple[str, ...]:
    """The mesh axes one PartitionSpec entry splits a dimension over: None -> (), "fsdp" -> ("fsdp",), a tuple as
    is."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def spec_axes(spec: P) -> set[str]:
    """Every mesh axis a PartitionSpec splits over."""
    return {a for entry in spec for a in dim_axes(entry)}


def gathered_axes(spec: P, names: tuple[str, ...] | None = None) -> list[tuple[int, tuple[str, ...]]]:
    """For a parameter's spec: (dimension, mesh axes) pairs that are all-gathered before use.

    Only `fsdp` and `data` shards are gathered; `tensor` and `pipeline` shards stay local (they are split
    computations, not split storage), and so does an `experts` dimension (pass the parameter's logical `names`):
    under expert parallelism each device computes with its own experts.
    """
    out = []
    for dim, entry in enumerate(spec):
        if names is not None and names[dim] == EXPERTS_AXIS:
            continue
        storage = tuple(a for a in dim_axes(entry) if a in STORAGE_AXES)
        if storage:
            out.append((dim, storage))
    return out


def opt_state_specs(opt_state, params, specs) -> Any:
    """PartitionSpec per leaf of any optax optimizer state: a parameter's `opt_state` spec for the leaves that
    stand for that parameter, replicated (`P()`) for everything else.

    A state leaf stands for a parameter when its pytree path ends with the parameter's path (optax keeps
    per-parameter state as copies of the parameter tree: Adam's and Lion's `mu`, `nu`, Adafactor's unfactored
    `v`, inside `chain`, `masked`, `multi_transform`, ...) and it has the parameter's shape. Leaves that fail
    either test stay whole on every device: scalars (counts, skip counters), and state whose shape differs from
    its parameter, such as Adafactor's factored row and column statistics `v_row`, `v_col` (the parameter
    shape with one dimension removed) and its (1,)-shaped placeholders. So ZeRO partitions exactly the
    parameter-shaped state, and no leaf gets a spec that does not fit its shape.

    Args:
      opt_state: the optimizer state, arrays or ShapeDtypeStructs (e.g. `jax.eval_shape(tx.init, params)`).
      params: the parameter tree, arrays or ShapeDtypeStructs.
      specs: PartitionSpec tree matching `params` (`param_specs(logical, "opt_state", zero_stage)`).

    Returns:
      a PartitionSpec tree with the structure of `opt_state`.
    """
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    by_path = {tuple(path): (leaf.shape, spec) for (path, leaf), spec in zip(leaves, spec_leaves, strict=True)}
    depths = sorted({len(path) for path in by_path}, reverse=True)  # longest first: the most specific match

    def spec_of(path, leaf):
        for depth in depths:
            match = by_path.get(tuple(path[-depth:])) if len(path) >= depth else None
            if match is not None:
                shape, spec = match
                return spec if tuple(leaf.shape) == tuple(shape) else P()
        return P()

    return jax.tree_util.tree_map_with_path(spec_of, opt_state)
