"""The file-based tokenizers behind `jaxpar.data.text_tokenizer`: Hugging Face `tokenizer.json`, tiktoken ranks,
SentencePiece models. Each library is imported when its tokenizer is built, and none is asked to download.

Every backend encodes a document as plain text: special-token strings written in the text (such as "</s>" or
"<|endoftext|>") are encoded as the characters they are, never as the special ids, so a document cannot inject
a boundary. Decoding skips special tokens.
"""

from __future__ import annotations

import base64
import os

import numpy as np

from jaxpar.config.extras import require
from jaxpar.data.errors import DataError
from jaxpar.data.hf_framing import document_framing
from jaxpar.data.shards import file_sha256
from jaxpar.data.tokenizer_spec import TokenizerSpec

# Split patterns of tiktoken's published encodings, with the SHA-256 of each encoding's published ranks file and
# its special tokens, as tiktoken defines those encodings (`tiktoken.get_encoding(name)`). A ranks file whose SHA-256
# is one of these is that encoding (its pattern and special tokens apply); any other ranks file needs the pattern it
# was trained with named (--tiktoken-pattern) and gets one special token, <|endoftext|>, after its last rank.
_R50K = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_CL100K = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|"""
    r"""\s+(?!\S)|\s"""
)
_O200K = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
ENDOFTEXT = "<|endoftext|>"
TIKTOKEN_PATTERNS = {
    "gpt2": _R50K,
    "r50k_base": _R50K,
    "p50k_base": _R50K,
    "cl100k_base": _CL100K,
    "o200k_base": _O200K,
}
TIKTOKEN_KNOWN_FILES = {  # SHA-256 of the published ranks file -> (encoding name, special tokens)
    "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930": ("r50k_base", {ENDOFTEXT: 50256}),
    "94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069": ("p50k_base", {ENDOFTEXT: 50256}),
    "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7": (
        "cl100k_base",
        {
            ENDOFTEXT: 100257,
            "<|fim_prefix|>": 100258,
            "<|fim_middle|>": 100259,
            "<|fim_suffix|>": 100260,
            "<|endofprompt|>": 100276,
        },
    ),
    "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d": (
        "o200k_base",
        {ENDOFTEXT: 199999, "<|endofprompt|>": 200018},
    ),
}


def _file(spec: TokenizerSpec) -> str:
    """The tokenizer file of a file-based spec.

    Raises:
      DataError: the spec names no file.
    """
    if not spec.path:
        raise DataError(f"a {spec.kind} tokenizer is read from a file; give KIND:PATH (--tokenizer {spec.kind}:FILE)")
    return spec.path


def _ids(ids) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64).reshape(-1)


class HFTokenizer:
    """A Hugging Face `tokenizer.json` through the `tokenizers` library. Truncation and padding stored in the file
    are turned off (a document is encoded whole), and so is its post-processor: `encode` adds no special token,
    and the tokenize command puts `bos_id` / `eos_id` around each document. Those follow the family's convention
    as the file's post-processor and the `tokenizer_config.json` beside it state it (Qwen: no BOS; Llama 3, Mistral,
    Gemma: the BOS their post-processor adds), or `spec.bos_token` / `eos_token`: `jaxpar.data.hf_framing` gives
    the rules and the table of families.

    Raises:
      DataError: the file is not a tokenizer.json, a named BOS / EOS token is not in the vocabulary, or the
        post-processor puts several tokens around a text and none is named.
    """

    def __init__(self, spec: TokenizerSpec):
        path = _file(spec)
        tokenizers = require("tokenizers", "a Hugging Face tokenizer.json (tokenizer kind hf)")
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 -- the library raises its own Exception type
            raise DataError(
                f"{path} is not a Hugging Face tokenizer.json ({e}); give the tokenizer.json file"
            ) from None
        self._tok.no_truncation()
        self._tok.no_padding()
        self._tok.encode_special_tokens = True  # "</s>" in a document's text is text, not the EOS id
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        if spec.fixed_ids:
            self.bos_id, self.eos_id = spec.bos_id, spec.eos_id
        else:
            config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
            self.bos_id, self.eos_id = document_framing(self._tok, config, spec.bos_token, spec.eos_token)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` (no special tokens added): int64 [n]."""
        return _ids(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """`encode` of each text, in one call into the library (single-threaded in jaxpar-data's workers)."""
        return [_ids(e.ids) for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        """Text of `ids`, special tokens skipped."""
        return self._tok.decode(_ids(ids).tolist(), skip_special_tokens=True)


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """A `.tiktoken` ranks file (one `base64(token) rank` per line) -> {token bytes: rank}. Read here rather than
    with tiktoken's `load_tiktoken_bpe`, which looks in a cache keyed by the path's name before the file itself.

    Raises:
      DataError: a line that is not `base64 integer`, or no line at all.
    """
    ranks = {}
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise DataError(
                    f"{path} line {line_no} is not 'base64-token rank'; give a .tiktoken BPE ranks file"
                ) from None
    if not ranks:
        raise DataError(f"{path} holds no ranks; give a .tiktoken BPE ranks file")
    return ranks


class TiktokenTokenizer:
    """A tiktoken BPE from a local ranks file and a known encoding's split pattern (module constants).

    `pattern`: the encoding name used. EOS is <|endoftext|>; there is no BOS.

    Raises:
      DataError: an unknown pattern name, no pattern for a ranks file that is not a published one, a pattern that
        contradicts the published file given, or a ranks file that does not parse.
    """

    def __init__(self, spec: TokenizerSpec):
        path = _file(spec)
        tiktoken = require("tiktoken", "a tiktoken ranks file (tokenizer kind tiktoken)")
        known = TIKTOKEN_KNOWN_FILES.get(file_sha256(path))
        name = spec.pattern
        if name is not None and name not in TIKTOKEN_PATTERNS:
            raise DataError(
                f"--tiktoken-pattern {name!r} is not a known encoding; use one of {', '.join(TIKTOKEN_PATTERNS)} "
                f"(the encoding whose split pattern the ranks were made with)"
            )
        if known is not None and name is not None and TIKTOKEN_PATTERNS[name] != TIKTOKEN_PATTERNS[known[0]]:
            raise DataError(
                f"{path} is {known[0]}'s published ranks file, whose pattern is not {name}'s; drop "
                f"--tiktoken-pattern or write --tiktoken-pattern {known[0]}"
            )
        if known is not None:
            self.pattern, specials = known[0], dict(known[1])
        elif name is not None:
            self.pattern, specials = name, {}  # its one special token follows the last rank, below
        else:
            raise DataError(
                f"{path} is not a published tiktoken ranks file, so its split pattern is unknown; name the "
                f"encoding whose pattern it was made with: --tiktoken-pattern with one of "
                f"{', '.join(TIKTOKEN_PATTERNS)}"
            )
        ranks = read_tiktoken_ranks(path)
        if known is None:
            specials = {ENDOFTEXT: max(ranks.values()) + 1}
        self._enc = tiktoken.Encoding(
            f"jaxpar-{self.pattern}",
            pat_str=TIKTOKEN_PATTERNS[self.pattern],
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
        self._special_ids = np.array(sorted(specials.values()), np.int64)
        self.vocab_size = self._enc.max_token_value + 1
        self.bos_id = spec.bos_id if spec.fixed_ids else None
        self.eos_id = spec.eos_id if spec.fixed_ids else specials[ENDOFTEXT]

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text`, special-token strings encoded as text: int64 [n]."""
        return _ids(self._enc.encode_ordinary(text))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        """Text of `ids`, special tokens skipped; bytes that are not UTF-8 become U+FFFD."""
        ids = _ids(ids)
        ids = ids[~np.isin(ids, self._special_ids)]
        return self._enc.decode_bytes(ids.tolist()).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A SentencePiece `.model` file. BOS / EOS: `spec.bos_token` / `eos_token` when given, else the model's own
    (None where the model disables them). Round trips are exact only for a model trained without normalisation
    (`normalization_rule_name=identity`, `add_dummy_prefix=false`, `remove_extra_whitespaces=false`) and with
    byte fallback; the default NFKC model folds some characters and whitespace.

    Raises:
      DataError: the file is not a SentencePiece model, or a named BOS / EOS piece is not in it.
    """

    def __init__(self, spec: TokenizerSpec):
        path = _file(spec)
        sentencepiece = require("sentencepiece", "a SentencePiece model (tokenizer kind sentencepiece)")
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(model_file=path)
        except (OSError, RuntimeError) as e:
            raise DataError(f"{path} is not a SentencePiece model ({e}); give a .model file") from None
        self.vocab_size = int(self._sp.GetPieceSize())
        if spec.fixed_ids:
            self.bos_id, self.eos_id = spec.bos_id, spec.eos_id
        else:
            self.bos_id = self._special(spec.bos_token, self._sp.bos_id(), "--bos-token")
            self.eos_id = self._special(spec.eos_token, self._sp.eos_id(), "--eos-token")

    def _special(self, given: str | None, own: int, flag: str) -> int | None:
        if given is None:
            return own if own >= 0 else None
        found = self._sp.PieceToId(given)
        if found == self._sp.unk_id() and given != self._sp.IdToPiece(found):
            raise DataError(f"{flag} {given!r} is not a piece of this SentencePiece model; name one of its pieces")
        return int(found)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` (no BOS / EOS): int64 [n]."""
        return _ids(self._sp.Encode(text, out_type=int))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [_ids(x) for x in self._sp.Encode(texts, out_type=int, num_threads=1)]

    def decode(self, ids) -> str:
        """Text of `ids`; control pieces (BOS, EOS, padding) decode to nothing."""
        ids = _ids(ids)
        specials = [i for i in (self.bos_id, self.eos_id) if i is not None]
        return self._sp.Decode(ids[~np.isin(ids, specials)].tolist())
