"""Training on a shard set (`data.source: shards`) with a BPE tokenizer: the run trains, samples text decoded
with the set's tokenizer, and a run stopped at a checkpoint resumes with the losses of an uninterrupted one."""

from __future__ import annotations

import os

import pytest
from tokenize_helpers import STDLIB_FILES, stdlib_path, train_hf_bpe

from jaxpar.config import load_config
from jaxpar.data.tokenize_corpus import TokenizeOptions, tokenize_corpus
from jaxpar.training.loop import train

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "configs", "tiny.yaml")


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_shards")
    bpe = train_hf_bpe(str(root / "tokenizer.json"))
    inputs = tuple(stdlib_path(n) for n in STDLIB_FILES)
    tokenize_corpus(TokenizeOptions(inputs, str(root / "set"), bpe, shard_tokens=4000, workers=1, progress=False))
    return str(root / "set")


def _cfg(shard_set, run_dir, steps: int, sample_tokens: int = 0):
    return load_config(
        CONFIG,
        [
            "model.n_layers=1",
            "model.vocab_size=500",
            "data.source=shards",
            f"data.path={shard_set}",
            "data.seq_len=32",
            "data.validation_fraction=0.2",
            "train.global_batch_size=8",
            "train.eval_batches=1",
            "train.progress_bar=false",
            f"train.sample_tokens={sample_tokens}",
            "train.eval_every=0",
            "train.log_every=1",
            f"train.steps={steps}",
            "optimizer.decay=constant",
            "optimizer.warmup_steps=0",
            "checkpoint.every_steps=2",
            "checkpoint.async_save=false",
            f"train.run_dir={run_dir}",
        ],
    )


@pytest.mark.slow
def test_training_on_a_shard_set_samples_with_its_tokenizer_and_resumes_exactly(shard_set, tmp_path):
    """Slow: three training runs (about 35 s on 2 cores); the loader's own resume and the sample's tokenizer are
    tested quickly in tests/unit/test_stream.py and tests/unit/test_sample_tokenizer.py."""
    from jaxpar.training.sample import run_tokenizer

    whole = train(_cfg(shard_set, tmp_path / "whole", 4, sample_tokens=8))
    first = train(_cfg(shard_set, tmp_path / "split", 2))
    rest = train(_cfg(shard_set, tmp_path / "split", 4))
    assert sorted(whole.losses) == [1, 2, 3, 4] and rest.start_step == 2 and sorted(rest.losses) == [3, 4]
    assert [first.losses[s] for s in (1, 2)] == [whole.losses[s] for s in (1, 2)]
    assert [rest.losses[s] for s in (3, 4)] == [whole.losses[s] for s in (3, 4)]  # the resumed data position
    assert 0 < whole.val_tokens <= 8 * 32 and whole.val_loss is not None
    tok = run_tokenizer(_cfg(shard_set, tmp_path, 1).data)
    assert whole.sample.startswith("def ") and tok.decode(tok.encode(whole.sample)) == whole.sample
