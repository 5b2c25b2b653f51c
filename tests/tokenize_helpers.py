"""Small tokenizers and a small corpus built locally for the tokenize tests (no network): a byte-level BPE trained
with `tokenizers`, a SentencePiece BPE trained without normalisation, and tiktoken ranks files written by hand."""

from __future__ import annotations

import base64
import json
import os
import sysconfig

STDLIB_FILES = ("abc.py", "bisect.py", "colorsys.py", "fnmatch.py", "keyword.py", "this.py")
EXTRA_DOCS = {
    "unicode.txt": "héllo wörld ✓ 你好 🙂\n\ttabs  and  double  spaces\n",
    "special.txt": "a literal </s> and <s> and <|endoftext|> inside a document\n",
    "empty.txt": "",
}
# A tiktoken ranks file: the 256 single bytes, then merges whose halves come first (BPE needs every merge's
# halves ranked before it).
TIKTOKEN_MERGES = (b"th", b"the", b"in", b"  ", b"    ", b"re", b"er", b"on", b"de", b"def", b"se", b"lf")


def stdlib_path(name: str) -> str:
    return os.path.join(sysconfig.get_paths()["stdlib"], name)


def write_corpus(root: str) -> list[tuple[str, str]]:
    """Writes text/ (one file per document), docs.jsonl (field "text", one line per document, same order, plus
    a blank line) and docs.parquet (column "text") under `root`. Returns [(name, text)] in reading order (sorted
    names), the empty document included."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = {name: open(stdlib_path(name), encoding="utf-8").read() for name in STDLIB_FILES}
    docs.update(EXTRA_DOCS)
    ordered = sorted(docs.items())
    os.makedirs(os.path.join(root, "text"))
    for name, text in ordered:
        with open(os.path.join(root, "text", name), "w", encoding="utf-8", newline="") as f:
            f.write(text)
    with open(os.path.join(root, "docs.jsonl"), "w", encoding="utf-8") as f:
        for i, (name, text) in enumerate(ordered):
            f.write(json.dumps({"name": name, "text": text}) + "\n")
            if i == 2:
                f.write("\n")
    table = pa.table({"name": [n for n, _ in ordered], "text": [t for _, t in ordered]})
    pq.write_table(table, os.path.join(root, "docs.parquet"), row_group_size=4)
    return ordered


def train_hf_bpe(path: str) -> str:
    """A byte-level BPE of 500 ids (BOS <s> = 0, EOS </s> = 1) trained on a few stdlib files; returns `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([stdlib_path(n) for n in STDLIB_FILES], trainer)
    tok.save(path)
    return path


def train_sentencepiece(prefix: str) -> str:
    """A SentencePiece BPE of 400 pieces without normalisation and with byte fallback (lossless); returns the
    .model path."""
    import sentencepiece as spm

    text = "".join(open(stdlib_path(n), encoding="utf-8").read() for n in STDLIB_FILES)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()),
        model_prefix=prefix,
        vocab_size=400,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    return prefix + ".model"


def write_tiktoken_ranks(path: str, last_rank: int | None = None) -> str:
    """256 byte ranks then `TIKTOKEN_MERGES`; `last_rank` moves the last merge to that rank (a sparse, larger
    vocabulary). Returns `path`."""
    ranks = {bytes([b]): b for b in range(256)}
    for merge in TIKTOKEN_MERGES:
        ranks[merge] = len(ranks)
    if last_rank is not None:
        ranks[TIKTOKEN_MERGES[-1]] = last_rank
    with open(path, "wb") as f:
        for token, rank in ranks.items():
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
    return path
