"""One small interface over every tokenizer jaxpar reads, and the spec that names one.

A tokenizer (`TextTokenizer`) encodes one document's text to token ids without special tokens, decodes ids back
to text (special tokens skipped), and states its vocabulary size and its BOS / EOS ids (None when it has none).
Kinds, each from a local file only (nothing here touches the network):

  byte         the built-in UTF-8 byte tokenizer (`jaxpar.data.tokenizer`), no file
  hf           a Hugging Face `tokenizer.json` (the `tokenizers` library), or a directory holding one
  tiktoken     a `.tiktoken` BPE ranks file, with the regex split pattern of a known encoding (`--tiktoken-pattern`)
  sentencepiece  a SentencePiece `.model` file

`parse_tokenizer_spec("hf:path/tokenizer.json")` (or just the path: the kind follows from the file name) gives a
`TokenizerSpec`; `load_tokenizer(spec)` builds the tokenizer; `tokenizer_identity` is what a shard manifest
records, and `tokenizer_from_manifest` rebuilds the same tokenizer from a shard set's own copy of the file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np

from jaxpar.data import tokenizer_backends
from jaxpar.data.errors import DataError
from jaxpar.data.shards import file_sha256, read_manifest
from jaxpar.data.tokenizer_spec import KINDS, TokenizerSpec

_SUFFIX_KIND = {".json": "hf", ".tiktoken": "tiktoken", ".model": "sentencepiece"}


@runtime_checkable
class TextTokenizer(Protocol):
    """What jaxpar needs of a tokenizer.

    Attributes:
      vocab_size: one more than the largest id the tokenizer can emit (the model's embedding rows needed).
      bos_id, eos_id: the ids a document may open / close with, or None when the tokenizer has none.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text`, no special tokens added: a 1-D integer array."""
        ...

    def decode(self, ids) -> str:
        """Text of a 1-D sequence of ids, special tokens skipped."""
        ...


def parse_tokenizer_spec(
    text: str, pattern: str | None = None, bos_token: str | None = None, eos_token: str | None = None
) -> TokenizerSpec:
    """`byte`, `KIND:PATH` (KIND one of `KINDS`) or a PATH whose name says the kind (`.json` or a directory with a
    `tokenizer.json`: hf; `.tiktoken`; `.model`: sentencepiece) -> a `TokenizerSpec` with an absolute path.

    Raises:
      DataError: an unknown kind, a kind that cannot follow from the name, a missing file, or an option that does
        not apply to the kind (a pattern for a non-tiktoken tokenizer, bos/eos tokens for byte or tiktoken).
    """
    text = text.strip()
    kind, path = None, text
    head, sep, tail = text.partition(":")
    if text == "byte":
        kind, path = "byte", ""
    elif sep and head in KINDS:
        kind, path = head, tail
    elif sep and not os.path.exists(text) and "/" not in head and len(head) > 1:
        raise DataError(
            f"unknown tokenizer kind {head!r} in --tokenizer {text!r}; use one of {', '.join(KINDS)} "
            f"(e.g. hf:tokenizer.json), or a path whose name says the kind (.json, .tiktoken, .model)"
        )
    if kind == "byte" and path:
        raise DataError(f"--tokenizer {text!r}: the byte tokenizer takes no file; write --tokenizer byte")
    if kind != "byte":
        path = os.path.abspath(os.path.expanduser(path))
        if os.path.isdir(path):
            inner = os.path.join(path, "tokenizer.json")
            if kind not in (None, "hf") or not os.path.isfile(inner):
                raise DataError(
                    f"--tokenizer {text!r} is a directory without a tokenizer.json; give the tokenizer file itself "
                    f"(tokenizer.json, a .tiktoken ranks file or a SentencePiece .model)"
                )
            kind, path = "hf", inner
        if not os.path.isfile(path):
            raise DataError(f"--tokenizer {text!r}: no such file {path}; give an existing tokenizer file, or byte")
        if kind is None:
            kind = _SUFFIX_KIND.get(os.path.splitext(path)[1].lower())
            if kind is None:
                raise DataError(
                    f"--tokenizer {text!r}: the kind does not follow from the file name; write it as KIND:PATH with "
                    f"KIND one of {', '.join(k for k in KINDS if k != 'byte')} (e.g. sentencepiece:{text})"
                )
    if pattern is not None and kind != "tiktoken":
        raise DataError(f"--tiktoken-pattern applies to a tiktoken ranks file, not to a {kind} tokenizer; drop it")
    if (bos_token is not None or eos_token is not None) and kind not in ("hf", "sentencepiece"):
        raise DataError(
            f"--bos-token / --eos-token name tokens of a hf or sentencepiece tokenizer; the {kind} tokenizer's "
            f"special tokens are fixed (use --no-add-bos / --no-add-eos to leave them out)"
        )
    return TokenizerSpec(kind, path or None, pattern, bos_token, eos_token)


def load_tokenizer(spec: TokenizerSpec) -> TextTokenizer:
    """Builds the tokenizer a spec names, from local files only.

    Raises:
      DataError: the file cannot be read as that kind of tokenizer, a BOS / EOS token it names is not in its
        vocabulary, or (tiktoken) no pattern is known for the ranks file.
      jaxpar.config.extras.MissingExtra: the kind's library (the `data` extra) is not installed.
    """
    if spec.kind == "byte":
        from jaxpar.data.tokenizer import ByteTokenizer

        return ByteTokenizer()
    builders: dict[str, Callable[[TokenizerSpec], TextTokenizer]] = {
        "hf": tokenizer_backends.HFTokenizer,
        "tiktoken": tokenizer_backends.TiktokenTokenizer,
        "sentencepiece": tokenizer_backends.SentencePieceTokenizer,
    }
    build = builders.get(spec.kind)
    if build is None:
        raise DataError(f"unknown tokenizer kind {spec.kind!r}; use one of {', '.join(KINDS)}")
    return build(spec)


def tokenizer_identity(spec: TokenizerSpec, tokenizer: TextTokenizer) -> dict:
    """What a manifest records of a tokenizer: {"kind", "source_path" (absolute, None for byte), "sha256" (of the
    file, None for byte), "pattern" (tiktoken's encoding name, else None), "vocab_size", "bos_id", "eos_id"}."""
    return {
        "kind": spec.kind,
        "source_path": spec.path,
        "sha256": file_sha256(spec.path) if spec.path else None,
        "pattern": getattr(tokenizer, "pattern", None),
        "vocab_size": int(tokenizer.vocab_size),
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
    }


def tokenizer_from_manifest(directory: str, manifest: dict | None = None) -> TextTokenizer:
    """Rebuilds the tokenizer a shard set was made with, from the set's own copy of the tokenizer file
    (`tokenizer.file` in its manifest, relative to `directory`), with the recorded BOS / EOS ids.

    Raises:
      DataError: the manifest names no tokenizer, its copy is missing, or the copy's SHA-256 differs from the
        recorded one (the file was changed after tokenizing).
    """
    if manifest is None:
        manifest = read_manifest(directory)
    info = manifest.get("tokenizer")
    if not isinstance(info, dict) or info.get("kind") not in KINDS:
        raise DataError(f"{directory}/manifest.json names no known tokenizer (tokenizer.kind); re-run jaxpar-data")
    path = None
    if info["kind"] != "byte":
        path = os.path.join(directory, info["file"])
        if not os.path.isfile(path):
            raise DataError(f"{path} (the shard set's copy of its tokenizer) is missing; re-run jaxpar-data tokenize")
        if file_sha256(path) != info["sha256"]:
            raise DataError(
                f"{path} differs from the tokenizer the shards were made with (SHA-256 {info['sha256']}); restore "
                f"that file or re-tokenize"
            )
    spec = TokenizerSpec(
        info["kind"], path, info.get("pattern"), fixed_ids=True, bos_id=info["bos_id"], eos_id=info["eos_id"]
    )
    tokenizer = load_tokenizer(spec)
    if int(tokenizer.vocab_size) != int(info["vocab_size"]):
        raise DataError(
            f"the tokenizer rebuilt from {directory} has {tokenizer.vocab_size} tokens, the manifest says "
            f"{info['vocab_size']}; the tokenizer library reads the file differently: re-tokenize"
        )
    return tokenizer
