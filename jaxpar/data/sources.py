"""Reads a corpus for a `DataConfig` into train and validation token streams. Nothing is downloaded.

Sources (`data.source`):
  stdlib  the running interpreter's standard-library .py files (site-packages and test dirs excluded).
  text    a directory (recursive, every regular file) or a glob of text files; one file is one document.
  jsonl   a file or glob of JSON-lines files; each line's `data.text_field` is one document.
  tokens  a flat binary file of `data.token_dtype` ids, used as is.

Text documents become BOS + UTF-8 bytes + EOS (`jaxpar.data.tokenizer`). The train/validation split of text
sources is by document and deterministic: a document is held out when a SHA-256 hash of its key (path relative
to the corpus root, plus the line number for JSONL) falls below `data.validation_fraction`. A token file is split
by position: its last `validation_fraction` of tokens is validation.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterable, Iterator

import numpy as np

from jaxpar.config import ConfigError, DataConfig
from jaxpar.config.data_sources import TOKEN_DTYPES
from jaxpar.data.tokenizer import BOS_ID, EOS_ID

_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})
Document = tuple[str, bytes]  # (stable key, UTF-8 bytes)


def load_tokens(cfg: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    """Returns (train_tokens, val_tokens), two non-empty 1-D token streams.

    dtype is uint16 for text sources and `data.token_dtype` for `tokens` (a read-only memmap view).
    `data.max_bytes` > 0 stops reading once that many bytes are read: whole documents in sorted order are kept
    until the cap is reached (at least two, so both splits get one), and only then split.

    Raises:
      ConfigError: unknown data.source, no file matches data.path, the corpus is empty or has a single
        document, a JSONL line lacks data.text_field, or a token file's size is not a multiple of its dtype.
    """
    if cfg.source == "tokens":
        return _load_token_file(cfg)
    if cfg.source == "stdlib":
        found = _file_documents(*_stdlib_files())
    elif cfg.source == "text":
        found = _file_documents(*_match_files(cfg))
    elif cfg.source == "jsonl":
        found = _jsonl_documents(*_match_files(cfg), cfg.text_field)
    else:
        raise ConfigError(
            f"data.source={cfg.source!r} is not one of stdlib, text, jsonl, tokens (a shard set, data.source=shards, "
            f"is read by jaxpar.data.stream)"
        )
    docs = _cap_documents(found, cfg.max_bytes)
    where = "the standard library" if cfg.source == "stdlib" else f"data.path={cfg.path!r}"
    if not docs:
        raise ConfigError(f"data.source={cfg.source}: {where} holds no non-empty document; point data.path at text")
    if len(docs) < 2:
        raise ConfigError(
            f"data.source={cfg.source}: {where} gives a single document, which cannot be split "
            f"into train and validation; add documents or raise data.max_bytes"
        )
    is_val = split_documents([key for key, _ in docs], cfg.validation_fraction)
    train = _concat([d for d, v in zip(docs, is_val) if not v])
    val = _concat([d for d, v in zip(docs, is_val) if v])
    return train, val


def split_documents(keys: list[str], validation_fraction: float) -> list[bool]:
    """Returns, per key, whether its document is held out for validation; both splits are non-empty.

    A key goes to validation when the first 8 bytes of its SHA-256, read as a fraction of 2**64, fall below
    `validation_fraction`. If that leaves a split empty, the one key nearest the threshold moves over.

    Raises:
      ValueError: fewer than two keys.
    """
    if len(keys) < 2:
        raise ValueError(f"need at least 2 documents to split, got {len(keys)}")
    u = [int.from_bytes(hashlib.sha256(k.encode("utf-8")).digest()[:8], "big") / 2.0**64 for k in keys]
    is_val = [x < validation_fraction for x in u]
    if not any(is_val):
        is_val[min(range(len(u)), key=u.__getitem__)] = True
    elif all(is_val):
        is_val[max(range(len(u)), key=u.__getitem__)] = False
    return is_val


def _stdlib_files() -> tuple[str, list[str]]:
    root = sysconfig.get_paths()["stdlib"]
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        rels += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py")]
    if not rels:
        raise ConfigError(f"data.source=stdlib: no .py files under {root}; use data.source=text with data.path")
    return root, sorted(rels)


def _match_files(cfg: DataConfig) -> tuple[str, list[str]]:
    """Returns (root, sorted paths relative to root) of the regular files `data.path` names."""
    path = os.path.expanduser(cfg.path)
    if os.path.isdir(path):
        root = path
        files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    elif os.path.isfile(path):
        root, files = os.path.dirname(path) or ".", [path]
    else:
        files = glob.glob(path, recursive=True)
        root = os.path.commonpath([os.path.dirname(f) or "." for f in files]) if files else ""
    files = [f for f in files if os.path.isfile(f)]
    if not files and os.path.isdir(path):
        raise ConfigError(
            f"data.path={cfg.path!r} is a directory with no files in it; put text files there or "
            f"point data.path at another directory, file or glob pattern"
        )
    if not files:
        raise ConfigError(
            f"data.path={cfg.path!r} matches no file for data.source={cfg.source}; give an "
            f"existing directory, file or glob pattern (e.g. 'corpus/**/*.txt')"
        )
    return root, sorted(os.path.relpath(f, root).replace(os.sep, "/") for f in files)


def _file_documents(root: str, rels: list[str]) -> Iterator[Document]:
    for rel in rels:
        with open(os.path.join(root, rel), "rb") as f:
            yield rel, f.read()


def _jsonl_documents(root: str, rels: list[str], text_field: str) -> Iterator[Document]:
    for rel in rels:
        with open(os.path.join(root, rel), "rb") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(
                        f"data.path: {rel} line {line_no} is not JSON ({e.msg}); "
                        f"data.source=jsonl needs one JSON object per line"
                    ) from None
                if not isinstance(obj, dict) or text_field not in obj:
                    keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                    raise ConfigError(
                        f"data.text_field={text_field!r} is missing from {rel} line {line_no} "
                        f"(found {keys}); set data.text_field to the key holding the text"
                    )
                text = obj[text_field]
                if not isinstance(text, str):
                    raise ConfigError(
                        f"data.text_field={text_field!r} in {rel} line {line_no} is a "
                        f"{type(text).__name__}, not a string; point data.text_field at text"
                    )
                yield f"{rel}:{line_no}", text.encode("utf-8")


def _cap_documents(docs: Iterable[Document], max_bytes: int) -> list[Document]:
    """Keeps non-empty documents in order until `max_bytes` are read (0: all); always at least two if any."""
    kept: list[Document] = []
    total = 0
    for key, data in docs:
        if max_bytes > 0 and total >= max_bytes and len(kept) >= 2:
            break
        if data:
            kept.append((key, data))
            total += len(data)
    return kept


def _concat(docs: list[Document]) -> np.ndarray:
    """BOS + bytes + EOS for each document, concatenated: uint16 [sum(len + 2)]."""
    out = np.empty(sum(len(d) + 2 for _, d in docs), dtype=np.uint16)
    pos = 0
    for _, data in docs:
        out[pos] = BOS_ID
        out[pos + 1 : pos + 1 + len(data)] = np.frombuffer(data, dtype=np.uint8)
        out[pos + 1 + len(data)] = EOS_ID
        pos += len(data) + 2
    return out


def _load_token_file(cfg: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    if cfg.token_dtype not in TOKEN_DTYPES:
        raise ConfigError(f"data.token_dtype={cfg.token_dtype!r} is not one of {', '.join(TOKEN_DTYPES)}")
    dtype = np.dtype(cfg.token_dtype)
    path = os.path.expanduser(cfg.path)
    if not os.path.isfile(path):
        raise ConfigError(
            f"data.path={cfg.path!r} is not a file; data.source=tokens needs a flat binary file "
            f"of {cfg.token_dtype} token ids"
        )
    size = os.path.getsize(path)
    if size % dtype.itemsize:
        raise ConfigError(
            f"data.path={cfg.path!r} has {size} bytes, not a multiple of {dtype.itemsize} "
            f"(data.token_dtype={cfg.token_dtype}); check data.token_dtype or the file"
        )
    n = size // dtype.itemsize
    if cfg.max_bytes > 0:
        n = min(n, max(cfg.max_bytes // dtype.itemsize, 2))
    if n < 2:
        raise ConfigError(
            f"data.path={cfg.path!r} holds {n} tokens; data.source=tokens needs at least 2 (one train, one validation)"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
    n_val = min(max(int(round(n * cfg.validation_fraction)), 1), n - 1)
    return tokens[: n - n_val], tokens[n - n_val :]
