"""What a compiled program needs per device, from XLA's buffer assignment (`Compiled.memory_analysis()`), as ints.

For an SPMD program the analysis describes the per-device module. Its peak is

    peak = arguments + outputs - aliased + temporaries

(outputs written into donated arguments are counted once: `alias_size_in_bytes` is the part of the outputs that
reuses argument buffers). XLA's own heap simulation (`peak_memory_in_bytes`, where a backend reports it) can be
lower, since not every temporary is live at once; it is kept beside as `xla_peak_bytes`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict


class MemoryBytes(TypedDict):
    """Per-device bytes of a compiled program (`memory_analysis_bytes`)."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    peak_bytes: int  # arguments + outputs - aliased + temporaries (`peak_bytes`)
    xla_peak_bytes: int | None  # XLA's heap-simulation peak; None where the backend gives none


def peak_bytes(memory: Mapping[str, Any]) -> int:
    """arguments + outputs - aliased + temporaries of a `memory_analysis_bytes` dict (module docstring)."""
    return memory["argument_bytes"] + memory["output_bytes"] - memory["alias_bytes"] + memory["temp_bytes"]


def memory_analysis_bytes(compiled: Any) -> MemoryBytes | None:
    """Per-device bytes of a `jax.stages.Compiled`: {"argument_bytes", "output_bytes", "alias_bytes",
    "temp_bytes", "generated_code_bytes", "peak_bytes" (`peak_bytes`), "xla_peak_bytes" (XLA's heap-simulation
    peak; None where the backend gives none)} (`MemoryBytes`), or None when the backend gives no memory analysis."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    sizes = {
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes),
        "generated_code_bytes": int(stats.generated_code_size_in_bytes),
    }
    return MemoryBytes(
        argument_bytes=sizes["argument_bytes"],
        output_bytes=sizes["output_bytes"],
        alias_bytes=sizes["alias_bytes"],
        temp_bytes=sizes["temp_bytes"],
        generated_code_bytes=sizes["generated_code_bytes"],
        peak_bytes=peak_bytes(sizes),
        xla_peak_bytes=int(getattr(stats, "peak_memory_in_bytes", 0) or 0) or None,
    )
