"""`TokenizerSpec`: which tokenizer to build, by kind and local file (`jaxpar.data.text_tokenizer` parses one from
a `--tokenizer` argument and builds the tokenizer it names)."""

from __future__ import annotations

import dataclasses

KINDS = ("byte", "hf", "tiktoken", "sentencepiece")


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """Which tokenizer to build.

    Attributes:
      kind: one of `KINDS`.
      path: the tokenizer file (None for byte); for hf a `tokenizer.json` (a directory given is resolved to the
        `tokenizer.json` in it).
      pattern: tiktoken only, the name of the known encoding whose split pattern the ranks were made with
        (`jaxpar.data.tokenizer_backends.TIKTOKEN_PATTERNS`); None to take it from a ranks file that is a known
        encoding's own.
      bos_token, eos_token: hf and sentencepiece only, the token strings to use as BOS / EOS instead of the ones
        the tokenizer names.
      fixed_ids: True when rebuilding from a manifest: `bos_id` and `eos_id` (None: none) are used as recorded.
      bos_id, eos_id: the recorded ids (with `fixed_ids`).
    """

    kind: str
    path: str | None = None
    pattern: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    fixed_ids: bool = False
    bos_id: int | None = None
    eos_id: int | None = None
