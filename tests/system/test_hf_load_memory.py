"""Peak host memory of `model.init_from`'s lazy load (`jaxpar.analysis.bench.hf_memory`, as benchmarks/
hf_load_memory.py measures it at 1B): a fresh process placing a synthetic 54M-parameter Llama (bf16 safetensors,
tied, d_model 1024, vocab 32000) onto fsdp over its 2 CPU devices holds, besides the program and the placed
weights, at most two of its largest blocks (the embedding's half, float32: 65.5 MB) plus 32 MiB for the allocator
(glibc keeps freed blocks under its 32 MiB mmap threshold in its heap); the eager load does not fit that bound."""

import dataclasses

import pytest

from jaxpar.analysis.bench import hf_memory

MARGIN = 32 * 2**20  # bytes


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_lazy_load_holds_two_blocks_at_most(tmp_path):
    """Slow (about 10 s on 2 CPU cores: writing the checkpoint, then two fresh processes)."""
    shape = {"d_model": 1024, "n_layers": 2, "n_heads": 8, "n_kv_heads": 8, "d_ff": 2048, "vocab_size": 32000}
    model = dataclasses.replace(hf_memory.model_config(**shape), tie_embeddings=True)
    hf_dir = str(tmp_path / "hf")
    assert hf_memory.write_synthetic(hf_dir, model, "bfloat16") == 53_744_640
    lazy, eager = (hf_memory.measure(mode, hf_dir, str(tmp_path), 1, 2)[0] for mode in ("lazy", "eager"))
    print(hf_memory.format_rows([lazy, eager]))
    bound = 2 * lazy["block"] + MARGIN
    assert lazy["block"] == 32000 * 512 * 4 and lazy["held"] == 53_744_640 * 4
    assert lazy["read"] == 53_744_640 * 2  # every tensor once, bf16
    assert lazy["staging"] <= bound, f"lazy staging {lazy['staging']} > 2 x block + 32 MiB = {bound}"
    assert eager["staging"] > bound  # the bound tells the two apart
