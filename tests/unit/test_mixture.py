"""`data.sources` mixtures: the loader serves each source's rows in its planned share from its own Grain stream and
resumes exactly from a JSON state (each process reading only its rows: tests/system/test_mixture_processes.py);
two shard sets build a mixture whose per-source validation equals each source evaluated alone; bad mixtures are
refused with the fix. Shape letters: N sequences, T sequence length, G global batch size."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tokenize_helpers import STDLIB_FILES, stdlib_path, train_hf_bpe

from jaxpar.config import ConfigError, load_config
from jaxpar.config.data_sources import source_configs
from jaxpar.config.schema import DataConfig, DataSourceConfig
from jaxpar.data import MixtureLoader, PackedRows, build_loaders
from jaxpar.data.loader import SampleOrder
from jaxpar.data.mixture import source_seed
from jaxpar.data.shards import read_manifest
from jaxpar.data.tokenize_corpus import TokenizeOptions, tokenize_corpus
from jaxpar.training.hooks import evaluate, evaluate_sources

T, G = 16, 8


@pytest.fixture(scope="module")
def sharding():
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    return NamedSharding(mesh, P(("data", "fsdp"), None))


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """Byte shard sets "web" (the first three stdlib files) and "code" (the last three), and a BPE set."""
    root = tmp_path_factory.mktemp("mix")
    out = {}
    for name, files, tok in (
        ("web", STDLIB_FILES[:3], "byte"),
        ("code", STDLIB_FILES[3:], "byte"),
        ("bpe", STDLIB_FILES[:3], train_hf_bpe(str(root / "tokenizer.json"))),
    ):
        opts = TokenizeOptions(
            inputs=tuple(stdlib_path(n) for n in files), out=str(root / name), tokenizer=tok, workers=1, progress=False
        )
        tokenize_corpus(opts)
        out[name] = str(root / name)
    return out


def _rows(first: int, n: int) -> PackedRows:
    """n rows of T tokens; row i holds first + i everywhere, so a served row names its source and sequence."""
    values = np.repeat(np.arange(first, first + n, dtype=np.int32)[:, None], T, axis=1)
    return PackedRows({"inputs": values, "targets": values, "loss_mask": np.ones((n, T), np.float32)})


def test_rows_come_from_each_source_in_its_share_and_its_own_stream(sharding):
    sources = {"a": _rows(0, 50), "b": _rows(1000, 7)}  # b's 7 sequences span several epochs
    loader = MixtureLoader(sources, {"a": 0.75, "b": 0.25}, G, sharding, seed=3)
    orders = {"a": SampleOrder(50, source_seed(3, 0)), "b": SampleOrder(7, source_seed(3, 1))}
    seen = {"a": [], "b": []}
    for _ in range(20):
        counts, source, _ = loader.plan()
        rows = np.asarray(loader.next_batch()["inputs"])[:, 0]
        from_b = rows >= 1000
        assert from_b.tolist() == (source == 1).tolist() and from_b.sum() == counts[1] == 2
        seen["a"] += rows[~from_b].tolist()
        seen["b"] += (rows[from_b] - 1000).tolist()
    for name in ("a", "b"):  # each source's rows are consecutive positions of its own shuffled stream
        assert seen[name] == orders[name].ids(range(len(seen[name]))).tolist()
    assert loader.get_state() == {"taken": {"a": 120, "b": 40}}  # shares 0.75 and 0.25


def test_resume_from_the_json_state_serves_the_same_batches(sharding):
    def make():
        return MixtureLoader({"web": _rows(0, 30), "code": _rows(500, 20)}, {"web": 2, "code": 1}, G, sharding, seed=0)

    first = make()
    batches, states = [], []
    for _ in range(12):
        batches.append(np.asarray(first.next_batch()["inputs"]))
        states.append(first.get_state())
    resumed = make()
    resumed.set_state(json.loads(json.dumps(states[4], sort_keys=True)))  # a store may reorder the names
    for want in batches[5:]:
        np.testing.assert_array_equal(np.asarray(resumed.next_batch()["inputs"]), want)
    assert resumed.get_state() == first.get_state()
    earlier = make()  # a state saved by an earlier jaxpar also holds the batch index
    earlier.set_state({"next_batch": 5, **states[4]})
    np.testing.assert_array_equal(np.asarray(earlier.next_batch()["inputs"]), batches[5])
    for bad in (
        {"next_sample": 8},
        {"taken": {"web": 16}},
        {"taken": {"web": 9, "code": -1}},
    ):
        with pytest.raises(ValueError, match="data loader state"):
            make().set_state(bad)


def test_resuming_with_another_global_batch_size_continues_each_source_stream(sharding):
    """8 rows per batch, resumed at 16: every source goes on at the next position of its own stream, and the
    shares stay within one row of 0.7 / 0.3 of all rows served."""
    sources = {"web": _rows(0, 30), "code": _rows(500, 20)}
    weights = {"web": 0.7, "code": 0.3}
    small = MixtureLoader(sources, weights, G, sharding, seed=1)
    served = [np.asarray(small.next_batch()["inputs"])[:, 0] for _ in range(5)]
    big = MixtureLoader(sources, weights, 2 * G, sharding, seed=1)
    big.set_state(json.loads(json.dumps(small.get_state())))
    served += [np.asarray(big.next_batch()["inputs"])[:, 0] for _ in range(3)]
    rows = np.concatenate(served)
    orders = {"web": SampleOrder(30, source_seed(1, 0)), "code": SampleOrder(20, source_seed(1, 1))}
    for name, first, got in (("web", 0, rows[rows < 500]), ("code", 500, rows[rows >= 500])):
        assert (got - first).tolist() == orders[name].ids(range(got.size)).tolist()
    assert big.get_state() == {"taken": {"web": 62, "code": 26}}  # 88 rows: 61.6 and 26.4


def test_shard_mixture_validates_each_source_as_it_would_alone(sets, sharding):
    entries = (
        DataSourceConfig(name="web", weight=0.7, path=sets["web"]),
        DataSourceConfig(name="code", weight=0.3, path=sets["code"], validation_fraction=0.3),
    )
    cfg = DataConfig(source="shards", seq_len=T, validation_fraction=0.2, sources=entries)
    train, val, info = build_loaders(cfg, G, sharding, vocab_size=264, eval_batches=2)
    assert isinstance(train, MixtureLoader) and set(info.sources) == {"web", "code"}
    assert info.sources["web"].weight == pytest.approx(0.7) and "segment_ids" in train.next_batch()
    assert info.val_scored_tokens == sum(s.val_scored_tokens for s in info.sources.values())

    def eval_step(params, batch):  # a stand-in loss: mean target id (any function of the rows would do)
        mask = np.asarray(batch["loss_mask"])
        return float((np.asarray(batch["targets"]) * mask).sum()), float(mask.sum())

    overall, tokens, by_source = evaluate_sources(eval_step, None, val)
    alone = {}
    for name, _, single in source_configs(cfg):
        _, single_val, single_info = build_loaders(single, G, sharding, vocab_size=264, eval_batches=2)
        alone[name] = evaluate(eval_step, None, single_val)
        assert single_info.val_scored_tokens == info.sources[name].val_scored_tokens
    assert by_source == {name: loss for name, (loss, _) in alone.items()}
    assert tokens == sum(n for _, n in alone.values()) == info.val_scored_tokens
    assert overall == pytest.approx(sum(loss * n for loss, n in alone.values()) / tokens)
    assert overall == pytest.approx(evaluate(eval_step, None, val)[0])  # the whole pass, token-weighted


def test_sources_tokenized_differently_are_refused(sets, sharding):
    entries = (DataSourceConfig(name="web", path=sets["web"]), DataSourceConfig(name="bpe", path=sets["bpe"]))
    cfg = DataConfig(source="shards", seq_len=T, sources=entries)
    with pytest.raises(ConfigError, match="'web' and 'bpe' were tokenized differently.*vocab_size"):
        build_loaders(cfg, G, sharding, vocab_size=512)
    small = DataConfig(source="shards", seq_len=T, sources=entries[1:])
    with pytest.raises(ConfigError, match=r"data.sources\[0\] \(bpe\): .*model.vocab_size=256"):
        build_loaders(small, G, sharding, vocab_size=256)
    text = DataConfig(source="stdlib", seq_len=T, max_bytes=50_000, sources=(entries[0], DataSourceConfig(name="std")))
    assert build_loaders(text, G, sharding, vocab_size=264)[2].sources["std"].train_tokens > 0  # both bytes


def _mixture(sources: str, *more: str):
    return load_config(None, [f"data.sources={sources}", *more], num_devices=8)


def test_config_from_yaml_list_and_command_line(tmp_path):
    path = tmp_path / "mix.yaml"
    path.write_text(
        "data:\n  source: shards\n  sources:\n"
        "    - {name: web, weight: 0.7, path: runs/data/web}\n"
        "    - {name: code, weight: 0.3, path: runs/data/code, validation_fraction: 0.1}\n"
    )
    cfg = load_config(str(path), num_devices=8)
    resolved = source_configs(cfg.data)
    assert [(n, round(w, 6), d.source, d.path, d.validation_fraction) for n, w, d in resolved] == [
        ("web", 0.7, "shards", "runs/data/web", 0.05),
        ("code", 0.3, "shards", "runs/data/code", 0.1),
    ]
    assert all(not d.sources for _, _, d in resolved)
    again = load_config(cfg.to_dict(), num_devices=8)  # a checkpoint's saved config
    assert again == cfg and isinstance(cfg.to_dict()["data"]["sources"], list)
    cli = _mixture("[{name: web, weight: 7, source: shards, path: a}, {name: code, weight: 3, source: stdlib}]")
    assert [round(w, 6) for _, w, _ in source_configs(cli.data)] == [0.7, 0.3]


@pytest.mark.parametrize(
    "sources,more,match",
    [
        ("[{name: a, weight: 0}, {name: b}]", [], r"data.sources\[0\].weight=0.0 must be a finite number > 0"),
        ("[{name: a, weight: -1}]", [], r"weight=-1.0 must be a finite number > 0"),
        ("[{name: a, weight: .nan}]", [], r"weight=nan must be a finite number > 0"),
        ("[{name: a}, {name: a}]", [], r"data.sources\[1\].name='a' repeats data.sources\[0\].name"),
        ("[{weight: 1}]", [], r"data.sources\[0\].name='': every source needs a name"),
        ("[{name: 'a/b'}]", [], r"name='a/b'"),
        ("[{name: a, source: shards}]", [], r"data.sources\[0\].path is required for data.sources\[0\].source=shards"),
        ("[{name: a, source: web}]", [], r"data.sources\[0\].source='web' is not one of"),
        ("[{name: a, mix: 1}]", [], r"unknown config key data.sources\[0\].mix"),
        ("{name: a}", [], r"data.sources: must be a list of mappings"),
        ("[a, b]", [], r"data.sources\[0\]: must be a mapping"),
        ("[{name: a, source: tokens, path: x.bin}, {name: b}]", [], "mixes a `tokens` source"),
        ("[{name: a, validation_fraction: 1.5}]", [], r"data.sources\[0\].validation_fraction=1.5"),
    ],
)
def test_bad_mixtures_are_refused(sources, more, match):
    with pytest.raises(ConfigError, match=match):
        _mixture(sources, *more)


def test_a_tokens_source_may_join_a_mixture_without_document_masking():
    cfg = _mixture("[{name: a, source: tokens, path: x.bin}, {name: b}]", "data.document_masking=false")
    assert [d.source for _, _, d in source_configs(cfg.data)] == ["tokens", "stdlib"]


def test_resuming_with_other_sources_or_weights_is_refused(tmp_path):
    from jaxpar.config import save_config
    from jaxpar.config.resume import check_resume_config

    cfg = _mixture("[{name: a, weight: 0.7}, {name: b, weight: 0.3}]", f"train.run_dir={tmp_path}")
    save_config(cfg, str(tmp_path / "config.yaml"))
    assert check_resume_config(str(tmp_path), cfg) == {}  # the saved mixture reads back equal
    other = _mixture("[{name: a, weight: 0.6}, {name: b, weight: 0.4}]", f"train.run_dir={tmp_path}")
    with pytest.raises(ConfigError, match="was trained on other data.*data.sources"):
        check_resume_config(str(tmp_path), other)


def test_the_sample_decodes_with_the_sources_tokenizer(sets):
    from jaxpar.training.sample import run_tokenizer

    entries = (DataSourceConfig(name="bpe", path=sets["bpe"]), DataSourceConfig(name="more", path=sets["bpe"]))
    tok = run_tokenizer(DataConfig(source="shards", sources=entries))
    assert tok.vocab_size == read_manifest(sets["bpe"])["tokenizer"]["vocab_size"] != 259
    assert tok.decode(tok.encode("def f(x):")) == "def f(x):"
