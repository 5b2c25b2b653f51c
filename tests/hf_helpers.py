"""Shared by the Hugging Face weight tests: the fixture directories and a tensor-for-tensor comparison."""

import os

import numpy as np
from safetensors import safe_open

from jaxpar.model.hf.weights import weight_files

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
UNTIED = os.path.join(FIXTURES, "hf_llama_untied")  # float32, untied, 4/2 heads, llama3 rope scaling, one file
TIED = os.path.join(FIXTURES, "hf_llama_tied_bf16")  # bfloat16, tied, 4/1 heads, three shards with an index
QWEN2 = os.path.join(FIXTURES, "hf_qwen2_tied")  # float32, tied, 4/2 heads, random q/k/v biases, one file
QWEN3 = os.path.join(FIXTURES, "hf_qwen3_bf16")  # bfloat16, untied, 4/2 heads of width 16 (not 32/4), 5 shards
MISTRAL = os.path.join(FIXTURES, "hf_mistral_window")  # float32, untied, 4/1 heads, sliding window 5 of 16 tokens
MIXTRAL = os.path.join(FIXTURES, "hf_mixtral")  # float32, untied, 4/2 heads, 4 experts of width 48, top-2
# float32, tied, 4 layers (local, global, ...), 4/2 heads of width 16, window 5, score scale 24 ** -0.5, caps 2 and 10
GEMMA2 = os.path.join(FIXTURES, "hf_gemma2")
FAMILY_FIXTURES = {"qwen2": QWEN2, "qwen3": QWEN3, "mistral": MISTRAL, "mixtral": MIXTRAL, "gemma2": GEMMA2}


def hf_tensors_of(hf_dir: str) -> dict[str, np.ndarray]:
    """Every tensor of a Hugging Face directory, as stored."""
    out = {}
    for name, path in weight_files(hf_dir).items():
        with safe_open(path, "numpy") as f:
            out[name] = f.get_tensor(name)
    return out


def assert_same_tensors(a_dir: str, b_dir: str) -> None:
    """Same tensor names, dtypes, shapes and bytes."""
    a, b = hf_tensors_of(a_dir), hf_tensors_of(b_dir)
    assert sorted(a) == sorted(b)
    for name in a:
        assert (a[name].dtype, a[name].shape) == (b[name].dtype, b[name].shape), name
        assert a[name].tobytes() == b[name].tobytes(), name
