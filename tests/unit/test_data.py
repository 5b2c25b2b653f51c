"""Data pipeline: tokenizer, sources, packing, sharded loader, unigram entropy (8 simulated CPU devices)."""

import json
import math
import os
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError, DataConfig
from jaxpar.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    ByteTokenizer,
    DataLoader,
    EvalLoader,
    build_loaders,
    load_tokens,
    pack,
    unigram_entropy,
)
from jaxpar.data.batch import BATCH_DTYPES, BATCH_KEYS
from jaxpar.data.loader import _process_rows

# --- tokenizer ---------------------------------------------------------------------------------------------


def test_tokenizer_round_trips_non_ascii():
    tok = ByteTokenizer()
    text = "héllo, wörld — 日本語 🙂"
    ids = tok.encode(text)
    assert ids.dtype == np.uint16
    assert len(ids) == len(text.encode("utf-8")) > len(text)
    assert tok.decode(ids) == text
    assert tok.decode(np.concatenate([[BOS_ID], ids, [EOS_ID, PAD_ID]])) == text
    assert tok.vocab_size == 259


# --- packing -----------------------------------------------------------------------------------------------


def test_pack_shifts_targets_and_masks_padding():
    stream = np.arange(10, dtype=np.uint16)  # 9 targets, T=4 -> 3 sequences, the last with 1 real target
    out = pack(stream, 4)
    assert out["inputs"].shape == out["targets"].shape == out["loss_mask"].shape == (3, 4)
    assert out["inputs"].dtype == np.int32 and out["loss_mask"].dtype == np.float32
    np.testing.assert_array_equal(out["inputs"][:2], [[0, 1, 2, 3], [4, 5, 6, 7]])
    np.testing.assert_array_equal(out["targets"][:2], [[1, 2, 3, 4], [5, 6, 7, 8]])
    np.testing.assert_array_equal(out["inputs"][2], [8, 9, PAD_ID, PAD_ID])  # 9 is read, never predicted from
    np.testing.assert_array_equal(out["targets"][2], [9, PAD_ID, PAD_ID, PAD_ID])
    np.testing.assert_array_equal(out["loss_mask"], [[1] * 4, [1] * 4, [1, 0, 0, 0]])
    exact = pack(np.arange(9), 4)  # 8 targets fill two sequences exactly: no padding
    assert exact["inputs"].shape == (2, 4) and exact["loss_mask"].all()


# --- sources -----------------------------------------------------------------------------------------------


def _docs(tokens: np.ndarray) -> list[bytes]:
    """Splits a BOS ... EOS stream back into document bytes."""
    docs, cur = [], None
    for t in tokens.tolist():
        if t == BOS_ID:
            cur = []
        elif t == EOS_ID:
            docs.append(bytes(cur))
        else:
            cur.append(t)
    return docs


def _write_texts(root, n=12):
    texts = {f"sub{i % 3}/doc{i}.txt": f"document {i} ü " * (i + 1) for i in range(n)}
    for rel, text in texts.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return {t.encode("utf-8") for t in texts.values()}


def _check_split(train, val, expected_docs):
    assert train.dtype == val.dtype == np.uint16
    train_docs, val_docs = _docs(train), _docs(val)
    assert train_docs and val_docs
    assert not set(train_docs) & set(val_docs)
    assert sorted(train_docs + val_docs) == sorted(expected_docs)


def test_text_directory_splits_by_file(tmp_path):
    expected = _write_texts(tmp_path)
    cfg = DataConfig(source="text", path=str(tmp_path), validation_fraction=0.25)
    train, val = load_tokens(cfg)
    _check_split(train, val, list(expected))
    again = load_tokens(cfg)
    np.testing.assert_array_equal(again[0], train)  # deterministic


def test_text_glob(tmp_path):
    expected = _write_texts(tmp_path)
    (tmp_path / "sub0" / "skip.md").write_text("not matched")
    train, val = load_tokens(DataConfig(source="text", path=str(tmp_path / "**" / "*.txt")))
    _check_split(train, val, list(expected))
    with pytest.raises(ConfigError, match="data.path"):
        load_tokens(DataConfig(source="text", path=str(tmp_path / "*.nothing")))


def test_jsonl_and_missing_field(tmp_path):
    rows = [{"text": f"row {i} ß", "id": i} for i in range(20)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:10]) + "\n\n")
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows[10:]))
    train, val = load_tokens(DataConfig(source="jsonl", path=str(tmp_path / "*.jsonl")))
    _check_split(train, val, [r["text"].encode("utf-8") for r in rows])
    with pytest.raises(ConfigError, match="data.text_field='body'"):
        load_tokens(DataConfig(source="jsonl", path=str(tmp_path / "a.jsonl"), text_field="body"))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_split_by_fraction(tmp_path, dtype):
    ids = (np.arange(1000) * 7919 % 70000).astype(dtype)
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    train, val = load_tokens(DataConfig(source="tokens", path=str(path), token_dtype=dtype, validation_fraction=0.1))
    assert train.dtype == val.dtype == np.dtype(dtype)
    assert (len(train), len(val)) == (900, 100)
    np.testing.assert_array_equal(np.concatenate([train, val]), ids)


def test_token_file_errors(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ConfigError, match="not a multiple of 2"):
        load_tokens(DataConfig(source="tokens", path=str(odd)))
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError, match="holds 0 tokens"):
        load_tokens(DataConfig(source="tokens", path=str(empty)))


def test_empty_text_corpus_raises(tmp_path):
    (tmp_path / "a.txt").write_text("")
    with pytest.raises(ConfigError, match="no non-empty document"):
        load_tokens(DataConfig(source="text", path=str(tmp_path)))


def test_stdlib_capped():
    train, val = load_tokens(DataConfig(source="stdlib", max_bytes=200_000, validation_fraction=0.2))
    train_docs, val_docs = _docs(train), _docs(val)
    assert train_docs and val_docs
    future = (Path(sysconfig.get_paths()["stdlib"]) / "__future__.py").read_bytes()  # first file in sorted order
    assert (future in train_docs) != (future in val_docs)  # (the stdlib has a few byte-identical files)
    total = sum(map(len, train_docs + val_docs))
    assert 200_000 <= total < 200_000 + max(map(len, train_docs + val_docs))  # stops at the first file past cap


# --- loader ------------------------------------------------------------------------------------------------

N, T, G = 37, 4, 8


@pytest.fixture(scope="module")
def sharding():
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    return NamedSharding(mesh, P(("data", "fsdp"), None))


def _id_packed(n=N):
    """Sequence i is all i, so a batch row names its sample."""
    ids = np.repeat(np.arange(n, dtype=np.int32)[:, None], T, axis=1)
    return {"inputs": ids, "targets": ids + 1, "loss_mask": np.ones((n, T), np.float32)}


def _ids(batch):
    inputs = np.asarray(batch["inputs"])
    assert (inputs == inputs[:, :1]).all()
    np.testing.assert_array_equal(np.asarray(batch["targets"]), inputs + 1)  # rows of one sample stay together
    return inputs[:, 0].tolist()


def test_loader_batches_are_sharded_and_distinct(sharding, need_devices):
    need_devices(8, exactly=True)
    loader = DataLoader(_id_packed(), G, sharding, seed=0)
    batch = loader.next_batch()
    for k in BATCH_KEYS:
        assert batch[k].shape == (G, T) and batch[k].sharding == sharding and batch[k].dtype == BATCH_DTYPES[k]
        assert {s.data.shape for s in batch[k].addressable_shards} == {(G // 8, T)}
    assert len(set(_ids(batch))) == G


def test_loader_epoch_covers_each_sample_once_and_reshuffles(sharding):
    loader = DataLoader(_id_packed(), G, sharding, seed=1)
    epochs = [[i for _ in range(loader.batches_per_epoch) for i in _ids(loader.next_batch())] for _ in range(2)]
    for seen in epochs:
        assert len(seen) == len(set(seen)) == (N // G) * G  # each sample at most once; remainder dropped
        assert set(seen) <= set(range(N))
    assert epochs[0] != epochs[1]
    assert epochs[0] != sorted(epochs[0])  # shuffled


def test_loader_resume_and_determinism(sharding):
    a = DataLoader(_id_packed(), G, sharding, seed=5)
    first = [_ids(a.next_batch()) for _ in range(6)]  # crosses an epoch boundary (4 batches per epoch)
    state = json.loads(json.dumps(a.get_state()))
    expected = _ids(a.next_batch())
    b = DataLoader(_id_packed(), G, sharding, seed=5)
    assert [_ids(b.next_batch()) for _ in range(6)] == first
    c = DataLoader(_id_packed(), G, sharding, seed=5)
    c.set_state(state)
    assert _ids(c.next_batch()) == expected
    other_seed = DataLoader(_id_packed(), G, sharding, seed=6)
    assert _ids(other_seed.next_batch()) != first[0]


def test_loader_unshuffled_and_too_small(sharding):
    val = DataLoader(_id_packed(), G, sharding, seed=0, shuffle=False)
    assert _ids(val.next_batch()) == list(range(G))
    with pytest.raises(ConfigError, match=r"has 5 sequences.*train.global_batch_size=8"):
        DataLoader(_id_packed(5), G, sharding, seed=0)


def _eval_rows(loader):
    """One pass of an EvalLoader: (ids of the real rows in order, padding rows per batch); checks that a row
    is either a whole sequence with its mask or padding with mask 0."""
    ids, pads = [], []
    for batch in loader.batches():
        inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
        mask = np.asarray(batch["loss_mask"])
        assert inputs.shape == (G, T) and batch["inputs"].sharding == loader._sharding
        pad = inputs[:, 0] == PAD_ID
        assert (inputs[pad] == PAD_ID).all() and (targets[pad] == PAD_ID).all() and (mask[pad] == 0).all()
        assert (mask[~pad] == 1).all()
        ids += _ids({"inputs": inputs[~pad], "targets": targets[~pad]})
        pads.append(int(pad.sum()))
    return ids, pads


def test_eval_loader_scores_every_sequence_once_and_pads_the_last_batch(sharding):
    """37 sequences, G = 8: 5 batches, the last with 5 sequences and 3 masked padding rows; DataLoader would
    drop those 5 (and repeat)."""
    whole = EvalLoader(_id_packed(), G, sharding)
    assert (whole.num_scored, whole.num_batches, whole.num_tokens) == (N, 5, N * T)
    ids, pads = _eval_rows(whole)
    assert ids == list(range(N)) and pads == [0, 0, 0, 0, 5 * G - N]
    assert _eval_rows(whole) == (ids, pads)  # every pass is the same pass: the loader keeps no position


def test_eval_batches_caps_and_never_cycles(sharding):
    first_two = EvalLoader(_id_packed(), G, sharding, max_batches=2)
    assert _eval_rows(first_two) == (list(range(2 * G)), [0, 0]) and first_two.num_tokens == 2 * G * T
    more_than_the_split = EvalLoader(_id_packed(), G, sharding, max_batches=10)
    assert more_than_the_split.num_batches == 5
    assert _eval_rows(more_than_the_split) == _eval_rows(EvalLoader(_id_packed(), G, sharding))
    small = EvalLoader(_id_packed(5), G, sharding)  # fewer sequences than one batch: still scored, padded
    assert _eval_rows(small) == (list(range(5)), [G - 5])
    with pytest.raises(ConfigError, match="no sequence"):
        EvalLoader(_id_packed(0), G, sharding)


class _FakeSharding:
    """A process whose 4 devices hold batch rows [4:6] twice and [0:2] twice (replicated over another axis)."""

    def addressable_devices_indices_map(self, shape):
        rows = [slice(4, 6), slice(0, 2), slice(4, 6), slice(0, 2)]
        return {d: (r, slice(None)) for d, r in enumerate(rows)}


def test_process_rows_dedupes_and_orders_blocks():
    np.testing.assert_array_equal(_process_rows(_FakeSharding(), (8, T)), [0, 1, 4, 5])


_TWO_PROCESS_WORKER = """
import os, sys
os.environ["JAX_NUM_CPU_DEVICES"] = "4"
import jax, numpy as np
jax.distributed.initialize(f"localhost:{sys.argv[2]}", num_processes=2, process_id=int(sys.argv[1]))
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxpar.data import DataLoader
devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))).reshape(2, 4)
mesh = Mesh(devices, ("data", "fsdp"))  # process p holds mesh row data=p
ids = np.repeat(np.arange(37, dtype=np.int32)[:, None], 3, axis=1)
packed = {"inputs": ids, "targets": ids + 1, "loss_mask": np.ones(ids.shape, np.float32)}
# the replicated loader's local data is the whole global batch: the reference order
ref = DataLoader(packed, 8, NamedSharding(mesh, P()), seed=3)
want = [np.asarray(ref.next_batch()["inputs"].addressable_shards[0].data)[:, 0] for _ in range(6)]
for spec in [P(("data", "fsdp"), None), P(("fsdp", "data"), None), P("fsdp", None)]:
    loader = DataLoader(packed, 8, NamedSharding(mesh, spec), seed=3)
    for step in range(6):
        batch = loader.next_batch()["inputs"]
        for shard in batch.addressable_shards:
            got = np.asarray(shard.data)[:, 0]
            assert (got == want[step][shard.index[0]]).all(), (spec, step, got)
print("ok")
"""


def test_loader_two_processes_read_their_own_rows(tmp_path):
    """Two jax processes x 4 CPU devices; process 0's rows are non-contiguous under P(("fsdp", "data"))."""
    script = tmp_path / "worker.py"
    script.write_text(_TWO_PROCESS_WORKER)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=root)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and out.strip().endswith("ok"), out[-3000:]


def test_build_loaders_on_text(tmp_path, sharding):
    _write_texts(tmp_path, n=40)
    cfg = DataConfig(source="text", path=str(tmp_path), seq_len=16, validation_fraction=0.3)
    train, val, info = build_loaders(cfg, 8, sharding)
    assert info.train_sequences == train.num_sequences >= 8
    assert info.train_tokens > 0 and info.val_tokens > 0 and info.val_unigram_entropy > 0
    batch = next(val.batches())
    assert batch["inputs"].shape == (8, 16)
    first = np.asarray(batch["inputs"])[0]
    assert first[0] == BOS_ID  # validation is unshuffled: row 0 starts the first held-out document


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path, sharding):
    path = tmp_path / "tokens.bin"
    (np.arange(4000) % 300).astype(np.uint16).tofile(path)  # ids up to 299
    cfg = DataConfig(source="tokens", path=str(path), token_dtype="uint16", seq_len=16, validation_fraction=0.2)
    with pytest.raises(ConfigError, match=r"token id 299, but model.vocab_size=264 .*at least 300"):
        build_loaders(cfg, 8, sharding, vocab_size=264)
    train, _, _ = build_loaders(cfg, 8, sharding, vocab_size=300)
    assert train.num_sequences >= 8


def test_out_of_vocabulary_fix_is_a_multiple_of_mesh_tensor(tmp_path, sharding):
    """The size suggested holds every id and divides evenly over mesh.tensor (301 would not over 2)."""
    path = tmp_path / "tokens.bin"
    (np.arange(4000) % 301).astype(np.uint16).tofile(path)  # ids up to 300
    cfg = DataConfig(source="tokens", path=str(path), token_dtype="uint16", seq_len=16, validation_fraction=0.2)
    with pytest.raises(ConfigError, match=r"at least 302 \(ids up to 300, a multiple of mesh.tensor=2\)"):
        build_loaders(cfg, 8, sharding, vocab_size=264, vocab_multiple=2)
    with pytest.raises(ConfigError, match=r"at least 304 "):
        build_loaders(cfg, 8, sharding, vocab_size=264, vocab_multiple=8)
    with pytest.raises(ConfigError, match=r"at least 301 \(ids up to 300\)"):
        build_loaders(cfg, 8, sharding, vocab_size=264)


# --- stats -------------------------------------------------------------------------------------------------


def test_unigram_entropy_uniform_is_log_k():
    for k in (1, 2, 7, 259):
        stream = np.tile(np.arange(k), 50)
        assert unigram_entropy(stream) == pytest.approx(math.log(k), abs=1e-12)
    mask = np.array([1, 1, 0, 0])
    assert unigram_entropy(np.array([3, 4, 9, 9]), mask) == pytest.approx(math.log(2))
