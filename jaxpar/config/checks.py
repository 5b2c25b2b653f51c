"""The range and choice checks every section's validation shares: each failure names the key, its value, what it
may be and an example that is (the key's default, or the closest allowed choice to a misspelt one). No jax."""

from __future__ import annotations

import math
from typing import Any

from jaxpar.config.errors import ConfigError
from jaxpar.config.keys import closest_value, example, key_spec


def check_choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    """Raises ConfigError unless `value` is one of `allowed`; the message offers the closest choice ("did you
    mean model.remat=full?"), else the key's default (or the first choice)."""
    if value in allowed:
        return
    near = closest_value(value, allowed)
    if near is not None:
        fix = f"did you mean {key}={near}?"
    else:
        spec = key_spec(key)
        fix = example(key, spec.default if spec is not None and spec.default in allowed else allowed[0])
    raise ConfigError(f"{key}={value!r} is not one of {', '.join(repr(a) if not a else a for a in allowed)}; {fix}")


def check_positive(key: str, value: float, allow_zero: bool = False) -> None:
    """Raises ConfigError unless `value` is a finite number > 0 (>= 0 with `allow_zero`)."""
    if not math.isfinite(value):
        raise ConfigError(f"{key}={value} must be a finite number; {example(key)}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}; {example(key)}")


def check_between(key: str, value: float, low: float, high: float, *, high_open: bool = False) -> None:
    """Raises ConfigError unless low <= `value` <= high (< high with `high_open`)."""
    if not (low <= value < high if high_open else low <= value <= high):
        raise ConfigError(f"{key}={value} must lie in [{low}, {high}{')' if high_open else ']'}; {example(key)}")


def check_not_empty(key: str, value: str, what: str) -> None:
    """Raises ConfigError when `value` is empty or blank; `what` says what the key names (the message's fix)."""
    if not value.strip():
        raise ConfigError(f"{key} is empty; name {what}, {example(key)}")
