"""Attention implementations (`model.attention`), and what `auto` means on each platform. No jax: the planner and
the commands that must not start jax resolve a config for a machine they are not running on.

  xla    `jax.nn.dot_product_attention`'s XLA path: it writes the scores [b, H, T, T] to memory (fp32 logits and
         their softmax), so attention memory grows with T^2. Runs everywhere, in any dtype.
  cudnn  NVIDIA's fused flash-attention kernel through cuDNN (Dao 2023, "FlashAttention-2"): scores stay on chip,
         the backward recomputes them from the output and the softmax statistics (logsumexp, [b, H, T] fp32), so
         attention memory grows with T. NVIDIA GPUs only, bfloat16 (or float16) only, head width a multiple of
         8 up to 128 (256 on Hopper and newer: Multi-head Latent Attention's 192). With packed documents (segment
         ids) it uses cuDNN's packed layout, which needs a Hopper GPU (compute capability 9.0) or newer.
  auto   cudnn on an NVIDIA GPU when the compute dtype and head width allow it and the scores are not soft-capped
         (`model.attention_softcap`, which cuDNN's kernel lacks), xla otherwise (and on CPU).
"""

from __future__ import annotations

ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn")  # model.attention
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 128  # what every cuDNN flash-attention GPU takes
CUDNN_MAX_HEAD_DIM_HOPPER = 256  # on compute capability 9.0 (Hopper) and newer (jax's check_is_flash_attention)
HOPPER = (9, 0)
# The GPUs `jaxpar-plan` plans for when no cluster is named (and the analytic planner always): Hopper-class (H100,
# H200; B200 alike), whose cuDNN takes head widths up to 256. An A100 takes 128.
PLANNED_GPU_CAPABILITY = HOPPER


def cudnn_max_head_dim(capability: tuple[int, int] | None) -> int:
    """The widest head cuDNN's fused attention takes on a GPU of compute `capability` ((major, minor); None: not
    known, e.g. a CPU process resolving for a GPU it cannot see): 256 from Hopper (9.0) on, else 128."""
    return CUDNN_MAX_HEAD_DIM_HOPPER if capability is not None and capability >= HOPPER else CUDNN_MAX_HEAD_DIM


def cudnn_unsupported(
    compute_dtype: str, head_dim: int, softcap: float | None = None, capability: tuple[int, int] | None = None
) -> str | None:
    """Why cuDNN's fused attention cannot run this shape (a sentence naming the fix), or None when it can.

    Args:
      compute_dtype: the resolved compute dtype name (`jaxpar.config.precision.resolve_compute_dtype`).
      head_dim: the per-head width the kernel gets (`ModelConfig.kernel_head_width`).
      softcap: `model.attention_softcap` (cuDNN has no soft-capping), or None.
      capability: the GPU's compute capability (`cudnn_max_head_dim`), or None (128 at most).
    """
    if softcap is not None:
        return (
            f"cuDNN attention has no soft-capping of the scores (model.attention_softcap={softcap}); set "
            f"model.attention=xla"
        )
    if compute_dtype not in CUDNN_DTYPES:
        return (
            f"cuDNN attention computes in bfloat16 or float16, not {compute_dtype}; set "
            f"precision.compute_dtype=bfloat16 or model.attention=xla"
        )
    widest = cudnn_max_head_dim(capability)
    if head_dim % 8 or head_dim > widest:
        on = "on Hopper and newer" if widest > CUDNN_MAX_HEAD_DIM else "on this GPU (256 on Hopper and newer)"
        return (
            f"cuDNN attention takes head widths that are multiples of 8 up to {widest} {on}, not "
            f"{head_dim}; change model.head_dim or set model.attention=xla"
        )
    return None


def resolve_attention(
    attention: str,
    platform: str,
    compute_dtype: str,
    head_dim: int,
    softcap: float | None = None,
    capability: tuple[int, int] | None = None,
) -> str:
    """The implementation `model.attention` means on `platform` (`gpu`, `tpu`, `cpu`, as `jax.default_backend()`
    names them): `xla` or `cudnn`. `auto` is cudnn on gpu when `cudnn_unsupported` finds nothing, else xla.
    `head_dim` is the width the kernel gets (`ModelConfig.kernel_head_width`); `capability` the GPU's compute
    capability, which decides the widest head (`cudnn_max_head_dim`).

    Raises:
      ValueError: `attention` is not one of `ATTENTION_IMPLEMENTATIONS`; `cudnn` on a platform other than gpu, or
        with a dtype, head width or soft-capping (`softcap`) cuDNN does not take (the message names the fix).
    """
    if attention not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"model.attention={attention!r} is not one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
    unsupported = cudnn_unsupported(compute_dtype, head_dim, softcap, capability)
    if attention == "auto":
        return "cudnn" if platform == "gpu" and unsupported is None else "xla"
    if attention == "cudnn":
        if platform != "gpu":
            raise ValueError(
                f"model.attention=cudnn runs on NVIDIA GPUs only, and this step runs on {platform}; set "
                f"model.attention=auto (cudnn on a GPU, xla elsewhere) or xla"
            )
        if unsupported:
            raise ValueError(unsupported)
    return attention
