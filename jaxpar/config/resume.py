"""Resuming a run directory with other settings: what changed, what may not, and keeping the old config.

A run directory's `config.yaml` is the resolved config the run was trained with. A resume may change how the run
goes on (more steps, another mesh, ZeRO stage or process count, logging); the old file is then kept as
`config.step<N>.yaml` (N: the step resumed from) before the new one is written, and the changed keys are listed.
It may not change the `data` section: the checkpoint's data position is a global sample index into the data as
it was, so other data would silently serve other batches.

Nor may any restore change the model the checkpoint holds (`check_restored_model`): not a resume, not a new run
seeded from another run's checkpoint (`checkpoint.restore_from`), not `jaxpar.restore`. Every `model.*` key
must equal the saved one except `RESTORE_MAY_CHANGE`, which say where and how the model is computed rather than
what it computes.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from jaxpar.config.errors import ConfigError
from jaxpar.config.load import load_config, read_config_file
from jaxpar.config.schema import Config, ModelConfig

# Settings that say nothing about the run: where it seeds from and how the processes find each other.
_IGNORED = ("checkpoint.restore_from", "distributed.")
# The model.* keys a restore may change: the experts' placement on the mesh, what the backward pass recomputes,
# the attention kernel and its packed-document limit, and where a fresh run would take its parameters from.
RESTORE_MAY_CHANGE = (
    "model.moe.expert_axes",
    "model.remat",
    "model.attention",
    "model.max_segments",
    "model.init_from",
)


def _differences(old: Any, new: Any, prefix: str) -> list[tuple[str, Any, Any]]:
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


def model_changes(saved: ModelConfig, new: ModelConfig) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, new value) of every `model.*` key a restore may not change that differs (head
    counts and widths compared as resolved: n_kv_heads and head_dim null mean their defaults)."""

    def resolved(m: ModelConfig) -> ModelConfig:
        return dataclasses.replace(m, n_kv_heads=m.kv_heads, head_dim=m.head_width)

    changes = _differences(resolved(saved), resolved(new), "model")
    return [c for c in changes if c[0] not in RESTORE_MAY_CHANGE]


def check_restored_model(saved: ModelConfig | dict, new: ModelConfig, source: str, fix: str) -> None:
    """The one check of a restore's config against its checkpoint's (`saved`: the model section, or the whole
    saved config dict): the model may not change beyond `RESTORE_MAY_CHANGE`.

    Args:
      source: the checkpoint, for the message; fix: what the caller can do instead.

    Raises:
      ConfigError: naming every key that differs, its saved and new value, and `fix`.
    """
    if isinstance(saved, dict):
        saved = load_config(saved, validate=False).model
    changed = model_changes(saved, new)
    if changed:
        raise ConfigError(
            f"a restore cannot change the model the checkpoint {source} holds "
            f"({'; '.join(f'{k}: {a!r} -> {b!r}' for k, a, b in changed)}); {fix} (a restore may change the mesh, "
            f"ZeRO stage, precision and {', '.join(RESTORE_MAY_CHANGE)})"
        )


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
      ConfigError: a `data.*` setting changed, or a `model.*` one `check_restored_model` refuses (naming each and
        the fix), before anything is written.
    """
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return {}
    saved = read_config_file(path)
    check_restored_model(
        saved, cfg.model, run_dir, f"keep the model.* settings of {path}, or start a fresh train.run_dir"
    )
    changes = config_changes(saved, cfg.to_dict())
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
