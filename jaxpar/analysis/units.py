"""Byte units for the reports: decimal, as GPU vendors state memory (GB = 1e9 bytes). No jax."""

from __future__ import annotations

GB = 1e9
_UNITS = (("TB", 1e12), ("GB", GB), ("MB", 1e6), ("kB", 1e3))


def human_bytes(x: float | None) -> str:
    """Bytes in the largest decimal unit that is at most `x`, 4 significant digits: `26 GB`, `431.4 kB`, `512 B`;
    `-` for None."""
    if x is None:
        return "-"
    for unit, scale in _UNITS:
        if abs(x) >= scale:
            return f"{x / scale:.4g} {unit}"
    return f"{x:.0f} B"
