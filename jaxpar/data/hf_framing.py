"""The BOS / EOS that jaxpar frames each document with, for a Hugging Face `tokenizer.json` (`HFTokenizer`).

jaxpar encodes a document's text without the tokenizer's post-processor (`add_special_tokens=False`) and puts the
BOS / EOS around it itself, so the post-processor and jaxpar never both add one: a document opens with at most
one BOS. The ids follow the family's own convention, which a tokenizer states in its `post_processor` (what
`Tokenizer.encode(text, add_special_tokens=True)` adds around a text) and in the `tokenizer_config.json` beside
it. For the families jaxpar converts (ids of the published files in brackets):

  family                    post_processor                          BOS                         EOS
  Llama 3                   ByteLevel, then "<|begin_of_text|> $A"  <|begin_of_text|> (128000)  <|end_of_text|> (128001)
  Mistral, Mixtral, Llama 2 TemplateProcessing "<s> $A"             <s> (1)                     </s> (2)
  Gemma 2                   TemplateProcessing "<bos> $A"           <bos> (2)                   <eos> (1)
  Qwen2, Qwen2.5, Qwen3     ByteLevel, which adds no token          none                        <|endoftext|> (151643)

BOS, the first that applies:
  1. `--bos-token`: the user's choice, used even where the tokenizer adds another BOS or none (Qwen); a warning
     names what the tokenizer itself adds.
  2. The one token the post-processor puts before a text. A tokenizer_config.json that names another
     `bos_token`, or sets `add_bos_token: false`, is warned about; the post-processor wins (it is what
     `encode` does). More than one token before a text is an error unless `--bos-token` names the BOS.
  3. A post-processor that puts nothing before a text (Qwen's ByteLevel): no BOS.
  4. No post-processor at all: tokenizer_config.json's `bos_token` (none when it is null or `add_bos_token` is
     false), else the first of `BOS_NAMES` in the vocabulary.

EOS (the token that closes every document, the separator of packed documents), the first that applies:
  1. `--eos-token`, as for BOS (a warning when the post-processor appends another token).
  2. The one token the post-processor puts after a text (tokenizers saved with `add_eos_token: true`); more
     than one is an error unless `--eos-token` names the EOS.
  3. tokenizer_config.json's `eos_token`. An instruct model's file names its end-of-turn token there
     (Qwen2.5-Instruct and Qwen3: <|im_end|>; Llama 3 Instruct: <|eot_id|>); documents are separated by the
     family's end of text instead (`END_OF_TEXT`), with a warning that says so and how to choose the other.
  4. The first of `EOS_NAMES` in the vocabulary.

Chat templates are not applied: a document is plain text.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from jaxpar.data.errors import DataError

_log = logging.getLogger("jaxpar.data")

# BOS / EOS token strings of common tokenizer families (Llama 2, Llama 3, Gemma, GPT-2 / NeoX), looked up when
# neither the command line, the post-processor nor a tokenizer_config.json beside tokenizer.json names them.
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>")
# An instruct tokenizer's end-of-turn EOS -> its family's end of text, which separates pretraining documents.
END_OF_TEXT = {"<|im_end|>": "<|endoftext|>", "<|eot_id|>": "<|end_of_text|>", "<end_of_turn>": "<eos>"}
_PROBE = "jaxpar frames documents"  # a text every tokenizer encodes to at least one id


def read_tokenizer_config(path: str) -> dict[str, Any]:
    """The keys `bos_token`, `eos_token` (a string, or None where the file has null) and `add_bos_token` (a bool)
    that a tokenizer_config.json holds; a key the file lacks is absent; {} when there is no such file. A token
    given as a dict takes its "content".

    Raises:
      DataError: the file is not JSON.
    """
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not valid JSON ({e}); fix it or move it away from tokenizer.json") from None
    if not isinstance(config, dict):
        return {}
    out: dict[str, Any] = {}
    for key in ("bos_token", "eos_token"):
        if key in config:
            value = config[key]
            value = value.get("content") if isinstance(value, dict) else value
            out[key] = value if isinstance(value, str) else None
    if isinstance(config.get("add_bos_token"), bool):
        out["add_bos_token"] = config["add_bos_token"]
    return out


def post_processor_tokens(tok) -> tuple[list[int], list[int]] | None:
    """(ids the tokenizer's post-processor puts before a single text, ids it puts after): ([1], []) for Mistral,
    ([], []) for Qwen and for a tokenizer without a post-processor; None (with a warning) when the post-processor
    changes the text's own ids, so that no before / after can be told."""
    plain = tok.encode(_PROBE, add_special_tokens=False).ids
    framed = tok.encode(_PROBE, add_special_tokens=True).ids
    n = len(plain)
    for start in range(len(framed) - n + 1) if n else ():
        if framed[start : start + n] == plain:
            return framed[:start], framed[start + n :]
    _log.warning("this tokenizer's post-processor changes a text's own ids; BOS / EOS follow tokenizer_config.json")
    return None


def _named(tok, name: str, flag: str) -> int:
    found = tok.token_to_id(name)
    if found is None:
        raise DataError(f"{flag} {name!r} is not a token of this tokenizer; name one of its special tokens")
    return int(found)


def _one(tok, ids: list[int], where: str, what: str) -> int | None:
    """The single id of `ids` (None when empty).

    Raises:
      DataError: more than one id.
    """
    if len(ids) > 1:
        names = ", ".join(repr(tok.id_to_token(i)) for i in ids)
        raise DataError(
            f"this tokenizer's post-processor puts {len(ids)} tokens ({names}) {where} a text; jaxpar frames a "
            f"document with one {what}: name it with --{what.lower()}-token, or leave it out with --no-add-"
            f"{what.lower()}"
        )
    return int(ids[0]) if ids else None


def _first_in_vocab(tok, names: list[str | None]) -> int | None:
    for name in names:
        found = tok.token_to_id(name) if name else None
        if found is not None:
            return int(found)
    return None


def _bos(tok, given: str | None, before: list[int] | None, has_post: bool, config: dict) -> int | None:
    """The BOS id by the module's rules (`before`: the post-processor's ids before a text, None when unknown)."""
    if given is not None:
        chosen = _named(tok, given, "--bos-token")
        if before is not None and has_post and before != [chosen]:
            _log.warning(
                "--bos-token %r: documents open with it, while this tokenizer's own post-processor opens a text with "
                "%s (as its model was trained); jaxpar encodes without the post-processor, so %r is the only BOS",
                given,
                " ".join(repr(tok.id_to_token(i)) for i in before) or "no token",
                given,
            )
        return chosen
    if before is not None and has_post:
        stated = _one(tok, before, "before", "BOS")
        named = config.get("bos_token")
        if stated is not None and (
            config.get("add_bos_token") is False or named not in (None, tok.id_to_token(stated))
        ):
            _log.warning(
                "tokenizer_config.json %s, but tokenizer.json's post-processor opens a text with %r; documents open "
                "with %r, as the post-processor's (--bos-token or --no-add-bos choose otherwise)",
                "sets add_bos_token false" if config.get("add_bos_token") is False else f"names BOS {named!r}",
                tok.id_to_token(stated),
                tok.id_to_token(stated),
            )
        if stated is None and config.get("add_bos_token") is True and named:
            _log.warning(
                "tokenizer_config.json asks for BOS %r (add_bos_token true) but tokenizer.json's post-processor adds "
                "none; documents open with no BOS (--bos-token %r opens them with it)",
                named,
                named,
            )
        return stated
    if config.get("add_bos_token") is False:
        return None
    if "bos_token" in config:
        if config["bos_token"] is None:
            return None
        found = _first_in_vocab(tok, [config["bos_token"]])
        if found is not None:
            return found
    return _first_in_vocab(tok, list(BOS_NAMES))


def _eos(tok, given: str | None, after: list[int] | None, config: dict) -> int | None:
    """The EOS id by the module's rules (`after`: the post-processor's ids after a text, None when unknown)."""
    if given is not None:
        chosen = _named(tok, given, "--eos-token")
        if after and after != [chosen]:
            _log.warning(
                "--eos-token %r: documents close with it, while this tokenizer's own post-processor closes a text with "
                "%s; jaxpar encodes without the post-processor, so %r is the only EOS",
                given,
                " ".join(repr(tok.id_to_token(i)) for i in after),
                given,
            )
        return chosen
    if after:
        return _one(tok, after, "after", "EOS")
    named = config.get("eos_token")
    if named in END_OF_TEXT and tok.token_to_id(END_OF_TEXT[named]) is not None:
        _log.warning(
            "tokenizer_config.json names EOS %r, the end of a chat turn (an instruct model's tokenizer); documents are "
            "separated by the family's end of text %r instead (--eos-token %r closes them with the other)",
            named,
            END_OF_TEXT[named],
            named,
        )
        named = END_OF_TEXT[named]
    return _first_in_vocab(tok, [named, *EOS_NAMES])


def document_framing(
    tok, config_path: str, bos_token: str | None = None, eos_token: str | None = None
) -> tuple[int | None, int | None]:
    """(BOS id, EOS id) that jaxpar frames each document with (None: none), by the rules of the module docstring.

    Args:
      tok: a `tokenizers.Tokenizer` (its truncation and padding off).
      config_path: the tokenizer_config.json beside the tokenizer.json (it may not exist).
      bos_token, eos_token: `--bos-token` / `--eos-token`, or None.

    Raises:
      DataError: a named token is not in the vocabulary, the post-processor puts more than one token before (or
        after) a text and no token is named, or tokenizer_config.json is not JSON.
    """
    config = read_tokenizer_config(config_path)
    framing = post_processor_tokens(tok)
    before, after = framing if framing is not None else (None, None)
    has_post = tok.post_processor is not None
    return _bos(tok, bos_token, before, has_post, config), _eos(tok, eos_token, after, config)
