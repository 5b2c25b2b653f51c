"""Each family's tokenizer.json through jaxpar's hf backend and the tokenize command, on tiny fixtures shaped like
the published files (tests/fixtures/make_tokenizer_fixtures.py states what each copies): documents are framed
with the family's BOS / EOS as the tokenizer's own post-processor states them (Qwen: no BOS), never with two
BOS, and the conflicts between a user's choice, the post-processor and tokenizer_config.json are warned about."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil

import numpy as np
import pytest

from jaxpar.cli import data as data_cli
from jaxpar.data.errors import DataError
from jaxpar.data.shards import ShardSet
from jaxpar.data.text_tokenizer import load_tokenizer, parse_tokenizer_spec
from jaxpar.data.tokenize_corpus import TokenizeOptions, tokenize_corpus
from jaxpar.log import LOGGER

tokenizers = pytest.importorskip("tokenizers", reason="the data extra (tokenizers) is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "tokenizers")
# family -> (BOS, EOS) that jaxpar frames a document with: the published models' conventions.
CONVENTIONS = {
    "qwen2_5": (None, "<|endoftext|>"),
    "qwen3": (None, "<|endoftext|>"),  # its tokenizer_config.json names <|im_end|>, which ends a chat turn
    "llama3": ("<|begin_of_text|>", "<|end_of_text|>"),
    "mistral": ("<s>", "</s>"),  # Mixtral ships the same tokenizer
    "gemma2": ("<bos>", "<eos>"),
}
# Documents that spell every family's BOS as text: it must stay text (never a second BOS id).
DOCUMENTS = (
    "The fox said <s>, <bos> and <|begin_of_text|> (text, not tokens).\nCaf\u00e9 \U0001f642 ends here.",
    "def tokenize(text):\n    return text.split()  # 42 tokens per second\n",
)


def _dir(family: str) -> str:
    return os.path.join(FIXTURES, family)


def _reference(family: str):
    """The tokenizer itself, encoding special-token strings in a text as text (as jaxpar does)."""
    tok = tokenizers.Tokenizer.from_file(os.path.join(_dir(family), "tokenizer.json"))
    tok.encode_special_tokens = True
    return tok


def _ids(family: str) -> tuple[int | None, int]:
    ref, (bos, eos) = _reference(family), CONVENTIONS[family]
    return (None if bos is None else ref.token_to_id(bos)), ref.token_to_id(eos)


@contextlib.contextmanager
def _warnings():
    """The warnings jaxpar.data logs inside the block (a handler of its own: a command run earlier in this
    process may have stopped the "jaxpar" logger from propagating to pytest's)."""
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("jaxpar.data")
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)


@pytest.fixture
def corpus(tmp_path):
    """A directory of the two `DOCUMENTS`, one file each (read in name order)."""
    root = tmp_path / "text"
    root.mkdir()
    for i, text in enumerate(DOCUMENTS):
        (root / f"{i}.txt").write_text(text, encoding="utf-8")
    return str(root)


def _documents(out) -> list[list[int]]:
    s = ShardSet(str(out))
    return [s.document(k).tolist() for k in range(s.num_documents)]


def test_fixtures_are_what_the_script_makes():
    spec = importlib.util.spec_from_file_location(
        "make_tokenizer_fixtures", os.path.join(ROOT, "tests", "fixtures", "make_tokenizer_fixtures.py")
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    made = script.fixture_files()
    assert sorted(made) == sorted(f"{f}/{n}" for f in CONVENTIONS for n in ("tokenizer.json", "tokenizer_config.json"))
    for rel, text in made.items():
        with open(os.path.join(FIXTURES, rel), encoding="utf-8") as f:
            assert f.read() == text, f"{rel} differs: run tests/fixtures/make_tokenizer_fixtures.py"


@pytest.mark.parametrize("family", list(CONVENTIONS))
def test_the_post_processor_adds_the_family_bos_and_no_eos(family):
    """The fixtures' own post-processors, checked directly: what encode(add_special_tokens=True) adds."""
    ref, (bos, eos) = _reference(family), _ids(family)
    for text in DOCUMENTS:
        plain = ref.encode(text, add_special_tokens=False).ids
        assert ref.encode(text, add_special_tokens=True).ids == ([] if bos is None else [bos]) + plain
        assert eos not in plain and (bos is None or bos not in plain)


@pytest.mark.parametrize("family", list(CONVENTIONS))
@pytest.mark.parametrize("with_config", [True, False], ids=["with_config", "tokenizer_json_alone"])
def test_the_backend_picks_the_family_bos_and_eos(family, with_config, tmp_path):
    source = _dir(family)
    if not with_config:  # the convention must not hang on tokenizer_config.json: the post-processor states it
        source = str(tmp_path / "alone.json")
        shutil.copy(os.path.join(_dir(family), "tokenizer.json"), source)
    tok = load_tokenizer(parse_tokenizer_spec(source))
    assert (tok.bos_id, tok.eos_id) == _ids(family)
    ref = _reference(family)
    for text in DOCUMENTS:
        assert tok.encode(text).tolist() == ref.encode(text, add_special_tokens=False).ids
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("family", list(CONVENTIONS))
def test_a_tokenized_document_is_the_post_processor_output_then_eos(family, corpus, tmp_path):
    """[BOS] + text + [EOS] for Llama 3, Mistral, Gemma, text + [EOS] for Qwen: what the tokenizer's own
    post-processor gives, plus jaxpar's EOS; exactly one BOS, at the start."""
    result = tokenize_corpus(TokenizeOptions((corpus,), str(tmp_path / "out"), _dir(family), workers=1, progress=False))
    ref, (bos, eos) = _reference(family), _ids(family)
    assert (result.manifest["add_bos"], result.manifest["add_eos"]) == (bos is not None, True)
    docs = _documents(tmp_path / "out")
    assert docs == [ref.encode(text, add_special_tokens=True).ids + [eos] for text in DOCUMENTS]
    special = {i for i, t in ref.get_added_tokens_decoder().items() if t.special}
    for doc in docs:  # the only special ids: one BOS first (none for Qwen), one EOS last
        framing = [(k, i) for k, i in enumerate(doc) if i in special]
        assert framing == ([] if bos is None else [(0, bos)]) + [(len(doc) - 1, eos)]


def test_a_bos_token_given_for_qwen_is_used_once_with_a_warning(corpus, tmp_path):
    """Qwen has no BOS; a user may still open documents with one (their choice), and then there is exactly one."""
    endoftext = _reference("qwen2_5").token_to_id("<|endoftext|>")
    with _warnings() as warned:
        tokenize_corpus(
            TokenizeOptions(
                (corpus,), str(tmp_path / "out"), _dir("qwen2_5"), workers=1, progress=False, bos_token="<|endoftext|>"
            )
        )
    assert any("own post-processor opens a text with no token" in w for w in warned), warned
    for doc, text in zip(_documents(tmp_path / "out"), DOCUMENTS):
        plain = _reference("qwen2_5").encode(text, add_special_tokens=False).ids
        assert doc == [endoftext, *plain, endoftext]


def test_the_bos_the_post_processor_adds_named_again_is_not_doubled(corpus, tmp_path):
    with _warnings() as warned:
        tokenize_corpus(
            TokenizeOptions(
                (corpus,), str(tmp_path / "out"), _dir("mistral"), workers=1, progress=False, bos_token="<s>"
            )
        )
    assert warned == []
    assert [doc[:2].count(1) for doc in _documents(tmp_path / "out")] == [1, 1]


def _with_config(tmp_path, family: str, **config) -> str:
    """A copy of a fixture's tokenizer.json beside a tokenizer_config.json holding `config`."""
    shutil.copy(os.path.join(_dir(family), "tokenizer.json"), tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize(
    "family, config, bos, message",
    [
        ("mistral", {"add_bos_token": False, "bos_token": "<s>"}, "<s>", "sets add_bos_token false, but"),
        (
            "gemma2",
            {"bos_token": "<eos>"},
            "<bos>",
            "names BOS '<eos>', but tokenizer.json's post-processor opens a text with",
        ),
        ("qwen2_5", {"add_bos_token": True, "bos_token": "<|endoftext|>"}, None, "documents open with no BOS"),
    ],
    ids=["add_bos_false", "other_bos", "qwen_asked_for_bos"],
)
def test_a_config_that_contradicts_the_post_processor_is_warned_about(tmp_path, family, config, bos, message):
    with _warnings() as warned:
        tok = load_tokenizer(parse_tokenizer_spec(_with_config(tmp_path, family, **config)))
    assert tok.bos_id == (None if bos is None else _reference(family).token_to_id(bos))
    assert any(message in w for w in warned), warned


def test_an_instruct_eos_gives_way_to_the_end_of_text(tmp_path):
    """Qwen3's tokenizer_config.json names <|im_end|>; documents are separated by <|endoftext|>, unless asked."""
    ref = _reference("qwen3")
    with _warnings() as warned:
        tok = load_tokenizer(parse_tokenizer_spec(_dir("qwen3")))
    assert tok.eos_id == ref.token_to_id("<|endoftext|>")
    assert any("names EOS '<|im_end|>', the end of a chat turn" in w for w in warned), warned
    with _warnings() as warned:
        tok = load_tokenizer(parse_tokenizer_spec(_dir("qwen3"), eos_token="<|im_end|>"))
    assert tok.eos_id == ref.token_to_id("<|im_end|>") and warned == []
    llama = _with_config(tmp_path, "llama3", bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    assert load_tokenizer(parse_tokenizer_spec(llama)).eos_id == _ids("llama3")[1]


def test_several_tokens_before_a_text_need_a_named_bos(tmp_path):
    doc = json.load(open(os.path.join(_dir("mistral"), "tokenizer.json"), encoding="utf-8"))
    post = doc["post_processor"]
    post["single"].insert(1, {"SpecialToken": {"id": "</s>", "type_id": 0}})
    post["special_tokens"]["</s>"] = {"id": "</s>", "ids": [2], "tokens": ["</s>"]}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(DataError, match=r"puts 2 tokens \('<s>', '</s>'\) before a text.*--bos-token"):
        load_tokenizer(parse_tokenizer_spec(str(path)))
    assert load_tokenizer(parse_tokenizer_spec(str(path), bos_token="<s>")).bos_id == 1


@pytest.fixture
def restored_logger():
    """The "jaxpar" logger's handlers, level and propagation, put back after the test (the command sets them)."""
    saved = (list(LOGGER.handlers), LOGGER.level, LOGGER.propagate, getattr(LOGGER, "_jaxpar_configured", False))
    yield
    LOGGER.handlers[:], LOGGER.level, LOGGER.propagate = saved[0], saved[1], saved[2]
    LOGGER._jaxpar_configured = saved[3]  # type: ignore[attr-defined]


@pytest.mark.parametrize("family", ["qwen3", "mistral"], ids=["byte_level_bpe", "sentencepiece_bpe"])
def test_the_tokenize_command_runs_on_each_structure(family, corpus, tmp_path, capsys, restored_logger):
    out = str(tmp_path / "out")
    argv = ["tokenize", corpus, "--tokenizer", _dir(family), "--out", out, "--workers", "1", "--no-progress"]
    assert data_cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "wrote 1 shards (2 documents" in printed
    assert ("the end of a chat turn" in printed) == (family == "qwen3")
    ref, (bos, eos) = _reference(family), _ids(family)
    want = [ref.encode(text, add_special_tokens=True).ids + [eos] for text in DOCUMENTS]
    assert _documents(out) == want
    assert ShardSet(out).token_dtype == np.uint16
    manifest = json.load(open(os.path.join(out, "manifest.json"), encoding="utf-8"))
    assert (manifest["tokenizer"]["bos_id"], manifest["tokenizer"]["eos_id"]) == (bos, eos)
