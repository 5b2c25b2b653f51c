"""Restore a run's checkpoint onto a mesh of your own (or one device) and use the model.

    restored = restore("runs/tiny", ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipeline=1"],
                       devices=jax.devices()[:1])
    loss_sum, tokens = make_eval_step(restored.plan)(restored.params, batch)      # evaluate
    text = sample_text(restored.plan, restored.params, prompt="def ", num_tokens=64, seed=0)  # sample
    plan = build_plan(restored.cfg, restored.plan.mesh, optimizer=optax.lion(1e-5))  # train on, another optimizer
    state = init_state(plan, params=restored.params)

The run's config comes from the checkpoint itself (saved with every step), so the model is rebuilt exactly as
trained; `overrides` change what a restore may change: the mesh, the ZeRO stage, precision of compute, the
tensor-parallel settings. Arrays come back directly in the new layout (Orbax reads each device's shard).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import jax
import optax

from jaxpar.checkpoint.info import read_json_item
from jaxpar.checkpoint.mismatch import CheckpointMismatchError
from jaxpar.checkpoint.store import Checkpointer, resolve_checkpoint_path
from jaxpar.config import Config, ConfigError, load_config
from jaxpar.config.moe import without_expert_axes
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
      FileNotFoundError: no complete checkpoint at `path` (or no step `step`).
      ConfigError: the saved config with `overrides` does not fit `devices` (the message names the key);
        `overrides` change `model.*` (other than `model.moe.expert_axes`, a placement on the mesh); the arrays
        do not fit (an optimizer other than the run's: the message summarises the differences,
        `jaxpar.checkpoint.mismatch.CheckpointMismatchError` is its cause).
    """
    root, given = resolve_checkpoint_path(path)
    reader = Checkpointer.read_only(root)
    try:
        steps = reader.all_steps()
        chosen = step if step is not None else given if given is not None else (steps[-1] if steps else None)
        if chosen is None or chosen not in steps:
            raise FileNotFoundError(
                f"no complete checkpoint{'' if chosen is None else f' for step {chosen}'} in "
                f"{root} (complete steps: {steps})"
            )
        saved = read_json_item(os.path.join(root, str(chosen)), "config")
        if saved is None:
            raise FileNotFoundError(f"checkpoint step {chosen} in {root} holds no config")
        devices = list(devices) if devices is not None else jax.devices()
        cfg = load_config(saved, overrides, num_devices=len(devices))
        # model.moe.expert_axes places the experts on the mesh, like the mesh itself: it may change
        trained = without_expert_axes(load_config(saved, validate=False).model)
        model = without_expert_axes(cfg.model)
        if model != trained:
            changed = [f"{key}: {a!r} -> {b!r}" for key, a, b in _differences(trained, model, "model")]
            raise ConfigError(
                f"restore cannot change the model the checkpoint holds ({'; '.join(changed)}); leave model.* out "
                f"of the overrides (the mesh, model.moe.expert_axes, ZeRO stage and precision may change)"
            )
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


def _differences(old, new, prefix: str) -> list[tuple[str, object, object]]:
    """(dotted key, old value, new value) of every field that differs between two config dataclasses, nested
    sections (e.g. model.moe) key by key."""
    out = []
    for f in dataclasses.fields(old):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if a == b:
            continue
        if dataclasses.is_dataclass(a):
            out += _differences(a, b, f"{prefix}.{f.name}")
        else:
            out.append((f"{prefix}.{f.name}", a, b))
    return out
