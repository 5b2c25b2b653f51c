"""Precision: the dtype names, what each `precision.layout` means, and how `precision.compute_dtype: auto` resolves
on each platform. No jax: the planner and the commands that must not start jax resolve a config for a machine they
are not running on.

Dtypes are named as numpy and jax name them ("float32", "bfloat16", "float16"); `DTYPE_BYTES` is the one table of
those names and their widths. Code that needs the dtype object derives it from the name (`numpy.dtype(name)` and
`jax.numpy.dtype(name)` know bfloat16 once ml_dtypes is imported, which jax does). HLO text names its types
differently ("bf16", "f32"); that vocabulary stays with the HLO reader (`jaxpar.analysis.hlo.collectives`).

Platforms (`PLATFORMS`) are the machines a step is planned or compiled for, named as jax names a device's platform
(`jax.Device.platform`, `jax.default_backend()`): `gpu`, `tpu`, `cpu`. `auto` is bfloat16 on an accelerator and
float32 on cpu (XLA:CPU has no fast bf16 matmuls, and fp32 keeps the CPU tests' parity tolerances tight). The train
step resolves it once, from its mesh's devices (`jaxpar.training.plan.build_plan`); the planner from the platform it
plans for.

Layouts (`LAYOUTS`, `precision.layout`; ZeRO, Rajbhandari et al. 2019, arXiv 1910.02054, section 3.1):

    layout   working params   gradients   fp32 master   Adam m, v   bytes per parameter (params, grads, opt_state)
    fp32     float32          float32     no            fp32        4, 4, 8
    16p      bfloat16         bfloat16    yes           fp32        2, 2, 12 (master 4 + moments 8)
"""

from __future__ import annotations

import dataclasses

PLATFORMS = ("gpu", "tpu", "cpu")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")  # precision.compute_dtype
FLOAT_DTYPES = ("float32", "bfloat16")  # precision.reduce_dtype, and compute_dtype once resolved
# Bytes per element of each floating-point dtype by name (float16: Hugging Face weights may be stored in it).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP8_SCALINGS = ("current", "delayed")  # precision.fp8.scaling
FP8_AMAX_COMPUTE = ("max", "most_recent")  # precision.fp8.amax_compute (delayed scaling)
FP8_MAX_HISTORY = 4096  # the longest precision.fp8.amax_history
FP8_MIN_CAPABILITY = (8, 9)  # NVIDIA compute capability of the first FP8 tensor cores (Ada, Hopper)
MASTER_DTYPE = "float32"  # the optimizer's copy of the parameters, and its moments
ADAM_MOMENTS = 2  # m and v, each one fp32 number per parameter


@dataclasses.dataclass(frozen=True)
class PrecisionLayout:
    """What a `precision.layout` means for the train state (module docstring).

    Attributes:
      name: the layout's config name, `fp32` or `16p`.
      param_dtype: dtype name of the working parameters the forward reads, and of the gradients the step returns.
      master: whether the state keeps an fp32 master copy that the optimizer updates (the working parameters are
        then its cast).
    """

    name: str
    param_dtype: str
    master: bool

    @property
    def param_bytes(self) -> int:
        """Bytes per working parameter."""
        return DTYPE_BYTES[self.param_dtype]

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element (the gradients are in the parameter dtype)."""
        return DTYPE_BYTES[self.param_dtype]

    @property
    def master_bytes(self) -> int:
        """Bytes per parameter of the fp32 master copy (0 without one)."""
        return DTYPE_BYTES[MASTER_DTYPE] if self.master else 0

    @property
    def moment_bytes(self) -> int:
        """Bytes per parameter of AdamW's two fp32 moments."""
        return ADAM_MOMENTS * DTYPE_BYTES[MASTER_DTYPE]

    @property
    def bytes_per_param(self) -> dict[str, int]:
        """{"params", "grads", "opt_state" (the master copy and the moments)}: bytes per parameter of each state
        kind, as the ZeRO formula counts them (`jaxpar.analysis.planner.memory`)."""
        return {
            "params": self.param_bytes,
            "grads": self.grad_bytes,
            "opt_state": self.master_bytes + self.moment_bytes,
        }


LAYOUTS = {
    "fp32": PrecisionLayout("fp32", param_dtype="float32", master=False),
    "16p": PrecisionLayout("16p", param_dtype="bfloat16", master=True),
}


def precision_layout(name: str) -> PrecisionLayout:
    """The `PrecisionLayout` named `name` (`precision.layout`).

    Raises:
      ValueError: `name` is not one of `LAYOUTS`.
    """
    if name not in LAYOUTS:
        raise ValueError(f"precision.layout={name!r} is not one of {', '.join(LAYOUTS)}")
    return LAYOUTS[name]


def check_fp8_capability(device_kind: str, capability: tuple[int, ...]) -> None:
    """Refuses `precision.fp8.enabled` on an NVIDIA GPU of compute capability `capability` below
    `FP8_MIN_CAPABILITY` (no FP8 tensor cores, e.g. A100's (8, 0): XLA would run the GEMMs upcast, slower than
    bf16).

    Raises:
      ConfigError: the device has no FP8 tensor cores (the message names it and the fix).
    """
    from jaxpar.config.errors import ConfigError

    if tuple(capability) < FP8_MIN_CAPABILITY:
        need = ".".join(map(str, FP8_MIN_CAPABILITY))
        raise ConfigError(
            f"precision.fp8.enabled=true needs FP8 tensor cores (compute capability {need}+); {device_kind} has "
            f"compute capability {'.'.join(map(str, capability))}; set precision.fp8.enabled=false, or run on "
            f"H100, H200 or B200"
        )


def check_platform(platform: str) -> str:
    """`platform` if it is one of `PLATFORMS`; raises ValueError naming them otherwise."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform {platform!r} is not one of {', '.join(PLATFORMS)}")
    return platform


def resolve_compute_dtype(compute_dtype: str, platform: str) -> str:
    """The dtype name `precision.compute_dtype` means on `platform`: itself, or for `auto` float32 on cpu and
    bfloat16 elsewhere (any platform name that is not cpu counts as an accelerator, so a device's platform can be
    passed as it is).

    Raises:
      ValueError: `compute_dtype` not one of `COMPUTE_DTYPES`.
    """
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"precision.compute_dtype={compute_dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}")
    if compute_dtype != "auto":
        return compute_dtype
    return "float32" if platform == "cpu" else "bfloat16"
