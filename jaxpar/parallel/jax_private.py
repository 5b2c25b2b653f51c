"""Every name jaxpar takes from jax's private modules (`jax._src`), in one place: what it is, why jaxpar needs it,
and what to switch to once jax exposes it. Every other module imports these from here
(tests/unit/test_architecture.py fails on `jax._src` anywhere else), so a jax upgrade that moves one of them
breaks this file only, and tests/unit/test_jax_private.py says which name went.

  eval_jaxpr(jaxpr, consts, *args) -> list           jax._src.core.eval_jaxpr
      Runs a jaxpr on arrays (or tracers). Used by `jaxpar.parallel.pipeline_1f1b` to rebuild, in the backward
      tick of 1F1B, the residuals computed from the weights alone. Public replacement, already there:
      `jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(jaxpr, consts))(*args)`, the same evaluation
      with jax's NaN checking (`jax_debug_nans`) turned off inside it.
  dce_jaxpr(jaxpr, used_outputs) -> (jaxpr, used_inputs)   jax._src.interpreters.partial_eval.dce_jaxpr
      Dead-code elimination of a jaxpr for the outputs asked for, returning which inputs the rest reads. Used by
      `jaxpar.parallel.pipeline_1f1b` to find which residuals depend on the weights only. jax also reaches it as
      `jax.interpreters.partial_eval.dce_jaxpr`, a compatibility module that is not public API; switch when
      `jax.extend` exposes dead-code elimination.
  convert_constvars_jaxpr(jaxpr) -> jaxpr            jax._src.interpreters.partial_eval.convert_constvars_jaxpr
      The same jaxpr with its constants turned into leading inputs, so `dce_jaxpr` reports whether an output
      reads them. Used by `jaxpar.parallel.pipeline_1f1b`. No public replacement; switch when `jax.extend` has one.
  cudnn_attention() -> (dot_product_attention, MaskType)   jax._src.cudnn.fused_attention_stablehlo
      cuDNN's fused flash attention with per-segment offsets and lengths (`q_offsets`, `kv_offsets`), the packed
      document layout of `jaxpar.model.attention`. The public `jax.nn.dot_product_attention(implementation=
      "cudnn")` takes one length per row only (padding, one document per row); switch to it when it takes
      segment offsets. Imported when called: the module is loaded only where packed cuDNN attention is traced.
  cudnn_attention_parts() -> (dot_product_attention, backward rule, MaskType, the BTNH layout's value)
      The same module's forward (with `return_residual=True`: the softmax statistics, the per-query log-sum-exp)
      and the backward rule of its custom VJP, called with statistics and an output of our own. Context parallelism's
      cuDNN path (`jaxpar.model.context_attention`) runs a query chunk as two kernel calls, combines them by their
      log-sum-exps and runs each call's backward with the combined output and statistics; jax's VJP of the public
      call drops the statistics' cotangent and reads its own output, so neither can express it. No public
      replacement; switch when `jax.nn.dot_product_attention` returns and takes the statistics.
  cudnn_compute_capability(capability) -> a context manager   jax._src.cudnn.fused_attention_stablehlo
      Inside it, that module's checks of the local GPU's compute capability (`check_compute_capability`,
      `is_cuda_compute_capability_equal`) answer for `capability` instead. jax decides from the local GPU whether
      cuDNN's fused attention takes heads wider than 128 (Hopper and newer: 256) or the packed layout; a deviceless
      compile for a GPU cluster (`jaxpar.analysis.gpu.deviceless`) has no local GPU, only compile-only devices of
      the target's capability, so it traces as for that target. No public replacement: switch when jax reads the
      capability from the devices the computation is lowered for.
  cudnn_capability_checks() -> (check_compute_capability, is_cuda_compute_capability_equal)
      The same module's two checks as they stand (what `cudnn_compute_capability` replaces and restores).
  distributed_client() -> the coordination-service client, or None   jax._src.distributed.global_state.client
      The key-value store of the coordination service `jax.distributed.initialize` starts (process 0 hosts it),
      through the same client jax itself uses. Used by `jaxpar.training.watchdog` to publish heartbeats and
      name the missing process of a hung run. Public `jax.distributed` offers initialize, is_initialized and
      shutdown only; switch when it exposes the key-value store.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from jax._src.core import eval_jaxpr
from jax._src.interpreters.partial_eval import convert_constvars_jaxpr, dce_jaxpr

__all__ = [
    "convert_constvars_jaxpr",
    "cudnn_attention",
    "cudnn_attention_parts",
    "cudnn_capability_checks",
    "cudnn_compute_capability",
    "dce_jaxpr",
    "distributed_client",
    "eval_jaxpr",
]


def cudnn_attention() -> tuple[Any, Any]:
    """(dot_product_attention, MaskType) of jax's cuDNN fused-attention module (module docstring)."""
    from jax._src.cudnn import fused_attention_stablehlo

    return fused_attention_stablehlo.dot_product_attention, fused_attention_stablehlo.MaskType


def cudnn_attention_parts() -> tuple[Any, Any, Any, int]:
    """(dot_product_attention, its backward rule, MaskType, AttentionLayout.BTNH's value) of jax's cuDNN
    fused-attention module (module docstring)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    return fa.dot_product_attention, fa._dot_product_attention_bwd_rule, fa.MaskType, fa.AttentionLayout.BTNH.value


def cudnn_capability_checks() -> tuple[Any, Any]:
    """(check_compute_capability, is_cuda_compute_capability_equal) of jax's cuDNN fused-attention module, as they
    stand (module docstring)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    return fa.check_compute_capability, fa.is_cuda_compute_capability_equal


@contextlib.contextmanager
def cudnn_compute_capability(capability: tuple[int, int]) -> Iterator[None]:
    """jax's cuDNN attention checks answer for a GPU of compute `capability` (major, minor) while inside (module
    docstring); restored on exit."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    def parse(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split("."))

    saved = fa.check_compute_capability, fa.is_cuda_compute_capability_equal
    fa.check_compute_capability = lambda c: tuple(capability) >= parse(c)
    fa.is_cuda_compute_capability_equal = lambda c: tuple(capability) == parse(c)
    try:
        yield
    finally:
        fa.check_compute_capability, fa.is_cuda_compute_capability_equal = saved


def distributed_client() -> Any:
    """jax's coordination-service client (`key_value_set`, `key_value_dir_get`, ...), or None before
    `jax.distributed.initialize` (module docstring)."""
    from jax._src import distributed

    return distributed.global_state.client
