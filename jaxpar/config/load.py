"""Load a `Config` from YAML files and dotted command-line overrides.

    cfg = load_config("configs/tiny.yaml", ["mesh.fsdp=4", "train.steps=50"])

A YAML file may name `base: other.yaml` (path relative to the file) whose values it extends; nested sections
merge key by key. Files are read with `yaml.safe_load` semantics, except that a key named twice in one mapping
(`jaxpar.config.strict_yaml`) and a file that names no settings at all are refused. Among overrides the last
value of a key wins (so a script or test can append to a shared list, and so can a command line); a sweep
file refuses a repeated key (`check_unique_overrides`). Unknown keys and values of the wrong type raise `ConfigError`
naming the dotted key and the fix. Cross-field checks run afterwards (`validate_config`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import types
import typing
from collections.abc import Sequence
from typing import Any

import yaml

from jaxpar.config.errors import ConfigError
from jaxpar.config.schema import Config
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


def _read_yaml(path: str, depth: int = 0) -> dict:
    """Reads `path`, resolving its `base:` chain; returns the merged mapping (without `base`)."""
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
        return values
    return _merge(_read_yaml(base_path, depth + 1), values)


def read_config_file(path: str) -> dict:
    """The nested mapping that `path` and its `base:` chain state (without `base`), before schema defaults.

    Raises:
      ConfigError: a missing, empty or unreadable file in the chain, a duplicate key, or a `base` cycle.
    """
    return _read_yaml(path)


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


def decode_value(value: Any, hint: Any, key: str, fix: str = "fix the value in the YAML file or the override") -> Any:
    """`value` as read from YAML, checked against type `hint` (int, float, bool, str, a Union/Optional of
    them, or a tuple of one of them from a YAML list) for the dotted `key`: ints are accepted for floats, and
    so are numeric strings (YAML 1.1 reads 3e-4, without a dot, as a string); a bool is never an int.

    Raises:
      ConfigError: naming `key`, the expected type, the value and `fix`.
    """
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # a list of scalars, e.g. [data, fsdp]
        if value is None:
            return ()
        if not isinstance(value, (list, tuple)):
            raise ConfigError(
                f"{key}: expected a list of {getattr(args[0], '__name__', args[0])}, got {value!r} "
                f"({type(value).__name__}); write it as a YAML list, e.g. [a, b] (on the command line {key}=[a,b])"
            )
        return tuple(decode_value(v, args[0], f"{key}[{i}]", fix) for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return decode_value(value, arg, key, fix)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {hint}, got {value!r} ({type(value).__name__})")
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is bool and isinstance(value, bool):
        return value
    if hint is str and isinstance(value, str):
        return value
    raise ConfigError(
        f"{key}: expected {getattr(hint, '__name__', hint)}, got {value!r} ({type(value).__name__}); {fix}"
    )


def _build(cls: type, values: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"unknown config key {where}{unknown[0]}; valid keys in {prefix or 'the top level'}: "
            f"{', '.join(sorted(names))}"
        )
    kwargs = {}
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else name
        hint = hints[name]
        entry = _entry_class(hint)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: must be a mapping of keys, got {value!r}")
            kwargs[name] = _build(hint, value, key)
        elif entry is not None:
            kwargs[name] = _build_entries(entry, value, key)
        else:
            kwargs[name] = decode_value(value, hint, key)
    return cls(**kwargs)


def _entry_class(hint: Any) -> type | None:
    """The dataclass of a `tuple[SomeConfig, ...]` field (a list of entries, e.g. `data.sources`), else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0] if isinstance(args[0], type) and dataclasses.is_dataclass(args[0]) else None
    return None


def _build_entries(cls: type, value: Any, key: str) -> tuple:
    """A tuple of `cls` from a YAML list of mappings (None or [] gives ()); entries are named `key[i]` in errors."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"{key}: must be a list of mappings (YAML `- {{...}}` lines, or on the command line "
            f"{key}='[{{...}}, {{...}}]'), got {value!r}"
        )
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ConfigError(f"{key}[{i}]: must be a mapping of keys, got {item!r}")
        out.append(_build(cls, item, f"{key}[{i}]"))
    return tuple(out)


def config_from_dict(values: dict) -> Config:
    """Builds a `Config` from nested mappings (no cross-field validation). Raises ConfigError."""
    return _build(Config, values, "")


def load_config(
    path: str | dict | None, overrides: Sequence[str] = (), *, validate: bool = True, num_devices: int | None = None
) -> Config:
    """Loads `path` (or the defaults when None), applies dotted overrides, validates.

    Args:
      path: YAML file, which may name a `base` file it extends; or the nested values themselves (e.g. a
        checkpoint's saved config, `Config.to_dict()`), copied, not changed.
      overrides: strings like `mesh.fsdp=4`.
      validate: run `validate_config` (divisibility, ranges, mesh against device count).
      num_devices: devices the mesh must cover; None means `jax.device_count()` at validation.

    Raises:
      ConfigError: unknown key, wrong type, or an impossible combination; the message names the key and the fix.
        A key given twice in `overrides` takes the last value.
    """
    if isinstance(path, dict):
        values = copy.deepcopy(path)
    else:
        values = _read_yaml(path) if path else {}
    for text in overrides:
        parts, value = parse_override(text)
        sec = values
        for depth, name in enumerate(parts[:-1]):
            sec = sec.setdefault(name, {})
            if not isinstance(sec, dict):
                raise ConfigError(f"{'.'.join(parts[: depth + 1])}: must be a mapping of keys")
        sec[parts[-1]] = value
    cfg = config_from_dict(values)
    if validate:
        from jaxpar.config.validate import validate_config

        validate_config(cfg, num_devices=num_devices)
    return cfg


def save_config(cfg: Config, path: str) -> None:
    """Writes the resolved config as YAML (every field, no `base`), loadable by `load_config`."""
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
