"""`yaml.safe_load` that refuses a mapping naming the same key twice.

PyYAML keeps the last of two equal keys without a word, so `d_model: 64` followed further down by `d_model: 32`
silently trains the second. `strict_safe_load` parses exactly like `yaml.safe_load` (same tags, same types, the
same merge-key semantics: a mapping's own keys override those it merges in with `<<`) and raises
`DuplicateKeyError` instead.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError

_MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(ConstructorError):
    """A mapping names the same key twice (a `yaml.YAMLError`).

    Attributes:
      key: the repeated key.
      line, first_line: 1-based lines of the repeat and of the first occurrence.
    """

    def __init__(self, node: yaml.MappingNode, key_node: yaml.Node, key: Any, first_line: int):
        self.key, self.line, self.first_line = key, key_node.start_mark.line + 1, first_line
        super().__init__(
            "while constructing a mapping",
            node.start_mark,
            f"found duplicate key {key!r} (first at line {first_line}); keep one of them",
            key_node.start_mark,
        )


class StrictSafeLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` whose mappings refuse duplicate keys (`DuplicateKeyError`)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:  # `<<: *base` merges keys that the mapping's own may override
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = key in first_line
                except TypeError:  # unhashable key: SafeLoader reports it below
                    continue
                if seen:
                    raise DuplicateKeyError(node, key_node, key, first_line[key])
                first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def strict_safe_load(stream) -> Any:
    """`yaml.safe_load(stream)`, but a mapping with a duplicate key raises `DuplicateKeyError` (a YAMLError)."""
    return yaml.load(stream, Loader=StrictSafeLoader)  # noqa: S506 -- a SafeLoader subclass
