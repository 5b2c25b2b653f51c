"""Resuming a run directory with other settings: what changed, what may not, and keeping the old config.

A run directory's `config.yaml` is the resolved config the run was trained with. A resume may change how the run
goes on (more steps, another mesh, ZeRO stage or process count, logging); the old file is then kept as
`config.step<N>.yaml` (N: the step resumed from) before the new one is written, and the changed keys are listed.
It may not change the `data` section: the checkpoint's data position is a global sample index into the data as
it was, so other data would silently serve other batches.
"""

from __future__ import annotations

import os
from typing import Any

from jaxpar.config.errors import ConfigError
from jaxpar.config.load import read_config_file
from jaxpar.config.schema import Config

# Settings that say nothing about the run: where it seeds from and how the processes find each other.
_IGNORED = ("checkpoint.restore_from", "distributed.")


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def config_changes(saved: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (saved value, new value) for every setting that differs, ignoring `checkpoint.restore_from`
    and `distributed.*`. A key only one side has (a config saved by another jaxpar version) is not compared."""
    old, cur = _flatten(saved), _flatten(new)
    return {
        k: (old[k], cur[k]) for k in sorted(old.keys() & cur.keys()) if old[k] != cur[k] and not k.startswith(_IGNORED)
    }


def check_resume_config(run_dir: str, cfg: Config) -> dict[str, tuple[Any, Any]]:
    """Compares the resolved `cfg` with RUN_DIR/config.yaml before a resume from the run's own checkpoints.

    Returns:
      the changed settings (`config_changes`); empty when there is no saved config.

    Raises:
      ConfigError: a `data.*` setting changed (naming each and the fix), before anything is written.
    """
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return {}
    changes = config_changes(read_config_file(path), cfg.to_dict())
    data = [f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items() if k.startswith("data.")]
    if data:
        raise ConfigError(
            f"train.run_dir={run_dir!r} was trained on other data ({'; '.join(data)}): its checkpoints' data "
            f"position indexes the data as it was, so resuming would serve other batches; keep the data settings "
            f"of {path}, or start a fresh train.run_dir"
        )
    return changes


def keep_previous_config(run_dir: str, step: int) -> str | None:
    """Renames RUN_DIR/config.yaml to config.step<step>.yaml, or config.step<step>.<k>.yaml (k = 1, 2, ...) when
    an earlier resume at the same step kept one already (nothing saved is replaced); returns the new path, or
    None when there is no config.yaml."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return None
    kept, k = os.path.join(run_dir, f"config.step{step}.yaml"), 0
    while os.path.exists(kept):
        k += 1
        kept = os.path.join(run_dir, f"config.step{step}.{k}.yaml")
    os.replace(path, kept)
    return kept
