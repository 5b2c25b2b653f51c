"""The error raised for a bad configuration."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or conflicts with another; the message names the key and fix.

    Attributes:
      key: the one dotted key at fault, where the raiser knows it (an unknown key, a value of the wrong type),
        else None: `jaxpar.config.sources.ConfigSources.explain` then finds the keys the message names.
      sources_named: True once `explain` has appended where the named keys were set.
    """

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key
        self.sources_named = False
