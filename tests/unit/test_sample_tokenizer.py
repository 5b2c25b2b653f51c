"""The end-of-run sample decodes with the run's tokenizer (the shard set's own copy for `data.source: shards`),
says why and skips when there is none or the model is too large to gather onto one host."""

from __future__ import annotations

import os
import types

import jax
import numpy as np
import pytest
from step_helpers import make_plan, quick_compile
from tokenize_helpers import STDLIB_FILES, stdlib_path, train_hf_bpe

from jaxpar.config import Config
from jaxpar.config.schema import DataConfig
from jaxpar.data.tokenize_corpus import TokenizeOptions, tokenize_corpus
from jaxpar.data.tokenizer import ByteTokenizer
from jaxpar.training.hooks import SampleHook
from jaxpar.training.hooks.base import TrainResult
from jaxpar.training.sample import SamplingUnavailable, run_tokenizer, sample_text
from jaxpar.training.state import init_state


@pytest.fixture(scope="module")
def bpe_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("sample")
    bpe = train_hf_bpe(str(root / "tokenizer.json"))
    out = str(root / "set")
    tokenize_corpus(TokenizeOptions((stdlib_path(STDLIB_FILES[0]),), out, bpe, workers=1, progress=False))
    return out


@pytest.fixture(scope="module")
def tiny():
    """A tiny llama plan (vocabulary 512) on one device and its initial parameters."""
    with quick_compile():
        plan = make_plan(["model.vocab_size=512", "mesh.data=1", "mesh.fsdp=1"], jax.devices()[:1])
        return plan, init_state(plan, 0)["params"]


class _Recording:
    """A tokenizer of 300 ids (BOS 5) that records what it decodes."""

    vocab_size, bos_id, eos_id = 300, 5, None

    def __init__(self):
        self.decoded = []

    def encode(self, text):
        return np.array([7, 8])

    def decode(self, ids):
        self.decoded.append(list(ids))
        return "decoded"


def test_run_tokenizer_of_each_source(bpe_set, tmp_path):
    for source in ("stdlib", "text", "jsonl"):
        assert isinstance(run_tokenizer(DataConfig(source=source, path="x")), ByteTokenizer)
    tok = run_tokenizer(DataConfig(source="shards", path=bpe_set))
    assert tok.vocab_size == 500 and tok.bos_id == 0
    assert tok.decode(tok.encode("def f(x):\n    return x")) == "def f(x):\n    return x"
    with pytest.raises(SamplingUnavailable, match="data.source=tokens records no tokenizer"):
        run_tokenizer(DataConfig(source="tokens", path="x"))
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(bpe_set, broken)
    for name in os.listdir(broken / "tokenizer"):
        os.remove(broken / "tokenizer" / name)
    with pytest.raises(SamplingUnavailable, match="cannot be rebuilt.*missing"):
        run_tokenizer(DataConfig(source="shards", path=str(broken)))


def test_sample_encodes_and_decodes_with_the_given_tokenizer(tiny):
    plan, params = tiny
    tok = _Recording()
    assert sample_text(plan, params, prompt="def ", num_tokens=6, seed=0, tokenizer=tok) == "decoded"
    (ids,) = tok.decoded
    assert ids[:2] == [7, 8] and len(ids) == 8  # the prompt after BOS (not decoded), then 6 sampled ids
    assert all(0 <= i < tok.vocab_size for i in ids)  # never an id past the tokenizer's vocabulary


def test_sample_of_a_shard_set_run_decodes_with_its_tokenizer(tiny, bpe_set):
    plan, params = tiny
    cfg = plan.cfg
    shards_plan = types.SimpleNamespace(
        cfg=Config(model=cfg.model, data=DataConfig(source="shards", path=bpe_set, seq_len=cfg.data.seq_len)),
        global_mdef=plan.global_mdef,
        compute_dtype=plan.compute_dtype,
    )
    text = sample_text(shards_plan, params, prompt="def ", num_tokens=5, seed=1)
    tok = run_tokenizer(shards_plan.cfg.data)
    assert text.startswith("def ") and text == tok.decode(tok.encode(text))


def test_a_model_above_the_size_limit_is_not_gathered(tiny, monkeypatch):
    plan, params = tiny
    monkeypatch.setattr(jax, "device_get", lambda *a: pytest.fail("parameters were gathered"))
    with pytest.raises(SamplingUnavailable, match=r"parameters; sampling gathers them onto every host.*limit of 1,000"):
        sample_text(plan, params, prompt="def ", num_tokens=2, seed=0, max_params=1000)


def test_sample_hook_says_why_and_skips(tiny):
    plan, params = tiny
    logged = []
    result = TrainResult({}, None, None, 0.0, 0, None, 0, sample="", state={"params": params})

    def run(data):
        p = types.SimpleNamespace(cfg=Config(model=plan.cfg.model, data=data), mdef=plan.mdef)
        return types.SimpleNamespace(plan=p, log=logged.append)

    SampleHook(4).on_end(run(DataConfig(source="tokens", path="x")), result)
    assert result.sample == "" and logged[-1].startswith("sample: skipped (data.source=tokens records no tokenizer")
    SampleHook(4, max_params=10).on_end(run(plan.cfg.data), result)
    assert result.sample == "" and "above the limit of 10" in logged[-1]


def test_logged_samples_escape_control_characters():
    """An early model's sample can hold any byte: the log shows escape and NUL bytes and line separators as
    escapes, keeps newlines, tabs and printable text."""
    from jaxpar.training.hooks.reporting import printable

    assert printable("def f(x):\n\treturn x\x1b[2J\x00\u2028é") == "def f(x):\n\treturn x\\x1b[2J\\x00\\u2028é"
