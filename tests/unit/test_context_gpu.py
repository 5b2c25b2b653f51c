"""Context parallelism compiled for GPUs by XLA's GPU compiler without a GPU (`requires_gpu_compile`): a 2-layer
llama_125m at 4096 tokens on 8 H100s as context 4 x data 2.

* all_gather: each query chunk (T/(2c) = 512 tokens) runs cuDNN's fused kernel twice per layer and pass: the
  diagonal block as a CAUSAL call of 512 queries x 512 keys, and the prefix as a PADDING call (no causal mask,
  keys cut by their per-row length) against the longest prefix, (2c - 1) * 512 = 3584 keys
  (`jaxpar.model.context_attention`); no attention scores in memory.
* ring (on cuDNN: `jaxpar.model.context_ring`): every permute of a K/V block (name scope `ring_shift`, K and V
  packed as one bf16 array) is asynchronous, and in each ring pass (forward, the recomputed forward, backward) all
  but at most one have kernels scheduled between their start and done. The block permutes depend only on each
  other, not on the blocks' compute, so XLA's scheduler may wait for the first at once and run the rest of the
  chain under the compute (seen: 0 kernels under the first permute of the forward, 5 and 14 under the others).
"""

import os
import re

import pytest

from jaxpar.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OVERRIDES = [
    "mesh.context=4",
    "mesh.data=2",
    "mesh.fsdp=1",
    "mesh.tensor=1",
    "model.n_layers=2",
    "data.seq_len=4096",
    "train.global_batch_size=2",
    "train.grad_accum_steps=1",
]
_MASK = re.compile(r'"mask_type":\s*"(\w+)"')
_SCORES = re.compile(r'"intermediate_tensor_shape".*?"dimensions":\s*\[([^\]]*)\]')


def _compile(strategy: str) -> dict:
    from jaxpar.analysis.gpu.deviceless import compile_for_gpu

    path = os.path.join(ROOT, "configs", "llama_125m.yaml")
    cfg = load_config(path, [*OVERRIDES, f"context.strategy={strategy}"], validate=False)  # checked for the GPUs
    return compile_for_gpu(cfg, "h100", 1, 8, keep_hlo=True)


def _shape(out: dict, row) -> str:
    """The result shape of a collective's start instruction in the compiled HLO."""
    name = row.name.lstrip("%")
    line = next(x for x in out["hlo"].splitlines() if x.strip().startswith(f"%{name} = "))
    return line.split(" = ", 1)[1]


@pytest.mark.requires_gpu_compile
def test_all_gather_runs_cudnn_on_the_diagonal_block_and_the_prefix():
    out = _compile("all_gather")
    assert out["mesh"]["context"] == 4 and out["fits"]
    assert out["fused_attention"] == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"]
    assert not out["attention_scores"]["materialised"]
    calls = {}
    for line in out["hlo"].splitlines():
        if "custom-call(" in line and "fmha" in line:
            scores = tuple(int(d.strip('" ')) for d in _SCORES.search(line).group(1).split(","))  # [B, H, Nq, Nk]
            key = (_MASK.search(line).group(1), scores[-2:])
            calls[key] = calls.get(key, 0) + 1
    assert set(calls) == {("CAUSAL", (512, 512)), ("PADDING", (512, 3584))}, calls
    assert calls[("CAUSAL", (512, 512))] == calls[("PADDING", (512, 3584))]  # two calls per chunk, per pass


@pytest.mark.requires_gpu_compile
def test_ring_permutes_run_under_the_blocks_compute():
    from jaxpar.analysis.hlo.overlap import async_collectives

    out = _compile("ring")
    assert out["fused_attention"] == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"]
    blocks = [r for r in async_collectives(out["hlo"]) if "/ring_shift/" in r.op_name and "bf16[" in _shape(out, r)]
    assert len(blocks) >= 3  # c - 1 = 3 per ring pass
    assert all(r.kind == "collective-permute" and r.asynchronous for r in blocks), blocks
    passes: dict = {}
    for r in blocks:
        passes.setdefault(r.computation, []).append(r.compute > 0)
    assert all(sum(under) >= len(under) - 1 for under in passes.values()), passes
