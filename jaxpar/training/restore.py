"""Restore a run's checkpoint onto a mesh of your own (or one device) and use the model.

    restored = restore("runs/tiny", ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipeline=1"],
                       devices=jax.devices()[:1])
    loss_sum, tokens = make_eval_step(restored.plan)(restored.params, batch)      # evaluate
    text = sample_text(restored.plan, restored.params, prompt="def ", num_tokens=64, seed=0)  # sample
    plan = build_plan(restored.cfg, restored.plan.mesh, optimizer=optax.lion(1e-5))  # train on, another optimizer
    state = init_state(plan, params=restored.params)

The run's config comes from the checkpoint itself (saved with every step), so the model is rebuilt exactly as
trained; `overrides` change what a restore may change: the mesh, the ZeRO stage, precision of compute, the
tensor-parallel settings, and how the model is computed (`jaxpar.config.resume.RESTORE_MAY_CHANGE`). Arrays come
back directly in the new layout (Orbax reads each device's shard).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import jax
import optax

from jaxpar.checkpoint.mismatch import CheckpointMismatchError
from jaxpar.checkpoint.saved import saved_config, select_step
from jaxpar.checkpoint.store import Checkpointer
from jaxpar.config import Config, ConfigError, load_config
from jaxpar.config.resume import check_restored_model
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.loss import LossFn
from jaxpar.training.plan import StepPlan, build_plan
from jaxpar.training.state import abstract_state


@dataclasses.dataclass
class Restored:
    """A restored run.

    Attributes:
      cfg: the run's config with the overrides applied.
      plan: the step plan on the new mesh (`jaxpar.training.plan.build_plan`).
      state: the train state {"step", "params", "opt_state"[, "master"]}, sharded as `plan.state_shardings`.
      step: the checkpoint's step.
      data_state: the data position saved with it.
    """

    cfg: Config
    plan: StepPlan
    state: dict
    step: int
    data_state: dict

    @property
    def params(self) -> dict:
        """The fp32 parameters: the master copy under `precision.layout=16p`, else the parameters."""
        return self.state.get("master", self.state["params"])


def restore(
    path: str,
    overrides: Sequence[str] = (),
    *,
    devices: Sequence[jax.Device] | None = None,
    step: int | None = None,
    optimizer: optax.GradientTransformation | None = None,
    learning_rate: optax.Schedule | float | None = None,
    loss_fn: LossFn | None = None,
) -> Restored:
    """Restores a checkpoint onto a mesh over `devices` with the run's own config plus `overrides`.

    Args:
      path: a run directory, its checkpoints/ directory, or one step directory.
      overrides: dotted config overrides (e.g. "mesh.data=1"); the mesh must cover `devices`.
      devices: the devices of the new mesh (default: all).
      step: which step (default: the step directory given, else the latest complete one).
      optimizer, learning_rate, loss_fn: as `build_plan`; `optimizer` must be the one the run was trained with
        (its state is part of the checkpoint). To continue with another optimizer, restore with the run's own
        and start a new state from `Restored.params` (`init_state(plan, params=...)`).

    Raises:
      FileNotFoundError: no complete checkpoint at `path` (or no step `step`: the message lists the steps).
      CheckpointFormatError (a ConfigError): the step's format version is one this jaxpar does not read.
      ConfigError: the saved config with `overrides` does not fit `devices` (the message names the key);
        `overrides` change the model (`jaxpar.config.resume.check_restored_model`, as every restore); the arrays
        do not fit (an optimizer other than the run's: the message summarises the differences,
        `jaxpar.checkpoint.mismatch.CheckpointMismatchError` is its cause).
    """
    root, chosen = select_step(path, step)
    saved = saved_config(root, chosen)  # the format version checked first
    devices = list(devices) if devices is not None else jax.devices()
    cfg = load_config(saved, overrides, num_devices=len(devices))
    check_restored_model(saved, cfg.model, os.path.join(root, str(chosen)), "leave those keys out of the overrides")
    reader = Checkpointer.read_only(root)
    try:
        plan = build_plan(
            cfg, build_mesh(cfg, devices), optimizer=optimizer, learning_rate=learning_rate, loss_fn=loss_fn
        )
        try:
            state, data_state, _ = reader.restore(chosen, abstract_state(plan))
        except CheckpointMismatchError as e:
            raise ConfigError(
                f"checkpoint step {chosen} in {root} does not fit ({e.summary()}); a run trained with an optimizer "
                f"of its own restores with optimizer= that optimizer (a run of the default AdamW without one)"
            ) from e
    finally:
        reader.close()
    return Restored(cfg=cfg, plan=plan, state=state, step=chosen, data_state=data_state)
