"""`data.source: shards`: packed rows read lazily from a token shard set equal packing the same documents in RAM,
the loaders serve the same batches as over in-RAM arrays and resume exactly, and bad sets and vocabularies are
refused with the fix. Shape letters: N sequences, T sequence length, G global batch size."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tokenize_helpers import STDLIB_FILES, stdlib_path, train_hf_bpe

from jaxpar.config import ConfigError
from jaxpar.config.schema import DataConfig
from jaxpar.data import DataLoader, EvalLoader, build_loaders, pack
from jaxpar.data import stream as stream_lib
from jaxpar.data.loader import _process_rows
from jaxpar.data.shards import ShardSet, read_manifest, write_json
from jaxpar.data.stream import shard_splits
from jaxpar.data.tokenize_corpus import TokenizeOptions, tokenize_corpus

T, G = 16, 8


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """Shard sets of a few stdlib files in shards of a few thousand tokens (so rows cross shard boundaries): byte
    tokenizer, and a small BPE (tokenizer.json, BOS <s> = 0, EOS </s> = 1)."""
    root = tmp_path_factory.mktemp("shards")
    inputs = tuple(stdlib_path(n) for n in STDLIB_FILES)
    bpe = train_hf_bpe(str(root / "tokenizer.json"))
    out = {}
    for name, tok, shard_tokens in (("byte", "byte", 9000), ("hf", bpe, 3000)):
        opts = TokenizeOptions(
            inputs=inputs, out=str(root / name), tokenizer=tok, shard_tokens=shard_tokens, workers=1, progress=False
        )
        tokenize_corpus(opts)
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module")
def sharding():
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    return NamedSharding(mesh, P(("data", "fsdp"), None))


def _stream(shard_set: ShardSet, start: int, stop: int) -> np.ndarray:
    return np.concatenate([np.asarray(shard_set.document(d)) for d in range(start, stop)])


@pytest.mark.parametrize("kind", ["byte", "hf"])
@pytest.mark.parametrize("masking", [True, False])
def test_streamed_rows_equal_packing_in_ram(sets, kind, masking):
    cfg = DataConfig(source="shards", path=sets[kind], seq_len=T, validation_fraction=0.2, document_masking=masking)
    train, val, shard_set = shard_splits(cfg)
    assert shard_set.num_shards > 2 and train.doc_start == 0 and val.doc_stop == shard_set.num_documents
    assert train.doc_stop == val.doc_start and 1 <= val.doc_start < shard_set.num_documents
    assert val.num_tokens >= 0.2 * shard_set.num_tokens  # whole tail documents holding at least the share
    bos = shard_set.manifest["tokenizer"]["bos_id"]
    assert shard_set.manifest["add_bos"] and bos is not None
    for rows in (train, val):
        want = pack(
            _stream(shard_set, rows.doc_start, rows.doc_stop),
            T,
            pad_id=stream_lib.pad_id_for(shard_set),
            bos_id=bos if masking else None,
        )
        assert rows.keys == tuple(want) and rows.num_sequences == len(want["inputs"])
        order = np.random.default_rng(0).permutation(rows.num_sequences)  # any order, including the padded last row
        got = rows.rows(order)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k][order], err_msg=k)
            assert got[k].dtype == want[k].dtype
    if masking:  # the documents really are kept apart: some row holds two, and a boundary target is masked
        seg = train.rows(np.arange(train.num_sequences))["segment_ids"]
        assert seg.max() >= 2


def test_loaders_serve_the_in_ram_batches_and_resume_exactly(sets, sharding):
    cfg = DataConfig(source="shards", path=sets["byte"], seq_len=T, validation_fraction=0.2, seed=4)
    train, val, shard_set = shard_splits(cfg)
    bos = shard_set.manifest["tokenizer"]["bos_id"]
    packed = pack(_stream(shard_set, 0, train.doc_stop), T, pad_id=stream_lib.pad_id_for(shard_set), bos_id=bos)
    streamed, in_ram = DataLoader(train, G, sharding, seed=4), DataLoader(packed, G, sharding, seed=4)
    assert streamed.num_sequences == in_ram.num_sequences
    n = streamed.batches_per_epoch + 2  # across an epoch boundary
    batches = []
    for _ in range(n):
        a, b = streamed.next_batch(), in_ram.next_batch()
        assert set(a) == set(b) == {"inputs", "targets", "loss_mask", "segment_ids"}
        for k in a:
            assert a[k].sharding == sharding
            np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
        batches.append({k: np.asarray(v) for k, v in a.items()})
    resumed = DataLoader(shard_splits(cfg)[0], G, sharding, seed=4)
    resumed.set_state(json.loads(json.dumps({"next_sample": 3 * G})))
    for want in batches[3:]:
        got = resumed.next_batch()
        for k in want:
            np.testing.assert_array_equal(np.asarray(got[k]), want[k])
    assert resumed.get_state() == streamed.get_state()

    # validation: the same pass as over the packed validation stream, padding rows included
    val_packed = pack(_stream(shard_set, val.doc_start, val.doc_stop), T, pad_id=val.pad_id, bos_id=bos)
    a_pass, b_pass = EvalLoader(val, G, sharding), EvalLoader(val_packed, G, sharding)
    assert a_pass.num_batches == b_pass.num_batches and a_pass.num_tokens == b_pass.num_tokens
    for a, b in zip(a_pass.batches(), b_pass.batches(), strict=True):
        for k in a:
            np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))


def test_a_loader_reads_only_its_own_rows(sets, sharding, monkeypatch):
    """Each batch asks the source for exactly the sample ids of the rows this process's devices hold (here all
    G: one process), never for the whole split."""
    train, _, _ = shard_splits(DataConfig(source="shards", path=sets["byte"], seq_len=T))
    asked = []
    real = train.rows
    monkeypatch.setattr(train, "rows", lambda ids: asked.append(list(ids)) or real(ids))
    loader = DataLoader(train, G, sharding, seed=1)
    local = _process_rows(sharding, (G, T))
    for _ in range(3):
        start = loader.get_state()["next_sample"]
        loader.next_batch()
        assert asked[-1] == loader.sample_ids(start, local).tolist()
    assert len(asked) == 3 and all(len(a) == G for a in asked)


def test_build_loaders_for_shards_and_its_info(sets, sharding):
    cfg = DataConfig(source="shards", path=sets["hf"], seq_len=T, validation_fraction=0.2)
    train_loader, val_loader, info = build_loaders(cfg, G, sharding, vocab_size=512, eval_batches=2)
    assert info.shard_set == sets["hf"] and info.train_sequences == train_loader.num_sequences
    assert info.train_tokens + info.val_tokens == read_manifest(sets["hf"])["tokens"]
    assert info.val_scored_sequences == 2 * G and info.val_scored_tokens == val_loader.num_tokens > 0
    assert 0 < info.val_unigram_entropy < np.log(500)
    assert "segment_ids" in train_loader.next_batch()


def test_second_shard_set_for_validation(sets, tmp_path):
    import shutil

    other = tmp_path / "val"
    shutil.copytree(sets["byte"], other)
    cfg = DataConfig(source="shards", path=sets["byte"], validation_path=str(other), seq_len=T)
    train, val, shard_set = shard_splits(cfg)
    assert (train.doc_start, train.doc_stop) == (0, shard_set.num_documents) == (val.doc_start, val.doc_stop)
    with pytest.raises(ConfigError, match="tokenized differently.*tokenizer"):
        shard_splits(DataConfig(source="shards", path=sets["byte"], validation_path=sets["hf"], seq_len=T))


def test_model_vocabulary_smaller_than_the_tokenizer_is_refused_with_the_size(sets):
    cfg = DataConfig(source="shards", path=sets["hf"], seq_len=T)
    with pytest.raises(ConfigError, match=r"500 ids, but model.vocab_size=259; set model.vocab_size=500"):
        shard_splits(cfg, vocab_size=259)
    with pytest.raises(ConfigError, match=r"model.vocab_size=504 \(at least 500, a multiple of mesh.tensor=8\)"):
        shard_splits(cfg, vocab_size=259, vocab_multiple=8)
    shard_splits(cfg, vocab_size=500)


def test_unfinished_or_missing_set_is_refused(sets, tmp_path):
    import shutil

    with pytest.raises(
        ConfigError, match="does not exist; data.source=shards needs a shard set made by `jaxpar-data tokenize"
    ):
        shard_splits(DataConfig(source="shards", path=str(tmp_path / "nowhere")))
    broken = tmp_path / "unfinished"
    shutil.copytree(sets["byte"], broken)
    manifest = read_manifest(str(broken))
    write_json(os.path.join(broken, "manifest.json"), {**manifest, "complete": False})
    with pytest.raises(ConfigError, match="unfinished shard set.*rerun the same command"):
        shard_splits(DataConfig(source="shards", path=str(broken)))


def test_a_damaged_set_is_refused_before_training_and_bad_ids_when_read(sets, tmp_path):
    """A missing or truncated shard file is named when the set is opened (headers and sizes, no checksums); ids at
    or above the tokenizer's vocabulary, which a checksum-free open cannot see, are refused when a row reads them."""
    import shutil

    cfg = lambda d: DataConfig(source="shards", path=str(d), seq_len=T)  # noqa: E731
    missing, short, bad_ids = (tmp_path / n for n in ("missing", "short", "bad_ids"))
    for d in (missing, short, bad_ids):
        shutil.copytree(sets["byte"], d)
    last = read_manifest(str(missing))["shards"][-1]
    os.remove(missing / last["tokens_file"])
    with pytest.raises(ConfigError, match=r"shard-\d+\.tokens\.npy cannot be read .*re-tokenize"):
        shard_splits(cfg(missing))
    os.truncate(short / last["offsets_file"], os.path.getsize(short / last["offsets_file"]) - 8)
    with pytest.raises(ConfigError, match="shorter than its header says"):
        shard_splits(cfg(short))
    first = read_manifest(str(bad_ids))["shards"][0]
    tokens = np.load(bad_ids / first["tokens_file"])
    tokens[1::2] = 0xFFFF
    np.save(bad_ids / first["tokens_file"], tokens)
    train, _, _ = shard_splits(cfg(bad_ids))  # the files are whole
    with pytest.raises(stream_lib.DataError, match="token id 65535 at or above its tokenizer's 259 ids"):
        train.rows(np.array([0]))


def test_few_open_shards(sets, monkeypatch):
    """With one shard open at a time (each read closes the previous shard), the rows are the same."""
    monkeypatch.setattr(stream_lib, "MAX_OPEN_SHARDS", 1)
    cfg = DataConfig(source="shards", path=sets["byte"], seq_len=T, document_masking=True)
    train, _, shard_set = shard_splits(cfg)
    want = pack(_stream(shard_set, 0, train.doc_stop), T, pad_id=train.pad_id, bos_id=257)
    got = train.rows(np.arange(train.num_sequences))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    assert len(train._shards._open) == 1


def test_an_index_stride_of_one_block_or_many_finds_the_same_documents(sets, monkeypatch):
    cfg = DataConfig(source="shards", path=sets["hf"], seq_len=T)
    want = shard_splits(cfg)[0].rows(np.arange(40))
    for stride in (1, 3):
        monkeypatch.setattr(stream_lib, "INDEX_STRIDE", stride)
        got = shard_splits(cfg)[0].rows(np.arange(40))
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_config_validation_of_the_source():
    from jaxpar.config import Config, validate_config
    from jaxpar.config.schema import ModelConfig

    with pytest.raises(ConfigError, match="data.path is required for data.source=shards.*jaxpar-data tokenize"):
        validate_config(Config(data=DataConfig(source="shards")), num_devices=1)
    with pytest.raises(ConfigError, match="data.validation_path applies to data.source=shards"):
        validate_config(Config(data=DataConfig(source="text", path="x", validation_path="y")), num_devices=1)
    # a tokenizer's vocabulary may be smaller than the byte tokenizer's: checked against the manifest instead
    validate_config(Config(data=DataConfig(source="shards", path="x"), model=ModelConfig(vocab_size=128)), 1)


def test_a_resume_over_a_re_tokenized_shard_set_is_refused_before_any_array_is_restored(
    sets, sharding, tmp_path, monkeypatch, caplog
):
    """The data position records the digest of the set's shard checksums; the same directory holding other shards
    (here: replaced by a set of another tokenizer) is refused by a single source and by a mixture, naming the
    directory; a state without a digest (an earlier jaxpar) resumes with a warning. A run's resume refuses it from
    the latest checkpoint's JSON, before its arrays are restored; a new run seeded by checkpoint.restore_from
    takes the position without the check (its data may differ)."""
    import dataclasses
    import shutil

    from jaxpar.checkpoint.store import Checkpointer
    from jaxpar.config import Config
    from jaxpar.data import MixtureLoader
    from jaxpar.data.shards import shard_set_digest
    from jaxpar.training import start_state

    here = tmp_path / "set"
    shutil.copytree(sets["byte"], here)
    cfg = DataConfig(source="shards", path=str(here), seq_len=T)
    single = DataLoader(shard_splits(cfg)[0], G, sharding, seed=0)
    mixture = MixtureLoader({"web": shard_splits(cfg)[0]}, {"web": 1.0}, G, sharding, seed=0)
    digest = shard_set_digest(read_manifest(str(here)))
    states = [single.get_state(), mixture.get_state()]
    assert states[0] == {"next_sample": 0, "shard_set_sha256": digest}
    assert states[1] == {"taken": {"web": 0}, "shard_set_sha256": {"web": digest}}
    shutil.rmtree(here)
    shutil.copytree(sets["hf"], here)  # re-tokenized into the same directory
    again = shard_splits(cfg)[0]
    fix = rf"data.path='{here}' holds another shard set .* re-tokenized or replaced .*another train.run_dir"
    with pytest.raises(ConfigError, match=fix):
        DataLoader(again, G, sharding, seed=0).set_state(states[0])
    with pytest.raises(ConfigError, match=r"data.sources\[0\] \(web\) path=.* holds another shard set"):
        MixtureLoader({"web": again}, {"web": 1.0}, G, sharding, seed=0).set_state(states[1])
    with caplog.at_level("WARNING", logger="jaxpar.data"):
        DataLoader(again, G, sharding, seed=0).set_state({"next_sample": 8})
    assert "records no shard-set digest" in caplog.text and str(here) in caplog.text

    ckpt = Checkpointer(str(tmp_path / "run" / "checkpoints"), every_steps=1, keep=1, async_save=False)
    ckpt.save(1, {"step": np.int32(1)}, data_state=states[0], config={}, force=True)
    monkeypatch.setattr(start_state, "_restore", lambda *a: pytest.fail("arrays restored before the data check"))
    run = dataclasses.replace(Config(), train=dataclasses.replace(Config().train, run_dir=str(tmp_path / "run")))
    with pytest.raises(ConfigError, match=fix):
        start_state.initial_state(run, None, ckpt, DataLoader(again, G, sharding, seed=0))
    ckpt.close()
    seeded = DataLoader(again, G, sharding, seed=0)  # checkpoint.restore_from seeds a new run: not checked
    monkeypatch.setattr(start_state, "_restore", lambda *a: ({"step": np.int32(0)}, {**states[0], "next_sample": 8}))
    start_state.initial_state(
        dataclasses.replace(run, train=dataclasses.replace(run.train, run_dir=str(tmp_path / "new"))),
        None,
        None,
        seeded,
    )
    assert seeded.get_state() == {"next_sample": 8, "shard_set_sha256": again.shard_set.digest}
