"""Offline tokenization (`jaxpar-data tokenize`): the four tokenizers, the shard format, determinism over worker
counts, resume, and the errors. Tokenizers are built locally (tests/tokenize_helpers.py); nothing downloads."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tokenize_helpers import (
    EXTRA_DOCS,
    train_hf_bpe,
    train_sentencepiece,
    write_corpus,
    write_tiktoken_ranks,
)

from jaxpar.cli import data as data_cli
from jaxpar.data import shards, tokenize_corpus
from jaxpar.data.errors import DataError
from jaxpar.data.shards import ShardSet, token_dtype_for
from jaxpar.data.text_tokenizer import load_tokenizer, parse_tokenizer_spec, tokenizer_from_manifest
from jaxpar.data.tokenize_corpus import TokenizeOptions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARD_TOKENS = 4000  # the corpus is ~25k byte tokens: several shards, and abc.py (6.5k) alone exceeds one


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """{"corpus": [(name, text)], "root", and a tokenizer spec per kind}."""
    root = tmp_path_factory.mktemp("tokenize")
    out = {"corpus": write_corpus(str(root)), "root": str(root)}
    out["hf"] = train_hf_bpe(str(root / "tokenizer.json"))
    out["sentencepiece"] = train_sentencepiece(str(root / "sp"))
    out["tiktoken"] = write_tiktoken_ranks(str(root / "ranks.tiktoken"))
    return out


SPECS = {
    "byte": lambda e: {"tokenizer": "byte"},
    "hf": lambda e: {"tokenizer": e["hf"]},
    "sentencepiece": lambda e: {"tokenizer": e["sentencepiece"]},
    "tiktoken": lambda e: {"tokenizer": e["tiktoken"], "tiktoken_pattern": "cl100k_base"},
}


def _tokenize(env, out, inputs=None, **kw) -> tokenize_corpus.TokenizeResult:
    kw.setdefault("tokenizer", "byte")
    kw.setdefault("shard_tokens", SHARD_TOKENS)
    kw.setdefault("workers", 1)
    inputs = inputs or [os.path.join(env["root"], "text")]
    return tokenize_corpus.tokenize_corpus(TokenizeOptions(inputs=tuple(inputs), out=str(out), progress=False, **kw))


def _files(directory) -> dict[str, str]:
    """SHA-256 of every file of a shard set but the lock (the manifest included)."""
    out = {}
    for d, _, names in os.walk(directory):
        for n in names:
            if n != ".lock":
                path = os.path.join(d, n)
                out[os.path.relpath(path, directory)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def _tokenizer(env, kind):
    s = SPECS[kind](env)
    return load_tokenizer(parse_tokenizer_spec(s["tokenizer"], s.get("tiktoken_pattern")))


# --- tokenizers ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(SPECS))
def test_round_trip_of_each_tokenizer(env, kind):
    tok = _tokenizer(env, kind)
    for _, text in env["corpus"]:
        ids = tok.encode(text)
        assert ids.ndim == 1 and (ids.size == 0 or (ids.min() >= 0 and ids.max() < tok.vocab_size))
        assert tok.decode(ids) == text
    if kind != "byte":
        assert len(tok.encode(env["corpus"][0][1])) < len(env["corpus"][0][1].encode())  # it merges bytes


@pytest.mark.parametrize("kind", list(SPECS))
def test_special_token_text_in_a_document_is_text(env, kind):
    """A document that spells "</s>" or "<|endoftext|>" does not get the EOS id (no injected boundaries)."""
    tok = _tokenizer(env, kind)
    ids = tok.encode(EXTRA_DOCS["special.txt"])
    assert tok.eos_id is not None and tok.eos_id not in ids.tolist()
    assert tok.bos_id is None or tok.bos_id not in ids.tolist()


def test_special_ids_of_each_tokenizer(env):
    assert [(_tokenizer(env, k).bos_id, _tokenizer(env, k).eos_id) for k in SPECS] == [
        (257, 258),
        (0, 1),  # <s>, </s> by their common names
        (1, 2),  # the SentencePiece model's own
        (None, 256 + 12),  # <|endoftext|> after the last rank of a ranks file that is not a published one
    ]
    hf = load_tokenizer(parse_tokenizer_spec(env["hf"], bos_token="</s>", eos_token="<s>"))
    assert (hf.bos_id, hf.eos_id) == (1, 0)


def test_tokenizer_kind_follows_from_the_name(env):
    assert parse_tokenizer_spec(env["hf"]).kind == "hf"
    assert parse_tokenizer_spec(env["root"]).kind == "hf"  # the directory holding tokenizer.json
    assert parse_tokenizer_spec(env["sentencepiece"]).kind == "sentencepiece"
    assert parse_tokenizer_spec(env["tiktoken"], "gpt2").kind == "tiktoken"
    assert parse_tokenizer_spec("hf:" + env["hf"]).path == env["hf"]


# --- shards --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(SPECS))
def test_shards_hold_the_direct_encoding(env, kind, tmp_path):
    res = _tokenize(env, tmp_path / "out", **SPECS[kind](env))
    tok = _tokenizer(env, kind)
    m = res.manifest
    docs = [text for _, text in env["corpus"] if text]
    want = [np.concatenate([[tok.bos_id] * m["add_bos"], tok.encode(t), [tok.eos_id] * m["add_eos"]]) for t in docs]
    assert m["add_eos"] and m["add_bos"] == (kind != "tiktoken")
    s = ShardSet(str(tmp_path / "out"))
    assert s.num_documents == len(docs) == m["documents"] and m["empty_documents"] == 1
    assert s.num_tokens == sum(len(w) for w in want) == m["tokens"] == res.tokens_written
    assert s.token_dtype == np.uint16 and m["token_dtype"] == "uint16"
    assert [s.document(k).tolist() for k in range(len(docs))] == [w.tolist() for w in want]
    assert s.num_shards > 2
    for i, entry in enumerate(m["shards"]):
        tokens = np.load(s.directory + "/" + entry["tokens_file"], mmap_mode="r", allow_pickle=False)
        offsets = np.load(s.directory + "/" + entry["offsets_file"], mmap_mode="r", allow_pickle=False)
        assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16 and offsets.dtype == np.int64
        assert (
            offsets[0] == 0 and offsets[-1] == len(tokens) == entry["tokens"] and len(offsets) == entry["documents"] + 1
        )
        assert np.all(np.diff(offsets) > 0)
        assert entry["tokens"] <= SHARD_TOKENS or entry["documents"] == 1  # only a single longer document exceeds
        if i + 1 < len(m["shards"]):  # a shard ends because the next document did not fit
            nxt = int(np.load(s.directory + "/" + m["shards"][i + 1]["offsets_file"])[1])
            assert entry["tokens"] + nxt > SHARD_TOKENS
        for key in ("tokens", "offsets"):
            digest = hashlib.sha256(open(s.directory + "/" + entry[f"{key}_file"], "rb").read()).hexdigest()
            assert digest == entry[f"{key}_sha256"]
    s.verify()
    rebuilt = tokenizer_from_manifest(s.directory, s.manifest)  # from the set's own copy of the tokenizer file
    assert [rebuilt.decode(s.document(k)) for k in range(len(docs))] == docs
    assert (rebuilt.bos_id, rebuilt.eos_id, rebuilt.vocab_size) == (tok.bos_id, tok.eos_id, tok.vocab_size)


def test_manifest_records_tokenizer_and_input(env, tmp_path):
    m = _tokenize(env, tmp_path / "out", tokenizer=env["hf"]).manifest
    t = m["tokenizer"]
    assert t["kind"] == "hf" and t["source_path"] == env["hf"] and t["file"] == "tokenizer/tokenizer.json"
    assert t["sha256"] == hashlib.sha256(open(env["hf"], "rb").read()).hexdigest()
    assert (t["vocab_size"], t["bos_id"], t["eos_id"]) == (500, 0, 1)
    assert m["format"] == "jaxpar-token-shards" and m["format_version"] == 1 and m["complete"]
    names = [n for n, _ in env["corpus"]]
    assert [f["path"] for f in m["input"]["files"]] == names
    assert [f["bytes"] for f in m["input"]["files"]] == [len(t.encode()) for _, t in env["corpus"]]
    assert m["input"]["format"] == "text" and m["input"]["root"] == os.path.join(env["root"], "text")
    assert json.load(open(tmp_path / "out" / "manifest.json")) == m


def test_jsonl_and_parquet_give_the_text_files_shards(env, tmp_path):
    """The same documents as text files, JSONL lines (a blank line among them) and Parquet rows (row groups of 4)
    give the same shard files."""
    digests = []
    for name, inputs in (("text", ["text"]), ("jsonl", ["docs.jsonl"]), ("parquet", ["docs.parquet"])):
        res = _tokenize(env, tmp_path / name, [os.path.join(env["root"], p) for p in inputs], tokenizer=env["hf"])
        assert res.manifest["input"]["format"] == name
        assert res.manifest["input"]["field"] == (None if name == "text" else "text")
        digests.append([(e["tokens_sha256"], e["offsets_sha256"], e["documents"]) for e in res.manifest["shards"]])
    assert digests[0] == digests[1] == digests[2]


def test_invalid_utf8_is_replaced_and_counted(env, tmp_path, caplog):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_bytes(b"ok \xff\xfe bytes")
    (tmp_path / "in" / "b.txt").write_bytes(b"fine")
    with caplog.at_level("WARNING", logger="jaxpar.data"):
        m = _tokenize(env, tmp_path / "out", [str(tmp_path / "in")]).manifest
    assert m["invalid_utf8_documents"] == 1 and m["documents"] == 2
    assert "1 of 2 documents were not valid UTF-8" in caplog.text
    assert ShardSet(str(tmp_path / "out")).document(0)[1:-1].tolist() == list("ok \ufffd\ufffd bytes".encode())


def test_vocabulary_above_65536_ids_is_stored_as_uint32(env, tmp_path):
    ranks = write_tiktoken_ranks(str(tmp_path / "big.tiktoken"), last_rank=70_000)
    res = _tokenize(env, tmp_path / "out", tokenizer=ranks, tiktoken_pattern="gpt2")
    assert res.manifest["tokenizer"]["vocab_size"] == 70_002 and res.manifest["token_dtype"] == "uint32"
    s = ShardSet(str(tmp_path / "out"))
    assert s.tokens(0).dtype == np.uint32 and 70_000 in np.concatenate([s.tokens(i) for i in range(s.num_shards)])
    with pytest.raises(DataError, match="does not fit --token-dtype uint16"):
        _tokenize(env, tmp_path / "out16", tokenizer=ranks, tiktoken_pattern="gpt2", token_dtype="uint16")
    assert token_dtype_for(65_536) == np.uint16 and token_dtype_for(65_537) == np.uint32


def test_bos_and_eos_can_be_left_out(env, tmp_path):
    m = _tokenize(env, tmp_path / "out", add_bos=False, add_eos=False).manifest
    docs = [t for _, t in env["corpus"] if t]
    assert not m["add_bos"] and not m["add_eos"] and m["tokens"] == sum(len(t.encode()) for t in docs)


# --- determinism and resume ----------------------------------------------------------------------------------


def test_same_bytes_with_one_or_two_workers(env, tmp_path):
    one = _tokenize(env, tmp_path / "w1", tokenizer=env["hf"], workers=1)
    two = _tokenize(env, tmp_path / "w2", tokenizer=env["hf"], workers=2)
    assert one.manifest == two.manifest
    assert _files(tmp_path / "w1") == _files(tmp_path / "w2")  # manifest, shards and tokenizer copy, byte for byte


def test_resume_after_a_failure_continues_and_gives_the_same_bytes(env, tmp_path, monkeypatch):
    whole = _tokenize(env, tmp_path / "whole", tokenizer=env["sentencepiece"])
    n = len(whole.manifest["shards"])
    real, calls, armed = tokenize_corpus._write_shard, [], [True]

    def failing(directory, index, *args):
        calls.append(index)
        if armed[0] and len(calls) == 3:
            with open(os.path.join(directory, shards.shard_names(index)[0] + shards.PARTIAL), "wb") as f:
                f.write(b"half a shard")  # an interrupted write leaves its partial file behind
            raise RuntimeError("injected failure")
        return real(directory, index, *args)

    monkeypatch.setattr(tokenize_corpus, "_write_shard", failing)
    with pytest.raises(RuntimeError, match="injected"):
        _tokenize(env, tmp_path / "cut", tokenizer=env["sentencepiece"])
    cut = json.load(open(tmp_path / "cut" / "manifest.json"))
    assert not cut["complete"] and len(cut["shards"]) == 2
    with pytest.raises(DataError, match="unfinished"):
        ShardSet(str(tmp_path / "cut"))
    calls.clear()
    armed[0] = False
    res = _tokenize(env, tmp_path / "cut", tokenizer=env["sentencepiece"])
    assert calls == list(range(2, n)) and res.shards_kept == 2 and res.shards_written == n - 2  # continued
    assert _files(tmp_path / "cut") == _files(tmp_path / "whole")


def test_rerunning_a_finished_set_does_nothing(env, tmp_path):
    first = _tokenize(env, tmp_path / "out")
    before = {p: os.stat(os.path.join(tmp_path, "out", p)).st_mtime_ns for p in _files(tmp_path / "out")}
    again = _tokenize(env, tmp_path / "out")
    assert again.shards_written == 0 and again.shards_kept == len(first.manifest["shards"])
    assert again.manifest == first.manifest
    assert {p: os.stat(os.path.join(tmp_path, "out", p)).st_mtime_ns for p in before} == before


def test_a_damaged_shard_is_made_again(env, tmp_path):
    first = _tokenize(env, tmp_path / "out")
    good = _files(tmp_path / "out")
    victim = tmp_path / "out" / first.manifest["shards"][2]["tokens_file"]
    victim.write_bytes(victim.read_bytes()[:-2] + b"xx")
    with pytest.raises(DataError, match="shard 2 .* differs from its checksum"):
        ShardSet(str(tmp_path / "out")).verify()
    res = _tokenize(env, tmp_path / "out")
    assert res.shards_kept == 2 and _files(tmp_path / "out") == good


def test_another_tokenizer_input_or_option_into_the_same_directory_is_refused(env, tmp_path):
    _tokenize(env, tmp_path / "out")
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "x.txt").write_text("more text")
    for kw, what in (
        ({"tokenizer": env["hf"]}, "tokenizer.kind"),
        ({"inputs": [os.path.join(env["root"], "text"), str(tmp_path / "more")]}, "input.files"),
        ({"shard_tokens": 5000}, "shard_tokens"),
        ({"add_eos": False}, "add_eos"),
    ):
        with pytest.raises(DataError, match=f"another tokenizer, input or options .*{what}"):
            _tokenize(env, tmp_path / "out", **kw)
    assert ShardSet(str(tmp_path / "out")).manifest["tokenizer"]["kind"] == "byte"  # untouched


# --- errors, before any work ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case, match",
    [
        ({"inputs": ["/no/such/dir"]}, "input '/no/such/dir' matches no file"),
        ({"tokenizer": "gpt9:x.json"}, "unknown tokenizer kind 'gpt9'"),
        ({"tokenizer": "/no/such/tokenizer.json"}, "no such file"),
        ({"tokenizer": "byte", "bos_token": "<s>"}, "special tokens are fixed"),
        ({"tokenizer": "TIKTOKEN"}, "split pattern is unknown; name the encoding"),
        ({"tokenizer": "TIKTOKEN", "tiktoken_pattern": "cl200k"}, "'cl200k' is not a known encoding"),
        ({"tokenizer": "TIKTOKEN", "tiktoken_pattern": "gpt2", "add_bos": True}, "has no BOS token"),
        ({"tokenizer": "HF", "eos_token": "<eot>"}, "'<eot>' is not a token"),
        ({"inputs": ["docs.jsonl"], "field": "content"}, r"docs.jsonl line 1 has no field 'content' \(found"),
        ({"inputs": ["docs.parquet"], "field": "content"}, "docs.parquet has no column 'content'"),
        ({"inputs": ["docs.parquet"], "field": "name", "format": "jsonl"}, "line 1 is not JSON"),
        ({"inputs": ["docs.jsonl", "text"]}, "mix file types"),
        ({"shard_tokens": 0}, "at least 1"),
        ({"workers": 0}, "at least 1"),
    ],
)
def test_bad_input_is_refused_before_any_work(env, tmp_path, case, match):
    case = dict(case)
    names = {"TIKTOKEN": env["tiktoken"], "HF": env["hf"]}
    case["tokenizer"] = names.get(case.get("tokenizer"), case.get("tokenizer", "byte"))
    inputs = [p if os.path.isabs(p) else os.path.join(env["root"], p) for p in case.pop("inputs", ["text"])]
    with pytest.raises(DataError, match=match):
        _tokenize(env, tmp_path / "out", inputs, **case)
    assert not (tmp_path / "out").exists()


def test_a_later_jsonl_line_without_the_field_names_its_line_and_keeps_finished_shards(env, tmp_path):
    n = tokenize_corpus.CHUNK_DOCUMENTS + 10  # the bad line is in the second chunk handed to the tokenizer
    lines = [json.dumps({"text": f"document {i} " * 40}) for i in range(n)] + [json.dumps({"txt": "oops"})]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"bad.jsonl line {n + 1} has no field 'text' \(found \['txt'\]\)"):
        _tokenize(env, tmp_path / "out", [str(tmp_path / "bad.jsonl")])
    assert len(json.load(open(tmp_path / "out" / "manifest.json"))["shards"]) >= 1


def test_a_null_parquet_cell_is_named(env, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match="n.parquet row 1 has no text"):
        _tokenize(env, tmp_path / "out", [str(tmp_path / "n.parquet")])


def test_output_directory_that_is_not_a_shard_set_is_refused(env, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="not a jaxpar token shard set .*notes.txt"):
        _tokenize(env, tmp_path / "out")
    assert os.listdir(tmp_path / "out") == ["notes.txt"]  # nothing added
    with pytest.raises(DataError, match=r"--out .*notes.txt/sub' cannot be created: .*notes.txt is a file, not a dir"):
        _tokenize(env, tmp_path / "out" / "notes.txt" / "sub")


def test_a_changed_tokenizer_copy_is_refused(env, tmp_path):
    _tokenize(env, tmp_path / "out", tokenizer=env["hf"])
    copy = tmp_path / "out" / "tokenizer" / "tokenizer.json"
    copy.write_text(copy.read_text().replace('"</s>"', '"</S>"'))
    with pytest.raises(DataError, match="differs from the tokenizer the shards were made with"):
        tokenizer_from_manifest(str(tmp_path / "out"))


# --- the command -----------------------------------------------------------------------------------------------


def test_command_exit_status_and_messages(env, tmp_path, capsys):
    out = str(tmp_path / "out")
    text = os.path.join(env["root"], "text")
    assert data_cli.main(["tokenize", text, "--tokenizer", "byte", "--out", out, "--no-progress"]) == 0
    assert "documents" in capsys.readouterr().out
    assert data_cli.main(["tokenize", text, "--tokenizer", "nope:x", "--out", out, "--no-progress"]) == 2
    assert "unknown tokenizer kind 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        data_cli.main(["tokenise", text])
    assert e.value.code == 2


def test_the_data_tools_do_not_import_jax():
    """jaxpar-data and its spawned workers start without jax (jaxpar.data's loaders are imported lazily)."""
    code = (
        "import sys\n"
        "import jaxpar.cli.data, jaxpar.data.tokenize_corpus, jaxpar.data.shards, jaxpar.data.tokenizer_backends\n"
        "from jaxpar.data import ByteTokenizer\n"
        "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}
    ).stdout
    assert out.strip() == "[]"
