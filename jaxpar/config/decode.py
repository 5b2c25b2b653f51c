"""Nested mappings (a config file's, after its `base:` chain and the overrides) to the typed `Config` tree.

Every value is checked against its field's type (`decode_value`), every key against the fields of its section;
an unknown key is refused with the closest valid one ("did you mean optimizer.learning_rate?"), a value of the
wrong type or an empty one with an example of the right type (`jaxpar.config.keys.example`). Cross-field checks are
`jaxpar.config.validate`'s.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any

from jaxpar.config.errors import ConfigError
from jaxpar.config.keys import closest_key, config_keys, entry_class, example, section_keys
from jaxpar.config.schema import Config

_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def type_name(hint: Any) -> str:
    """`hint` in words, as messages name what a key takes: "an integer", "an integer or null", "a list of
    strings"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        inner = type_name(args[0])
        return "a list of " + {"an integer": "integers", "a number": "numbers", "a string": "strings"}.get(inner, inner)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    return _TYPE_NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def _refuse(value: Any, hint: Any, key: str, fix: str) -> ConfigError:
    if value is None or value == "":
        empty = "empty (null)" if value is None else "empty"
        return ConfigError(f"{key} is {empty}; give {type_name(hint)}, {fix}", key=key)
    return ConfigError(f"{key}: expected {type_name(hint)}, got {value!r} ({type(value).__name__}); {fix}", key=key)


def decode_value(value: Any, hint: Any, key: str, fix: str = "fix the value in the YAML file or the override") -> Any:
    """`value` as read from YAML, checked against type `hint` (int, float, bool, str, a Union/Optional of
    them, or a tuple of one of them from a YAML list) for the dotted `key`: ints are accepted for floats, and
    so are numeric strings (YAML 1.1 reads 3e-4, without a dot, as a string); a bool is never an int; a null
    list is the empty list.

    Raises:
      ConfigError: naming `key`, the expected type, the value (or that it is empty) and `fix`.
    """
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # a list of scalars, e.g. [data, fsdp]
        if value is None:
            return ()
        if not isinstance(value, (list, tuple)):
            parts = [x for x in re.split(r"[\s,;]+", value.strip("[] ")) if x] if isinstance(value, str) else []
            listed = f"{key}=[{','.join(parts)}]" if parts else None
            raise _refuse(value, hint, key, f"write it as a YAML list, e.g. {listed}" if listed else fix)
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
        raise _refuse(value, hint, key, fix)
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
    raise _refuse(value, hint, key, fix)


def _type_fix(key: str, hint: Any) -> str:
    """The fix a type error of field `key` names: an example of its type (`jaxpar.config.keys.example`)."""
    quoted = "quoted if YAML would read it as a number or a boolean, " if hint is str else ""
    return f"{quoted}{example(key)}"


def _unknown(name: str, prefix: str, cls: type) -> ConfigError:
    """An unknown key `name` in the section `prefix` of dataclass `cls`, with the closest valid key: in the same
    section, else anywhere in the tree (a key given in the wrong section)."""
    key = f"{prefix}.{name}" if prefix else str(name)
    here = section_keys(cls)
    near = closest_key(str(name), here)
    if near is not None:
        near = f"{prefix}.{near}" if prefix else near
    else:  # a key of another section, e.g. train.learning_rate for optimizer.learning_rate
        leaves = {s.key.rpartition(".")[2]: s.key for s in reversed(config_keys())}
        found = closest_key(str(name), leaves)
        near = leaves[found] if found is not None else None
    if near:
        hint = f"did you mean {near}?"
    else:
        hint = f"the keys of {prefix or 'the top level'} are {', '.join(sorted(here))}"
    return ConfigError(f"unknown config key {key}; {hint}", key=key)


def _build(cls: type, values: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [name for name in values if name not in fields]
    if unknown:
        raise _unknown(unknown[0], prefix, cls)
    kwargs = {}
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else name
        hint = hints[name]
        entry = entry_class(hint)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                first = dataclasses.fields(hint)[0].name
                raise ConfigError(f"{key}: must be a mapping of keys (such as {key}.{first}), got {value!r}", key=key)
            kwargs[name] = _build(hint, value, key)
        elif entry is not None:
            kwargs[name] = _build_entries(entry, value, key)
        else:
            kwargs[name] = decode_value(value, hint, key, _type_fix(key, hint))
    return cls(**kwargs)


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
    """Builds a `Config` from nested mappings (no cross-field validation).

    Raises:
      ConfigError: an unknown key (naming the closest valid one) or a value of the wrong type.
    """
    return _build(Config, values, "")
