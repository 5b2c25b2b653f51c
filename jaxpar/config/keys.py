"""The config tree's dotted keys, walked from the dataclasses of `jaxpar.config.schema`, with their types and
defaults: what error messages suggest (the closest valid key to a misspelt one, an example value of a key).

A key is named as on the command line: `section.key` or `section.subsection.key` (`model.moe.top_k`); a field of
the entries of a list of mappings (`data.sources`) as `data.sources[].name` in `config_keys`, and as
`data.sources[0].name` (an index) in messages. No jax.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import typing
from typing import Any

import yaml

from jaxpar.config.schema import Config

_INDEX = re.compile(r"\[\d*\]")


@dataclasses.dataclass(frozen=True)
class KeySpec:
    """One leaf key of the config tree.

    Attributes:
      key: the dotted name, entries of a list written `[]` (`data.sources[].weight`).
      hint: the field's type annotation (int, float, bool, str, `int | None`, `tuple[str, ...]`).
      default: the field's default value.
      example: a valid value to show in messages: the field's `example` metadata, else its default.
    """

    key: str
    hint: Any
    default: Any
    example: Any


def entry_class(hint: Any) -> type | None:
    """The dataclass of a `tuple[SomeConfig, ...]` field (a list of entries, e.g. `data.sources`), else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0] if isinstance(args[0], type) and dataclasses.is_dataclass(args[0]) else None
    return None


def _walk(cls: type, prefix: str) -> list[KeySpec]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        key, hint = f"{prefix}{f.name}", hints[f.name]
        entry = entry_class(hint)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            out += _walk(hint, f"{key}.")
        elif entry is not None:
            out += _walk(entry, f"{key}[].")
        else:
            factory = f.default_factory  # every field of the tree has a default or a default factory
            default = f.default if f.default is not dataclasses.MISSING else factory() if callable(factory) else None
            out.append(KeySpec(key, hint, default, f.metadata.get("example", default)))
    return out


@functools.cache
def config_keys() -> tuple[KeySpec, ...]:
    """Every leaf key of `Config`, in schema order (sections, then nested sections and list entries in place)."""
    return tuple(_walk(Config, ""))


def section_keys(cls: type, prefix: str = "") -> list[str]:
    """The dotted names of `cls`'s fields (a dataclass of the tree), each prefixed with `prefix.` when given."""
    return [f"{prefix}.{f.name}" if prefix else f.name for f in dataclasses.fields(cls)]


def key_spec(key: str) -> KeySpec | None:
    """The `KeySpec` of a dotted leaf key, list indices allowed (`data.sources[2].weight`); None when there is
    no such leaf."""
    plain = _INDEX.sub("[]", key)
    return next((s for s in config_keys() if s.key == plain), None)


def yaml_value(value: Any) -> str:
    """`value` written as the right-hand side of a dotted override, one word: true/false, null, numbers as
    Python writes them, lists as [a,b], and strings as they are unless YAML would read them as something else
    (then quoted: '' for the empty string, '2024' for a string of digits)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, str):
        try:
            plain = value and " " not in value and yaml.safe_load(value) == value
        except yaml.YAMLError:  # e.g. '*.scale', which YAML reads as an alias
            plain = False
        return value if plain else "'" + value.replace("'", "''") + "'"
    return repr(value)


def example(key: str, value: Any = dataclasses.MISSING) -> str:
    """ "e.g. KEY=VALUE" naming a valid setting of `key` (a message's fix): `value`, or the key's example (its
    default, unless the schema names another: `KeySpec.example`)."""
    if value is dataclasses.MISSING:
        spec = key_spec(key)
        value = None if spec is None else spec.example
    return f"e.g. {key}={yaml_value(value)}"


def closest_key(key: str, candidates: typing.Iterable[str]) -> str | None:
    """The candidate most like `key` (difflib's ratio, at least 0.6; ties: the first), else None."""
    found = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


def closest_value(value: Any, allowed: typing.Iterable[str]) -> str | None:
    """The allowed choice most like `value` (a misspelt choice, e.g. 'ful' for 'full'), else None."""
    return closest_key(str(value), allowed) if isinstance(value, str) and value else None
