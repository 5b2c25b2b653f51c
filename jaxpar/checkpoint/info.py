"""What a checkpoint directory holds, read from its files alone: steps, saved config and mesh, data position, and
every array's name, shape, dtype and saved sharding.

    info = checkpoint_info("runs/tiny")          # a run dir, its checkpoints/ dir, or one step dir
    print(format_checkpoint_info(info))

Layout and completeness are those of `jaxpar.checkpoint.store`: `<root>/<step>/{state,data,config}`, a step counts
once it holds `commit_success.txt`. Step directories without the marker and Orbax's
`<step>.orbax-checkpoint-tmp*` directories (a save interrupted or still in flight) and `<step>.corrupt*` ones (an
unreadable step a restore set aside) are listed as incomplete, never chosen. Array facts come from Orbax's metadata
(`StandardCheckpointHandler.metadata`): no array data is read and no device is used, so this runs on a laptop for
a checkpoint written by many GPU hosts (given the shared directory).
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxpar.checkpoint.format import (
    FORMAT_ITEM,
    JAXPAR_VERSION,
    READ_VERSIONS,
    UNRECORDED_VERSION,
    CheckpointFormatError,
    reads,
)
from jaxpar.checkpoint.store import (
    _COMMIT_MARKER,
    _CONFIG,
    _DATA,
    _STATE,
    _STEP_NAME,
    _TMP_STEP,
    RUN_CHECKPOINT_DIR,
    _is_complete_step_dir,
    read_json_item,
    resolve_checkpoint_path,
)
from jaxpar.config.mesh_axes import CONFIG_AXES
from jaxpar.config.schema import MeshConfig

_CORRUPT_STEP = re.compile(r"(0|[1-9][0-9]*)\.corrupt[0-9]*")  # an unreadable step renamed by a restore
MODEL_DIMS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff")


def list_step_dirs(root: str) -> tuple[list[int], list[dict]]:
    """Step directories under checkpoint root `root`.

    Returns:
      (complete steps ascending, incomplete entries sorted by step): each incomplete entry is
      {"name": directory name, "step": int, "reason": str}.
    """
    complete, incomplete = [], []
    for name in os.listdir(root):
        full = os.path.join(root, name)
        if not os.path.isdir(full):
            continue
        if _is_complete_step_dir(full):
            complete.append(int(name))
        elif _STEP_NAME.fullmatch(name):
            incomplete.append({"name": name, "step": int(name), "reason": f"no {_COMMIT_MARKER}"})
        elif (m := _TMP_STEP.fullmatch(name)) is not None:
            incomplete.append(
                {
                    "name": name,
                    "step": int(m.group(1)),
                    "reason": "Orbax temporary directory (save interrupted or in flight)",
                }
            )
        elif (m := _CORRUPT_STEP.fullmatch(name)) is not None:
            incomplete.append(
                {"name": name, "step": int(m.group(1)), "reason": "set aside by a restore that could not read it"}
            )
    return sorted(complete), sorted(incomplete, key=lambda e: (e["step"], e["name"]))


def _spec_text(sharding: Any) -> str:
    """The saved sharding as text: `P(data, fsdp)` for a NamedSharding, else its kind."""
    spec = getattr(sharding, "partition_spec", None)
    if spec is not None:
        return (
            "P("
            + ", ".join("None" if d is None else d if isinstance(d, str) else "(" + ", ".join(d) + ")" for d in spec)
            + ")"
        )
    if sharding is None:
        return "-"
    return "single device" if "SingleDevice" in type(sharding).__name__ else type(sharding).__name__


def _saved_mesh(sharding: Any) -> dict[str, int] | None:
    names, shape = getattr(sharding, "axis_names", None), getattr(sharding, "shape", None)
    if names is None or shape is None:
        return None
    return {str(a): int(n) for a, n in zip(names, np.asarray(shape).tolist())}


def read_arrays(state_dir: str) -> tuple[list[dict], dict[str, int] | None]:
    """Array metadata of a saved state, without reading array data.

    Returns:
      (arrays sorted by name, saving mesh): each array is {"name": dotted pytree path ("opt_state.0.mu.w_DF"),
      "shape": list of ints, "dtype": str, "bytes": int (global, unsharded), "sharding": saved layout text};
      the saving mesh is {axis: size} of the first NamedSharding found, or None.

    Raises:
      FileNotFoundError: `state_dir` is missing; other Orbax errors for unreadable metadata.
    """
    if not os.path.isdir(state_dir):
        raise FileNotFoundError(f"{state_dir} is missing: the step holds no saved state")
    tree = ocp.StandardCheckpointHandler().metadata(epath.Path(state_dir))
    tree = tree.tree if hasattr(tree, "tree") else tree
    flat = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(tree, keep_empty_nodes=True), sep=".")
    arrays, mesh = [], None
    for name in sorted(flat):
        meta = flat[name]
        if not hasattr(meta, "shape"):  # an empty optax state: no array
            continue
        dtype = np.dtype(meta.dtype)
        sharding = getattr(meta, "sharding", None)
        mesh = mesh or _saved_mesh(sharding)
        arrays.append(
            {
                "name": name,
                "shape": [int(n) for n in meta.shape],
                "dtype": dtype.name,
                "bytes": int(math.prod(meta.shape)) * dtype.itemsize,
                "sharding": _spec_text(sharding),
            }
        )
    return arrays, mesh


def format_info(step_dir: str) -> dict:
    """The step's format (`jaxpar.checkpoint.format`): {"format_version", "jaxpar_version" (None if not recorded),
    "recorded" (False: a step written before versions were recorded, read as version 1), "readable" (whether
    this jaxpar restores that version)}."""
    record = read_json_item(step_dir, FORMAT_ITEM)
    version = UNRECORDED_VERSION if record is None else record.get("format_version")
    return {
        "format_version": version,
        "jaxpar_version": None if record is None else record.get("jaxpar_version"),
        "recorded": record is not None,
        "readable": reads(version),
    }


def _format_line(fmt: dict) -> str:
    """One line of `format_checkpoint_info`: the step's format version, who wrote it, whether it restores here."""
    version = fmt["format_version"]
    if not fmt["recorded"]:
        by = " (not recorded: written before jaxpar recorded versions)"
    else:
        by = f", written by jaxpar {_fmt(fmt['jaxpar_version'])}"
    reads = ", ".join(map(str, READ_VERSIONS))
    if fmt["readable"]:
        return f"  format version {version}{by}"
    return f"  format version {version}{by}: this jaxpar ({JAXPAR_VERSION}) reads {reads} and cannot restore it"


def summarize_config(config: dict | None) -> dict:
    """Mesh sizes, ZeRO stage, precision layout, batch and model dims of a saved config dict (`Config.to_dict`).

    Returns:
      {"mesh": {data, fsdp, tensor, pipeline}, "zero_stage", "layout", "global_batch_size", "seq_len",
      "model": {vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, d_ff}}; a key the config lacks
      is None (all None without a config).
    """
    config = config or {}

    def section(name: str) -> dict:
        value = config.get(name)
        return value if isinstance(value, dict) else {}

    mesh = section("mesh")
    return {
        # an axis a saved mesh does not name has its schema size (mesh.context in a run saved before it existed: 1)
        "mesh": {a: mesh.get(a, getattr(MeshConfig(), a) if mesh else None) for a in CONFIG_AXES},
        "zero_stage": section("optimizer").get("zero_stage"),
        "layout": section("precision").get("layout"),
        "global_batch_size": section("train").get("global_batch_size"),
        "seq_len": section("data").get("seq_len"),
        "model": {k: section("model").get(k) for k in MODEL_DIMS},
    }


def checkpoint_info(path: str, step: int | None = None) -> dict:
    """Everything `jaxpar-checkpoints` shows, as a JSON-safe dict.

    Args:
      path: a run dir (holding `checkpoints/`), a checkpoint root, or one step dir `.../<step>`.
      step: the step to describe; None: the one `path` names, else the latest complete step.

    Returns:
      {"root", "steps" (complete, ascending), "incomplete" (see `list_step_dirs`), "step", "step_dir",
      "format" (`format_info`), "config" (the saved config dict or None), "summary" (`summarize_config`), "data"
      (data-iterator position,
      e.g. {"next_sample": 128}, or None), "arrays" (see `read_arrays`), "saved_mesh" (mesh of the saved
      arrays' shardings or None), "num_arrays", "total_bytes" (all arrays, unsharded), "num_params" (elements of
      arrays under `params.`)}.

    Raises:
      FileNotFoundError: `path` missing or an unfinished save (`jaxpar.checkpoint.store.resolve_checkpoint_path`), no
        complete checkpoint, or `step` not complete there (the message lists the complete steps).
      ValueError: `step` contradicts the step dir `path` names, or the step's metadata cannot be read (a damaged
        checkpoint; the message names the step).
    """
    root, path_step = resolve_checkpoint_path(path)
    if step is not None and path_step is not None and step != path_step:
        raise ValueError(f"--step {step} contradicts the step directory {path} (step {path_step})")
    step = path_step if step is None else step
    steps, incomplete = list_step_dirs(root)
    if not steps:
        extra = f" (incomplete: {', '.join(e['name'] for e in incomplete)})" if incomplete else ""
        raise FileNotFoundError(
            f"no complete checkpoint in {root}{extra}; pass a run dir, its {RUN_CHECKPOINT_DIR}/ dir, or a step dir"
        )
    if step is None:
        step = steps[-1]
    elif step not in steps:
        why = next((f": {e['reason']}" for e in incomplete if e["step"] == step), "")
        raise FileNotFoundError(
            f"no complete checkpoint for step {step} in {root}{why} (complete steps: {', '.join(map(str, steps))})"
        )
    step_dir = os.path.join(root, str(step))
    fmt = None
    try:
        fmt = format_info(step_dir)
        config, data = read_json_item(step_dir, _CONFIG), read_json_item(step_dir, _DATA)
        arrays, saved_mesh = read_arrays(os.path.join(step_dir, _STATE))
    except (OSError, ValueError) as e:  # a damaged step, or one of a format this jaxpar does not read: say which
        if fmt is not None and not fmt["readable"]:
            raise CheckpointFormatError(step_dir, fmt["format_version"], fmt["jaxpar_version"]) from e
        raise ValueError(f"cannot read the metadata of step {step} in {step_dir}: {e}") from e
    return {
        "root": root,
        "steps": steps,
        "incomplete": incomplete,
        "step": step,
        "step_dir": step_dir,
        "format": fmt,
        "config": config,
        "summary": summarize_config(config),
        "data": data,
        "arrays": arrays,
        "saved_mesh": saved_mesh,
        "num_arrays": len(arrays),
        "total_bytes": sum(a["bytes"] for a in arrays),
        "num_params": sum(math.prod(a["shape"]) for a in arrays if a["name"].startswith("params.")),
    }


def _fmt(value: Any) -> str:
    return "-" if value is None else str(value)


def format_checkpoint_info(info: dict) -> str:
    """Plain-text report of a `checkpoint_info` dict: steps, then the chosen step's config, data and arrays."""
    s = info["summary"]
    lines = [
        f"checkpoint root {info['root']}",
        f"  complete steps: {', '.join(map(str, info['steps']))} (latest {info['steps'][-1]})",
    ]
    for e in info["incomplete"]:
        lines.append(f"  incomplete: {e['name']} (step {e['step']}; {e['reason']}; never restored)")
    lines.append(f"step {info['step']}: {info['step_dir']}")
    lines.append(_format_line(info["format"]))
    if info["config"] is None:
        lines.append("  config: not saved")
    else:
        mesh = s["mesh"]
        sizes = [mesh[a] for a in CONFIG_AXES]
        resolved = all(isinstance(n, int) and n >= 1 for n in sizes)  # a config saved before resolve: -1
        total = f" ({math.prod(sizes)} devices)" if resolved else ""
        lines.append("  mesh: " + " ".join(f"{a}={_fmt(mesh[a])}" for a in CONFIG_AXES) + total)
        lines.append(
            f"  zero_stage: {_fmt(s['zero_stage'])}   precision layout: {_fmt(s['layout'])}   "
            f"global batch: {_fmt(s['global_batch_size'])} x seq_len {_fmt(s['seq_len'])}"
        )
        lines.append("  model: " + " ".join(f"{k}={_fmt(v)}" for k, v in s["model"].items()))
    if info["saved_mesh"]:
        lines.append("  arrays saved from mesh: " + " ".join(f"{a}={n}" for a, n in info["saved_mesh"].items()))
    lines.append(f"  data position: {'not saved' if info['data'] is None else json.dumps(info['data'])}")
    lines.append(
        f"  arrays: {info['num_arrays']} ({info['num_params']:,} parameters; "
        f"{info['total_bytes']:,} bytes in all, unsharded)"
    )
    rows = [("name", "shape", "dtype", "saved sharding")] + [
        (a["name"], str(tuple(a["shape"])), a["dtype"], a["sharding"]) for a in info["arrays"]
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        lines.append("    " + "  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
    return "\n".join(lines)
