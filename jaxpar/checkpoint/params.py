"""The parameters alone of a jaxpar checkpoint, on the host: for export and for `model.init_from`, whatever the
run's optimizer and layout, without reading its optimizer state (a quarter of the bytes of an AdamW state).

Reads the step's Orbax metadata for the arrays' shapes and dtypes and restores only `master` (the float32 copy
under precision.layout=16p) or else `params` onto one CPU device (Orbax's partial restore).
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxpar.checkpoint.saved import saved_config, select_step
from jaxpar.config import Config, load_config


def restore_params(path: str, step: int | None = None) -> tuple[dict, Config, int]:
    """(float32 numpy parameters, the saved config, the step) of a checkpoint: a run dir, its checkpoints/ dir or
    one step dir; `step` None: the step dir given, else the latest complete one.

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
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    target = {key: jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=sharding), tree[key])}
    restored = checkpointer.restore(
        state_dir,
        args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
        ),
    )
    params = jax.tree.map(lambda x: np.asarray(jax.device_get(x), dtype=np.float32), restored[key])
    return params, cfg, chosen
