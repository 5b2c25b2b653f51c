"""Load a `Config` from YAML files and dotted command-line overrides.

    cfg = load_config("configs/tiny.yaml", ["mesh.fsdp=4", "train.steps=50"])

A YAML file may name `base: other.yaml` (path relative to the file) whose values it extends; nested sections
merge key by key. Files are read with `yaml.safe_load` semantics, except that a key named twice in one mapping
(`jaxpar.config.strict_yaml`) and a file that names no settings at all are refused. Among overrides the last
value of a key wins (so a script or test can append to a shared list, and so can a command line); a sweep
file refuses a repeated key (`check_unique_overrides`). Unknown keys and values of the wrong type raise `ConfigError`
naming the dotted key and the fix (`jaxpar.config.decode`). Cross-field checks run afterwards (`validate_config`).
Every error names where the keys it names were set: the file of the `base:` chain, or the override
(`jaxpar.config.sources`).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from typing import Any

import yaml

from jaxpar.config.decode import config_from_dict
from jaxpar.config.errors import ConfigError
from jaxpar.config.paths import write_atomic
from jaxpar.config.schema import Config
from jaxpar.config.sources import ConfigSources, file_origin, override_origin
from jaxpar.config.strict_yaml import DuplicateKeyError, strict_safe_load

_MAX_BASE_DEPTH = 8


def read_yaml(path: str, what: str = "config", example: str = "configs/tiny.yaml") -> Any:
    """The document of YAML file `path`, read like `yaml.safe_load` but refusing a key named twice in one mapping
    (`jaxpar.config.strict_yaml`). `what` and `example` name the kind of file in messages ("config",
    "configs/tiny.yaml"; a sweep file passes its own).

    Raises:
      ConfigError: `path` is a directory or missing, is not UTF-8 text or not valid YAML, or repeats a key (the
        message gives both lines).
    """
    if os.path.isdir(path):
        raise ConfigError(f"{what} {path!r} is a directory; pass a YAML file such as {example}")
    if not os.path.isfile(path):
        raise ConfigError(f"{what} file {path!r} does not exist; pass a path such as {example}")
    with open(path, encoding="utf-8") as f:
        try:
            return strict_safe_load(f)
        except DuplicateKeyError as e:
            raise ConfigError(
                f"{path}, line {e.line}: duplicate key {e.key!r} (first at line {e.first_line}); keep one of them"
            ) from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not a UTF-8 text file ({e.reason}); pass a YAML {what}") from e


def pop_base(document: Any, path: str, keys: str = "sections (model:, mesh:, ...)") -> tuple[dict, str | None]:
    """Splits the document of YAML file `path` (as `read_yaml` returns it) into its mapping without `base:` and
    the file that `base:` names: absolute as given, or relative to `path`'s directory; normalised. None when the
    file names no base. A config file extends its base (`load_config`); a sweep file starts every point from it
    (`jaxpar.analysis.sweep.run.load_sweep`). `keys` names the top-level keys the file holds, for messages.

    Raises:
      ConfigError: the top level is not a mapping, or `base` is not a file name.
    """
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: top level must be a mapping of {keys}, got {type(document).__name__}")
    mapping = dict(document)
    base = mapping.pop("base", None)
    if base is None:
        return mapping, None
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: `base` must be a file name, got {base!r}")
    return mapping, os.path.normpath(base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base))


def _read_yaml(path: str, depth: int = 0) -> tuple[dict, ConfigSources]:
    """Reads `path`, resolving its `base:` chain; returns the merged mapping (without `base`) and where each key
    it states comes from (the last file of the chain that states it)."""
    if depth > _MAX_BASE_DEPTH:
        raise ConfigError(f"{path}: `base` chain deeper than {_MAX_BASE_DEPTH}; is there a cycle?")
    raw = read_yaml(path)
    if raw is None or raw == {}:  # an empty or truncated file, or the wrong one: never train on bare defaults
        raise ConfigError(
            f"{path}: the file is empty and names no settings; pass a config such as "
            f"configs/tiny.yaml, or name what yours changes (e.g. `base: tiny.yaml`)"
        )
    values, base_path = pop_base(raw, path)
    if base_path is None:
        merged, sources = values, ConfigSources()
    else:
        base_values, sources = _read_yaml(base_path, depth + 1)
        merged = _merge(base_values, values)
    sources.stated(values, file_origin(path))
    return merged, sources


def read_config_file(path: str) -> dict:
    """The nested mapping that `path` and its `base:` chain state (without `base`), before schema defaults.

    Raises:
      ConfigError: a missing, empty or unreadable file in the chain, a duplicate key, or a `base` cycle.
    """
    return _read_yaml(path)[0]


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """Splits `section.key=value` (or `section.subsection.key=value`, e.g. model.moe.num_experts=8) into (the
    dotted parts, value parsed as a YAML scalar)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value, e.g. mesh.fsdp=4")
    key, value = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise ConfigError(f"override key {key!r} must be section.key or section.subsection.key, e.g. train.steps=50")
    try:
        parsed = strict_safe_load(value) if value.strip() else ""
    except DuplicateKeyError as e:
        raise ConfigError(f"override {text!r}: duplicate key {e.key!r} in its value; keep one of them") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not a YAML scalar: {e}") from e
    return parts, parsed


def check_unique_overrides(overrides: Sequence[str]) -> None:
    """Refuses a dotted key named twice among command-line overrides, like a duplicate key in a YAML file.

    Raises:
      ConfigError: naming the key and both overrides; also any override `parse_override` refuses.
    """
    seen: dict[str, str] = {}
    for text in overrides:
        parts, _ = parse_override(text)
        dotted = ".".join(parts)
        if dotted in seen:
            raise ConfigError(f"override {dotted} is given twice ({seen[dotted]!r} and {text!r}); keep one of them")
        seen[dotted] = text


def load_config_with_sources(
    path: str | dict | None,
    overrides: Sequence[str] = (),
    *,
    overrides_are: str = "the override",
) -> tuple[Config, ConfigSources]:
    """Loads `path` (or the defaults when None) and applies dotted overrides, without cross-field validation;
    returns the config and where each key it states came from (`jaxpar.config.sources`), for the caller to
    name in the errors of later checks (`ConfigSources.explain`).

    Args:
      path: YAML file, which may name a `base` file it extends; or the nested values themselves (e.g. a
        checkpoint's saved config, `Config.to_dict()`), copied, not changed, whose keys have no origin.
      overrides: strings like `mesh.fsdp=4`; a key given twice takes the last value. A mapping value
        (`model.moe={top_k: 4, every: 2}`) sets the keys it names, keeping the section's others.
      overrides_are: what the overrides are, as errors name them: "the override `mesh.fsdp=4`", or a command's
        `jaxpar.config.sources.COMMAND_LINE` ("the command-line override `mesh.fsdp=4`").

    Raises:
      ConfigError: a file that cannot be read, an unknown key (naming the closest valid one) or a value of the
        wrong type; the message names the key, where it was set and the fix.
    """
    if isinstance(path, dict):
        values, sources = copy.deepcopy(path), ConfigSources()
    else:
        values, sources = _read_yaml(path) if path else ({}, ConfigSources())
    for text in overrides:
        parts, value = parse_override(text)
        sec = values
        for depth, name in enumerate(parts[:-1]):
            sec = sec.setdefault(name, {})
            if not isinstance(sec, dict):
                where = ".".join(parts[: depth + 1])
                raise sources.explain(ConfigError(f"{where}: must be a mapping of keys, not {sec!r}", key=where))
        if isinstance(value, dict) and isinstance(sec.get(parts[-1]), dict):
            # `model.moe={top_k: 4}` sets top_k and keeps the section's other keys, as a file extending a base
            sec[parts[-1]] = _merge(sec[parts[-1]], value)
        else:
            sec[parts[-1]] = value
        sources.overridden(parts, value, override_origin(text, overrides_are))
    try:
        return config_from_dict(values), sources
    except ConfigError as e:
        raise sources.explain(e) from e


def load_config(
    path: str | dict | None,
    overrides: Sequence[str] = (),
    *,
    validate: bool = True,
    num_devices: int | None = None,
    overrides_are: str = "the override",
) -> Config:
    """Loads `path` (or the defaults when None), applies dotted overrides, validates.

    Args:
      path: YAML file, which may name a `base` file it extends; or the nested values themselves (e.g. a
        checkpoint's saved config, `Config.to_dict()`), copied, not changed.
      overrides: strings like `mesh.fsdp=4`.
      validate: run `validate_config` (divisibility, ranges, mesh against device count).
      num_devices: devices the mesh must cover; None means `jax.device_count()` at validation.
      overrides_are: what the overrides are, as errors name them (`load_config_with_sources`).

    Raises:
      ConfigError: unknown key, wrong type, or an impossible combination; the message names the key, the file or
        override that set it (`jaxpar.config.sources`) and the fix. A key given twice in `overrides` takes the
        last value.
    """
    cfg, sources = load_config_with_sources(path, overrides, overrides_are=overrides_are)
    if validate:
        from jaxpar.config.validate import validate_config

        try:
            validate_config(cfg, num_devices=num_devices)
        except ConfigError as e:
            raise sources.explain(e) from e
    return cfg


def save_config(cfg: Config, path: str) -> None:
    """Writes the resolved config as YAML (every field, no `base`), loadable by `load_config`; atomically
    (`jaxpar.config.paths.write_atomic`), so a kill mid-write leaves the previous file, never half of this one."""
    write_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
