"""`data.source: synthetic`: the rows are the module docstring's definition (re-derived here token by token, and a
few ids pinned, so a numpy that changed its PCG64 or SeedSequence streams is caught), ids lie below the
vocabulary, every scored target is one of its input's k successors, documents are numbered and masked as packed
text's are, the loader resumes exactly and reads only its own rows, and the config check refuses what makes no
sense with it. Shape letters: T sequence length, G global batch size, V vocabulary."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError, load_config
from jaxpar.config.schema import DataConfig
from jaxpar.data import build_loaders
from jaxpar.data.loader import _process_rows
from jaxpar.data.synthetic import SEQUENCES, synthetic_splits

T, G, V = 16, 8, 264
TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "configs", "tiny.yaml")


@pytest.fixture(scope="module")
def sharding():
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    return NamedSharding(mesh, P(("data", "fsdp"), None))


def _by_definition(seed: int, k: int, masking: bool, row: int) -> tuple[list[int], list[bool]]:
    """Window tokens [T + 1] and document openings of corpus row `row`, one token at a time as the definition
    says."""

    def raw(entropy, n):
        return [int(u) for u in np.random.PCG64(np.random.SeedSequence(entropy)).random_raw(n)]

    base = [u % V for u in raw([seed, 0, 0], V)]
    u = raw([seed, 1, row], 2 * (T + 1))
    tokens, opens = [], []
    for t in range(T + 1):
        b, x = u[t], u[T + 1 + t]
        opens.append(t == 0 or (masking and b % max(T // 4, 2) == 0))
        tokens.append(x % V if opens[-1] or k == 0 else (base[tokens[-1]] + x % k) % V)
    return tokens, opens


@pytest.mark.parametrize("k,masking", [(4, True), (0, False)])
def test_rows_follow_the_definition_and_stay_put(k, masking):
    cfg = DataConfig(source="synthetic", seq_len=T, seed=3, synthetic_branching=k, document_masking=masking)
    train, val = synthetic_splits(cfg, V)
    assert (train.num_sequences, val.num_sequences) == (SEQUENCES - 52_429, 52_429)  # 5% of 2**20 rows
    rows = {**train.rows(np.array([5, 0])), "val": val.rows(np.array([1]))["inputs"]}
    for r, row in enumerate((5, 0)):
        tokens, opens = _by_definition(3, k, masking, row)
        assert rows["inputs"][r].tolist() == tokens[:T] and rows["targets"][r].tolist() == tokens[1:]
        assert rows["loss_mask"][r].tolist() == [0.0 if o else 1.0 for o in opens[1:]]
        if masking:
            assert rows["segment_ids"][r].tolist() == np.cumsum(opens[:T]).tolist()
    assert rows["val"][0].tolist() == _by_definition(3, k, masking, train.num_sequences + 1)[0][:T]
    assert ("segment_ids" in rows) == masking and (rows["loss_mask"] == 1).all() != masking
    pinned = {4: [19, 245, 219, 46, 251, 128, 98, 223], 0: [19, 245, 219, 46, 251, 102, 30, 130]}  # row 5
    assert rows["inputs"][0][:8].tolist() == pinned[k]
    again, _ = synthetic_splits(cfg, V)
    np.testing.assert_array_equal(again.rows(np.array([5]))["inputs"], rows["inputs"][:1])


def test_ids_lie_below_the_vocabulary_and_follow_the_chain():
    train, _ = synthetic_splits(DataConfig(source="synthetic", seq_len=128), V)
    rows = train.rows(np.arange(64))
    assert rows["inputs"].min() >= 0 and rows["inputs"].max() < V and rows["inputs"].dtype == np.int32
    scored = rows["loss_mask"] > 0
    step = (rows["targets"][scored] - train._base[rows["inputs"][scored]].astype(np.int64)) % V
    assert step.max() == 3 and np.bincount(step).min() > 0.2 * step.size  # each of the 4 successors, about evenly
    segments = rows["segment_ids"]
    new_document = np.diff(segments, axis=1) == 1  # input position p opens a document: target p - 1 is not scored
    assert (new_document == (rows["loss_mask"][:, :-1] == 0)).all() and (np.diff(segments, axis=1) >= 0).all()
    assert 4 < segments.max(axis=1).mean() < 6  # about 5 documents per row


def test_the_loader_resumes_exactly_and_reads_only_its_own_rows(sharding, monkeypatch):
    cfg = DataConfig(source="synthetic", seq_len=T, seed=1)
    train, val, info = build_loaders(cfg, G, sharding, vocab_size=V, eval_batches=2)
    assert info.train_sequences == SEQUENCES - 52_429 and info.val_scored_sequences == 2 * G
    asked = []
    real = train._rows.rows
    monkeypatch.setattr(train._rows, "rows", lambda ids: asked.append(list(ids)) or real(ids))
    batches, states, local = [], [], _process_rows(sharding, (G, T))
    for _ in range(4):
        start = train.get_state()["next_sample"]
        batches.append(np.asarray(train.next_batch()["inputs"]))
        assert asked[-1] == train.sample_ids(start, local).tolist() == list(range(start, start + G))  # row order
        states.append(json.loads(json.dumps(train.get_state())))
    resumed = build_loaders(cfg, G, sharding, vocab_size=V)[0]
    resumed.set_state(states[1])
    for want in batches[2:]:
        np.testing.assert_array_equal(np.asarray(resumed.next_batch()["inputs"]), want)
    assert resumed.get_state() == states[-1] == {"next_sample": 4 * G}


def test_the_config_check_takes_it_and_refuses_what_makes_no_sense(sharding):
    from jaxpar.training.sample import SamplingUnavailable, run_tokenizer

    cfg = load_config(TINY, ["data.source=synthetic", "train.steps=2"], num_devices=8)
    assert (cfg.data.source, cfg.data.synthetic_branching, cfg.data.max_bytes) == ("synthetic", 4, 8_000_000)
    load_config(TINY, ["data.source=synthetic", "model.vocab_size=32"], num_devices=8)  # no byte vocabulary
    for more, match in (
        (["data.path=corpus.txt"], r"data.path='corpus.txt' does not apply to data.source=synthetic.*drop data.path"),
        (["data.synthetic_branching=264"], r"data.synthetic_branching=264 must lie in \[0, model.vocab_size=264\)"),
        (["data.sources=[{name: a, source: synthetic}]", "data.path=x"], r"data.sources\[0\].path='x'.*path: ''"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config(TINY, ["data.source=synthetic", *more], num_devices=8)
    with pytest.raises(ConfigError, match="give the model's vocab_size"):
        build_loaders(DataConfig(source="synthetic"), G, sharding)
    with pytest.raises(SamplingUnavailable, match="synthetic ids stand for no text"):
        run_tokenizer(cfg.data)
