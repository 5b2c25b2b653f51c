"""A saved step as every restore starts reading it: which step a path names (`select_step`), and its config once
its format version is checked (`saved_config`), both before any array is read or any device is used."""

from __future__ import annotations

import os

from jaxpar.checkpoint.store import (
    _CONFIG,
    _STEP_NAME,
    check_step_format,
    complete_steps,
    missing_step_message,
    read_json_item,
    resolve_checkpoint_path,
)


def select_step(path: str, step: int | None = None) -> tuple[str, int]:
    """(checkpoint root, step) that a restore of `path` reads: `step`, else the step directory `path` names,
    else the root's latest complete step. A `path` that is missing but names a step (`<root>/<int>`) of an
    existing root is that root's step, so the error lists the steps there are.

    Raises:
      FileNotFoundError: `path` missing (`resolve_checkpoint_path`), or no complete checkpoint (for the step)
        there; the message lists the complete steps and how to pick one.
    """
    parent, name = os.path.split(os.path.abspath(os.fspath(path)))
    given: int | None
    if not os.path.exists(path) and _STEP_NAME.fullmatch(name) and os.path.isdir(parent):
        root, given = parent, int(name)
    else:
        root, given = resolve_checkpoint_path(path)
    steps = complete_steps(root)
    chosen = step if step is not None else given if given is not None else (steps[-1] if steps else None)
    if chosen is None or chosen not in steps:
        raise FileNotFoundError(missing_step_message(root, chosen, steps))
    return root, chosen


def saved_config(root: str, step: int) -> dict:
    """The config dict saved with complete step `step` of checkpoint root `root`, once its format is checked.

    Raises:
      CheckpointFormatError: as `check_step_format`. FileNotFoundError: the step holds no config.
    """
    step_dir = os.path.join(root, str(step))
    check_step_format(step_dir)
    config = read_json_item(step_dir, _CONFIG)
    if config is None:
        raise FileNotFoundError(f"checkpoint step {step} in {root} holds no config")
    return config
