"""The number format each GEMM of a compiled program multiplies in, and which kernels run them, from its HLO text.

    compiled = jax.jit(step).lower(*args).compile()
    flops = gemm_flops_by_format(compiled.as_text())   # {"fp8": [FLOPs of partition 0, ...], "other": [...]}
    kernels = gemm_kernels(compiled.as_text())         # {"__cublas$lt$matmul$f8": 24, "__triton_gemm": 3, ...}

A GEMM is FP8 when both of its operands are FP8 arrays (`f8e4m3fn`, `f8e5m2`, ...) where it multiplies them: a
`dot` whose operands are FP8 (XLA's GPU compiler keeps such a dot inside a Triton GEMM fusion), or a cuBLAS
custom call whose first two operands are (cuBLASLt's FP8 GEMM, `FP8_CUBLAS_TARGET`). A dot of dequantised copies
(FP8 converted to bf16, then scaled) multiplies bf16 and counts as `other`: that is the fallback this module
exists to catch. FLOPs are 2 x (result elements) x (contracted elements) per GEMM, times the trip counts of the
loops around it, only the conditional branch each partition takes (`jaxpar.analysis.hlo.flops.per_device_cost`).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter

from jaxpar.analysis.hlo.collectives import _arrays, _Instr, parse_module
from jaxpar.analysis.hlo.flops import _dot_flops, per_device_cost

FP8_CUBLAS_TARGET = "__cublas$lt$matmul$f8"  # cuBLASLt's FP8 GEMM, as XLA's GPU compiler names the call
_CUBLAS = "__cublas$"
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_FUSION_KIND = re.compile(r'"kind":"(__[\w$]+)"')


def _is_fp8(dtype: str) -> bool:
    return dtype.startswith("f8")


def _target(i: _Instr) -> str:
    m = _TARGET.search(i.attrs)
    return m.group(1) if m else ""


def _gemm(module, comp: str, i: _Instr) -> tuple[float, bool] | None:
    """(FLOPs, FP8?) of a dot or cuBLAS GEMM call; None for any other instruction."""
    cublas = i.opcode == "custom-call" and _target(i).startswith(_CUBLAS)
    if i.opcode != "dot" and not cublas:
        return None
    lhs, rhs = (module.operand_arrays(comp, i, k)[0] for k in (0, 1))
    if cublas:
        config = re.search(r"backend_config=(\{.*\})", i.attrs)
        numbers = json.loads(config.group(1)).get("gemm_backend_config", {}) if config else {}
        dims_json = numbers.get("dot_dimension_numbers", {}).get("lhs_contracting_dimensions", [])
        flops = 2.0 * math.prod(_arrays(i.type_str)[0].shape) * math.prod(lhs.shape[int(d)] for d in dims_json)
    else:
        flops = _dot_flops(module, comp, i)
    return flops, _is_fp8(lhs.dtype) and _is_fp8(rhs.dtype)


def gemm_flops_by_format(hlo_text: str) -> dict[str, list[float]]:
    """GEMM FLOPs of one run of the program on each partition, split into {"fp8": [...], "other": [...]}
    (module docstring; index = partition id).

    Raises:
      ValueError: as `jaxpar.analysis.hlo.flops.dot_flops_per_device` (an unreadable loop trip count or
        conditional selector).
    """

    def cost(fp8: bool):
        def of(module, comp, i):
            g = _gemm(module, comp, i)
            return g[0] if g is not None and g[1] == fp8 else 0.0

        return of

    return {"fp8": per_device_cost(hlo_text, cost(True)), "other": per_device_cost(hlo_text, cost(False))}


def gemm_kernels(hlo_text: str) -> dict[str, int]:
    """How many GEMM kernels of each kind the program text holds (each once, whatever its loops' trip counts):
    cuBLAS calls by custom-call target (`FP8_CUBLAS_TARGET`, `__cublas$gemm`, ...) and GEMM fusions by their
    backend kind (`__triton_gemm`, ...), with ` fp8` appended where the GEMM multiplies FP8 operands."""
    computations, _, _ = parse_module(hlo_text)
    by_name = {c: {i.name: i for i in instrs} for c, instrs in computations.items()}
    kernels: Counter[str] = Counter()

    def fp8_dot(comp: str) -> bool:
        for i in computations.get(comp, []):
            if i.opcode == "dot":
                operands = [by_name[comp][o] for o in i.operands[:2]]
                return all(_is_fp8(_arrays(o.type_str)[0].dtype) for o in operands)
        return False

    for instrs in computations.values():
        for i in instrs:
            if i.opcode == "custom-call" and _target(i).startswith(_CUBLAS):
                kernels[_target(i)] += 1
            elif i.opcode == "fusion" and "kind=kCustom" in i.attrs:
                kind = _FUSION_KIND.search(i.attrs)
                called = re.search(r"calls=%?([\w.\-]+)", i.attrs)
                if kind and "gemm" in kind.group(1) and called:
                    kernels[kind.group(1) + (" fp8" if fp8_dot(called.group(1)) else "")] += 1
    return dict(sorted(kernels.items()))
