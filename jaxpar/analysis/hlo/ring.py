"""Ring-algorithm communication volume: the bytes one device sends in each kind of collective.

Ring costs (bytes sent per device; NCCL tests, doc/PERFORMANCE.md, "bus bandwidth"), n = group size, size = the
operand's bytes:

    all-reduce       2(n-1)/n * size
    all-gather        (n-1)/n * size    size of the gathered (output) operand
    reduce-scatter    (n-1)/n * size    size of the input operand
    all-to-all        (n-1)/n * size
    ragged-all-to-all (n-1)/n * size    size of the send operand (the rows it holds): what leaves the device when
                                        its rows are spread evenly over the group (balanced routing); at most
                                        size, when every row goes to another device
    collective-permute        size      each device sends its whole operand once

The analytic count of a step's collectives is `jaxpar.analysis.planner.comm` (every mesh axis, Megatron tensor
parallelism included); `jaxpar.analysis.hlo.collectives` applies the same costs to the collectives of a compiled
program.
"""

from __future__ import annotations

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")


def ring_bytes(kind: str, size_bytes: float, n: int) -> float:
    """Bytes sent per device by one ring collective over a group of `n` devices (table in the module docstring).

    Args:
      kind: one of `KINDS`.
      size_bytes: `size` in the table: the all-reduce/all-to-all/permute operand, the all-gather output, the
        reduce-scatter input, the ragged all-to-all's send operand, in bytes.
      n: devices per replica group; n = 1 moves nothing.

    Raises:
      ValueError: unknown kind or n < 1.
    """
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n * size_bytes
    if kind in ("all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all"):
        return (n - 1) / n * size_bytes
    if kind == "collective-permute":
        return float(size_bytes) if n > 1 else 0.0
    raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")
