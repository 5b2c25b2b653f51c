"""The parameters alone of a jaxpar checkpoint: for export and for `model.init_from`, whatever the run's optimizer
and layout, without reading its optimizer state (a quarter of the bytes of an AdamW state).

Reads the step's Orbax metadata for the arrays' shapes and dtypes and restores only `master` (the float32 copy
under precision.layout=16p) or else `params` (Orbax's partial restore): onto one CPU device as host numpy, or onto
shardings the caller gives, each process reading only its own shards.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxpar.checkpoint.saved import saved_config, select_step
from jaxpar.config import Config, load_config
from jaxpar.config.schema import STACK_ATTRIBUTE


def restore_params(
    path: str,
    step: int | None = None,
    *,
    shardings: dict | None = None,
    stack_rows: int | None = None,
) -> tuple[dict, Config, int]:
    """(float32 parameters, the saved config, the step) of a checkpoint: a run dir, its checkpoints/ dir or one step
    dir; `step` None: the step dir given, else the latest complete one.

    Args:
      shardings: None: the parameters come back as host numpy (all of them in this process's memory: small models
        and tools). Else a tree of shardings shaped like the parameters: jax arrays with those shardings, each
        process reading only the shards its devices hold.
      stack_rows: rows of the layer stack to return: a run over pipeline stages that do not divide its layers
        saves the stack with zero rows after the last layer (`jaxpar.parallel.layer_split.stored_rows`), cut or
        zero-padded here to these rows (None: the model's layers, `ModelConfig.stack_depth`).

    Raises:
      FileNotFoundError: no complete checkpoint at `path` (or no step `step`: the message lists the steps there
        are), or a step without a saved config.
      CheckpointFormatError (a ConfigError): a format version this jaxpar does not read.
    """
    root, chosen = select_step(path, step)
    cfg = load_config(saved_config(root, chosen), validate=False)
    step_dir = os.path.join(root, str(chosen))
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    state_dir = os.path.join(step_dir, "state")
    metadata = checkpointer.metadata(state_dir)
    tree = metadata.item_metadata.tree if hasattr(metadata, "item_metadata") else metadata.tree
    key = "master" if "master" in tree else "params"
    rows = cfg.model.stack_depth if stack_rows is None else stack_rows

    def shape(path, m) -> tuple[int, ...]:
        stacked = STACK_ATTRIBUTE in [getattr(k, "key", None) for k in path] and len(m.shape) >= 1
        return (rows, *m.shape[1:]) if stacked else tuple(m.shape)

    saved = jax.tree_util.tree_map_with_path(lambda k, m: jax.ShapeDtypeStruct(shape(k, m), m.dtype), tree[key])
    resized = any(tuple(m.shape) != s.shape for m, s in zip(jax.tree.leaves(tree[key]), jax.tree.leaves(saved)))
    if shardings is None:
        host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
        placed = jax.tree.map(lambda s: host, saved)
    else:
        placed = shardings
    target = {key: jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), saved, placed)}
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    if resized:  # the stack's zero rows cut or added (Orbax truncates or pads with zeros when not strict)
        restore_args = jax.tree.map(lambda a: dataclasses.replace(a, strict=False), restore_args)
    restored = checkpointer.restore(
        state_dir,
        args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True),
    )
    if shardings is None:
        params = jax.tree.map(lambda x: np.asarray(jax.device_get(x), dtype=np.float32), restored[key])
    else:
        params = jax.tree.map(lambda x: x.astype(jnp.float32), restored[key])  # a no-op for float32
    return params, cfg, chosen
