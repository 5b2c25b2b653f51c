"""Where each value of a config came from, and config errors that say so.

Loading a config (`jaxpar.config.load.load_config_with_sources`) records the origin of every dotted key that a
YAML file or an override states: the file of the `base:` chain that states it last (the one whose value is
used), or the override. `ConfigSources.explain` completes a `ConfigError` with the origins of the keys its
message names, so every check (the loader's and `jaxpar.config.validate`'s alike) names the file to edit without
code of its own:

    model.n_layers=3 must be divisible by mesh.pipeline=2 ...; change model.n_layers or mesh.pipeline
      (model.n_layers set in configs/my.yaml; mesh.pipeline set by the command-line override `mesh.pipeline=2`)

A key keeps its schema default when nothing states it; a message naming only such keys is left as it is.
"""

from __future__ import annotations

import re
from typing import Any

from jaxpar.config.errors import ConfigError

# A dotted key in a message: section.key, section.sub.key, data.sources[0].name; not part of a path or file name.
_KEY = re.compile(r"(?<![\w./\-\[])[A-Za-z_]\w*(?:\[\d+\])?(?:\.[A-Za-z_]\w*(?:\[\d+\])?)+")
_LAST = re.compile(r"(?:\.[^.\[\]]+|\[\d+\])$")


COMMAND_LINE = "the command-line override"  # what a command's overrides are (`override_origin`'s `what`)


def file_origin(path: str) -> str:
    """The origin of a key a YAML file states: "in PATH"."""
    return f"in {path}"


def override_origin(text: str, what: str = "the override") -> str:
    """The origin of a key an override sets: "by the override `mesh.fsdp=4`", or with `what` saying whose, e.g.
    "by the command-line override `mesh.fsdp=4`" (`COMMAND_LINE`)."""
    return f"by {what} `{text.strip()}`"


class ConfigSources:
    """Dotted key -> origin ("in FILE" or "by the override `k=v`") of every key a config's files and
    overrides state; a key of the schema's default is absent."""

    def __init__(self, origins: dict[str, str] | None = None):
        self.origins: dict[str, str] = dict(origins or {})

    def _drop_below(self, key: str) -> None:
        for k in [k for k in self.origins if k.startswith((f"{key}.", f"{key}["))]:
            del self.origins[k]

    def _record(self, key: str, value: Any, origin: str) -> None:
        """`key` = `value` (a scalar, a list, or a list's mapping entries key by key) comes from `origin`."""
        self._drop_below(key)
        self.origins[key] = origin
        if isinstance(value, list):  # entries of a list of mappings (data.sources): each stated key, by index
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    for name, v in item.items():
                        self._record(f"{key}[{i}].{name}", v, origin)

    def stated(self, tree: dict, origin: str, prefix: str = "") -> None:
        """Records the keys of the nested mapping `tree` (a YAML file's, merged into what earlier files stated,
        key by key) as coming from `origin`."""
        for name, value in tree.items():
            key = f"{prefix}{name}"
            self.origins.pop(key, None)  # a value this file replaces, or a mapping replacing an earlier value
            if isinstance(value, dict):
                self.stated(value, origin, f"{key}.")
            else:
                self._record(key, value, origin)

    def overridden(self, parts: list[str], value: Any, origin: str) -> None:
        """Records an override of the dotted key `parts`, which replaces the whole value there (a mapping given as
        the value replaces the section rather than merging into it)."""
        key = ".".join(parts)
        self.origins.pop(key, None)
        self._drop_below(key)
        for k in range(1, len(parts)):  # an earlier scalar where the override needs a section
            self.origins.pop(".".join(parts[:k]), None)
        if isinstance(value, dict):
            self.stated(value, origin, f"{key}.")
        else:
            self._record(key, value, origin)

    def origin(self, key: str) -> str | None:
        """Where `key`'s value came from: its own origin, else that of the value holding it (a list for an item of
        it, `model.moe.expert_axes[0]`), else, for a section, that of the keys stated in it (the first); None for a
        value nothing stated: the schema default, or for a key of a list's entry (`data.sources[0].path`) the
        section's value it takes."""
        probe = key
        while probe:
            if probe in self.origins:
                return self.origins[probe]
            parent = _LAST.sub("", probe)
            if parent == probe or parent.endswith("]"):  # an entry's own keys are recorded: this one was not stated
                break
            probe = parent
        return next((o for k, o in self.origins.items() if k.startswith((f"{key}.", f"{key}["))), None)

    def explain(self, error: ConfigError) -> ConfigError:
        """`error` with the origins of the keys it names appended (its `key`, else every dotted key in its
        message, in order): " (set in FILE)" for one key, " (K1, K2 set in FILE; K3 set by the command-line
        override `K3=V`)" for several. Returns `error` itself when it names no key with an origin or was
        explained already."""
        if getattr(error, "sources_named", False):
            return error
        message = str(error)
        keys = [error.key] if error.key else list(dict.fromkeys(_KEY.findall(message)))
        named = [(k, o) for k in keys if (o := self.origin(k)) is not None]
        if not named:
            return error
        if len(named) == 1:
            where = f"set {named[0][1]}"
        else:
            by_origin: dict[str, list[str]] = {}
            for k, o in named:
                by_origin.setdefault(o, []).append(k)
            where = "; ".join(f"{', '.join(ks)} set {o}" for o, ks in by_origin.items())
        explained = ConfigError(f"{message} ({where})", key=error.key)
        explained.sources_named = True
        return explained
