"""FP8 GEMMs compiled for GPUs by XLA's GPU compiler without a GPU (`requires_gpu_compile`): llama_1b's train step
(16 layers, 4096 tokens, 16 accumulation steps) on 8 H100s and 8 B200s, fsdp 8 and fsdp 4 x tensor 2.

The count the model implies, in FLOPs per device per step (so that XLA's merging of GEMMs that share an operand,
e.g. the q, k and v weight gradients, does not change it): every projection runs one GEMM forward and two backward
(dx and dw) on each of the device's N tokens, 3 x 2 x N x P_proj / t FLOPs with P_proj the projection weights'
elements (D (H + 2G) K + H K D + 3 D F per layer) and t the tensor size, all with FP8 operands; the only GEMMs not
in FP8 are the head's, 3 x 2 x N x D x V / t. Attention's score GEMMs run in cuDNN's fused kernel (no GEMM here).
With XLA's default GEMM backend the FP8 GEMMs are Triton fusions over FP8 operands; with Triton GEMMs off
(`xla_gpu_enable_triton_gemm=false`) every one is cuBLASLt's FP8 GEMM, `__cublas$lt$matmul$f8`. On a GPU, XLA's
autotuner picks between the two per GEMM.
"""

import os

import pytest

from jaxpar.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYOUTS = {"fsdp8": ["mesh.fsdp=8", "mesh.tensor=1"], "fsdp4_tensor2": ["mesh.fsdp=4", "mesh.tensor=2"]}


def _compile(target: str, layout: str, fp8: bool = True, *extra: str, **options) -> tuple[dict, object]:
    from jaxpar.analysis.gpu.deviceless import compile_for_gpu

    overrides = [*LAYOUTS[layout], "mesh.data=1", f"precision.fp8.enabled={str(fp8).lower()}", *extra]
    cfg = load_config(os.path.join(ROOT, "configs", "llama_1b.yaml"), overrides, validate=False)
    return compile_for_gpu(cfg, target, 1, 8, compiler_options=options or None), cfg


def _implied(cfg, tensor: int) -> tuple[float, float]:
    """(FP8 GEMM FLOPs, other GEMM FLOPs) per device per step that the model implies (module docstring)."""
    m = cfg.model
    tokens = cfg.train.global_batch_size * cfg.data.seq_len / (cfg.mesh.data * cfg.mesh.fsdp)
    per_layer = m.d_model * (m.n_heads + 2 * m.kv_heads) * m.head_width + m.n_heads * m.head_width * m.d_model
    per_layer += 3 * m.d_model * m.d_ff
    return 6 * tokens * m.n_layers * per_layer / tensor, 6 * tokens * m.d_model * m.vocab_size / tensor


@pytest.mark.requires_gpu_compile
@pytest.mark.parametrize(("target", "layout"), [("h100", "fsdp8"), ("h100", "fsdp4_tensor2"), ("b200", "fsdp8")])
def test_every_projection_gemm_is_fp8_and_only_the_head_is_not(target, layout):
    out, cfg = _compile(target, layout)
    fp8, other = _implied(cfg, out["mesh"]["tensor"])
    gemms = out["gemms"]
    assert gemms["fp8_flops"] == fp8, (gemms, fp8)
    assert gemms["other_flops"] == other, (gemms, other)
    plain = {k: n for k, n in gemms["kernels"].items() if not k.endswith(" fp8")}
    assert sum(plain.values()) == 3, gemms["kernels"]  # the head: forward, dx, dw
    assert out["fits"]


@pytest.mark.requires_gpu_compile
def test_without_triton_gemms_every_fp8_gemm_is_cublaslt_fp8_and_fp8_costs_no_memory():
    from jaxpar.analysis.hlo.gemms import FP8_CUBLAS_TARGET

    out, cfg = _compile("h100", "fsdp8", xla_gpu_enable_triton_gemm=False)
    assert out["gemms"]["fp8_flops"] == _implied(cfg, 1)[0]
    assert set(out["gemms"]["kernels"]) == {FP8_CUBLAS_TARGET, "__cublas$lt$matmul"}, out["gemms"]["kernels"]
    # FP8's saved activations (remat dots keeps the GEMM outputs, in bf16 as without FP8) and its 1-byte operand
    # copies leave the peak within 2% of bf16's (measured 18.49 GB against 18.33 GB)
    bf16, _ = _compile("h100", "fsdp8", fp8=False, xla_gpu_enable_triton_gemm=False)
    assert out["memory"]["peak_bytes"] <= 1.02 * bf16["memory"]["peak_bytes"]


@pytest.mark.requires_gpu_compile
def test_delayed_scaling_keeps_every_projection_gemm_fp8():
    """`precision.fp8.scaling=delayed`: the same FP8 GEMMs (the history's scales change no GEMM), and the step
    still fits."""
    out, cfg = _compile("h100", "fsdp4_tensor2", True, "precision.fp8.scaling=delayed")
    fp8, other = _implied(cfg, out["mesh"]["tensor"])
    assert (out["gemms"]["fp8_flops"], out["gemms"]["other_flops"]) == (fp8, other), out["gemms"]
    assert out["fits"]
