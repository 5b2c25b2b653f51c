"""XLA:CPU compile options that cut the compile time of a train step, for checks that read what XLA decides (memory
analysis, collectives) rather than time it. No jax.

Both keep every HLO pass (SPMD partitioning, collectives, fusion decisions, buffer assignment), so state bytes and
collectives are those of a default build; they change only code generation:

  * `COMPILER_OPTIONS`: no LLVM backend optimisation, about 3x faster; buffer assignment, and so every byte of
    the memory analysis, unchanged (tests/unit/test_memory.py).
  * `FAST_COMPILER_OPTIONS`: also XLA:CPU's legacy elemental emitters instead of the fusion emitters and no
    expensive LLVM passes, about 3-4x faster again; temp bytes can differ by a few percent (fusion decisions)
    and a step runs about 2x slower. CPU only.
"""

from __future__ import annotations

COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
FAST_COMPILER_OPTIONS = {
    **COMPILER_OPTIONS,
    "xla_cpu_use_fusion_emitters": False,
    "xla_llvm_disable_expensive_passes": True,
}


def xla_flags(options: dict[str, int | bool] | None = None) -> str:
    """`options` (default `FAST_COMPILER_OPTIONS`) as `XLA_FLAGS` text, e.g. "--xla_backend_optimization_level=0
    ...": the same options for every compile of a process (and of its subprocesses, which inherit the variable),
    where per-compile options cannot be passed (jit calls inside the library, other programs). Set before jax
    starts its backend."""
    items = (FAST_COMPILER_OPTIONS if options is None else options).items()
    return " ".join(f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in items)
