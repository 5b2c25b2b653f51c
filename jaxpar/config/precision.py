"""Precision names, and how `precision.compute_dtype: auto` resolves on each platform. No jax: the planner and the
commands that must not start jax resolve a config for a machine they are not running on.

Platforms (`PLATFORMS`) are the machines a step is planned or compiled for, named as `jax.default_backend()`
names them: `gpu`, `tpu`, `cpu`. `auto` is bfloat16 on an accelerator and float32 on cpu (XLA:CPU has no fast
bf16 matmuls, and fp32 keeps the CPU tests' parity tolerances tight).
"""

from __future__ import annotations

PLATFORMS = ("gpu", "tpu", "cpu")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")  # precision.compute_dtype
FLOAT_DTYPES = ("float32", "bfloat16")  # precision.reduce_dtype, and compute_dtype once resolved
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def check_platform(platform: str) -> str:
    """`platform` if it is one of `PLATFORMS`; raises ValueError naming them otherwise."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform {platform!r} is not one of {', '.join(PLATFORMS)}")
    return platform


def resolve_compute_dtype(compute_dtype: str, platform: str) -> str:
    """The dtype name `precision.compute_dtype` means on `platform`: itself, or for `auto` float32 on cpu and
    bfloat16 elsewhere (any backend name that is not cpu counts as an accelerator, so `jax.default_backend()`
    can be passed as it is).

    Raises:
      ValueError: `compute_dtype` not one of `COMPUTE_DTYPES`.
    """
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"precision.compute_dtype={compute_dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}")
    if compute_dtype != "auto":
        return compute_dtype
    return "float32" if platform == "cpu" else "bfloat16"
