"""Packed sequences read lazily from a token shard set (`data.source: shards`): nothing proportional to the corpus
is loaded.

Shape letters as in the `jaxpar` glossary; T: the sequence length (`data.seq_len`), R: the rows asked for, N: the packed
sequences of a split.

A split is a contiguous range of documents of a shard set (`jaxpar.data.shards`), read as one token stream: the
documents one after another, in shard order. `ShardRows` serves that stream packed exactly as `jaxpar.data.pack`
packs it in RAM (window i covers stream positions [i*T, i*T + T], the last window padded), but reads only the
T + 1 tokens of each row it is asked for. With document masking the documents come from the shard set's own
document index (the offsets files), not from BOS tokens: a row's segment ids number its documents from 1, and a
target in another document than its input gets loss_mask 0. For a set whose documents open with BOS and hold no
other BOS (what `jaxpar-data tokenize` writes with `add_bos`), the rows equal `pack(tokens, T, pad_id, bos_id)`.

Splits (`shard_splits`): `data.validation_path` empty holds out the tail of `data.path`'s documents, the last
whole documents that make up `data.validation_fraction` of its tokens (at least one, never all), and trains on
the rest; `data.validation_path` set trains on all of `data.path` and validates on that second shard set (same
tokenizer, checked).

Memory: a row is read with positioned reads (`os.pread`) of its T + 1 tokens and of the offsets of the documents
they lie in, copied into the row's arrays; nothing else of the shards enters the process. The files are not read
through a memory map: every page a mapped read touches stays in the process's resident set, and a fault maps
more than the page it reads (measured with an earlier mapped version on Linux 6.18, read_ahead_kb = 8192: reading
32 random rows of 4 KB from a 20 MB shard added 16 MB of file pages to the resident set), so the resident memory of
a mapped reader grows with what it has read, up to the corpus. The kernel's page cache still caches the files for
all processes. In RAM, besides the rows: per shard its first document and first token (two int64), and per open
shard (at most `MAX_OPEN_SHARDS`, two file descriptors each) every `INDEX_STRIDE`-th document offset (8 bytes per
1,024 documents).
"""

from __future__ import annotations

import collections
import logging
import os

import numpy as np

from jaxpar.config import ConfigError, DataConfig
from jaxpar.config.paths import directory_problem
from jaxpar.data.batch import BATCH_KEYS, SEGMENT_IDS
from jaxpar.data.errors import DataError
from jaxpar.data.shards import ShardSet
from jaxpar.data.tokenizer import PAD_ID

_log = logging.getLogger("jaxpar.data")
SHARD_SET_KEY = "shard_set_sha256"  # a loader state's record of the shard set(s) it indexes (`check_shard_set`)
MAX_OPEN_SHARDS = 64  # shards kept open at once (two file descriptors each); others are reopened on demand
INDEX_STRIDE = 1024  # every INDEX_STRIDE-th document offset of an open shard is kept in RAM


def _npy_data(path: str, dtype: np.dtype, size: int) -> tuple[int, int]:
    """(open read-only file descriptor, byte offset of the data) of a 1-D `.npy` file of `size` `dtype` values.

    Raises:
      DataError: the file cannot be read, or holds another dtype or shape than the manifest says.
    """
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in read_header:
                raise ValueError(f".npy version {version} is not 1.0 or 2.0")
            shape, fortran, file_dtype = read_header[version](f)
            start = f.tell()
        if file_dtype != dtype or shape != (size,) or fortran:
            raise DataError(
                f"{path} holds {file_dtype.name} {shape}, the manifest says {np.dtype(dtype).name} ({size},): "
                f"re-tokenize"
            )
        if os.path.getsize(path) < start + size * np.dtype(dtype).itemsize:
            raise ValueError("the file is shorter than its header says")
        return os.open(path, os.O_RDONLY), start
    except (OSError, ValueError) as e:
        raise DataError(f"{path} cannot be read ({e}); the shard set is damaged: re-tokenize") from None


class _Shard:
    """One open shard: positioned reads (`os.pread`) of its tokens and document offsets, and every
    `INDEX_STRIDE`-th offset in RAM to find a position's document with one small read."""

    def __init__(self, directory: str, entry: dict, token_dtype: np.dtype):
        self.num_tokens, self.num_documents = int(entry["tokens"]), int(entry["documents"])
        self.token_dtype = token_dtype
        self._tok_fd, self._tok_start = _npy_data(
            os.path.join(directory, entry["tokens_file"]), token_dtype, self.num_tokens
        )
        self._off_fd, self._off_start = _npy_data(
            os.path.join(directory, entry["offsets_file"]), np.dtype(np.int64), self.num_documents + 1
        )
        self.index = np.concatenate(
            [self.offsets(d, d + 1) for d in range(0, self.num_documents + 1, INDEX_STRIDE)]
        )  # int64 [ceil((documents + 1) / INDEX_STRIDE)]: offsets of documents 0, INDEX_STRIDE, ...

    @staticmethod
    def _pread(fd: int, dtype: np.dtype, start_byte: int, count: int) -> np.ndarray:
        n = count * dtype.itemsize
        data = os.pread(fd, n, start_byte)
        if len(data) != n:
            raise DataError("a shard file is shorter than its manifest says; the shard set is damaged: re-tokenize")
        return np.frombuffer(data, dtype)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Token ids at shard positions [start, stop): `token_dtype` [stop - start] (read-only)."""
        return self._pread(
            self._tok_fd, self.token_dtype, self._tok_start + start * self.token_dtype.itemsize, stop - start
        )

    def offsets(self, start: int, stop: int) -> np.ndarray:
        """Offsets of documents [start, stop) (0 <= start <= stop <= documents + 1): int64 [stop - start]."""
        return self._pread(self._off_fd, np.dtype(np.int64), self._off_start + 8 * start, stop - start)

    def document_at(self, position: int) -> int:
        """The shard's document (0-based) holding shard position `position` (0 <= position < tokens)."""
        block = int(np.searchsorted(self.index, position, side="right")) - 1
        lo = block * INDEX_STRIDE
        part = self.offsets(lo, min(lo + INDEX_STRIDE + 1, self.num_documents + 1))
        return lo + int(np.searchsorted(part, position, side="right")) - 1

    def close(self) -> None:
        os.close(self._tok_fd)
        os.close(self._off_fd)


class _Shards:
    """The shards of a `ShardSet`, opened on demand, at most `MAX_OPEN_SHARDS` at once."""

    def __init__(self, shard_set: ShardSet):
        self.set = shard_set
        entries = shard_set.manifest["shards"]
        self.first_doc = np.cumsum([0] + [int(s["documents"]) for s in entries]).astype(np.int64)  # [shards + 1]
        self.first_token = np.cumsum([0] + [int(s["tokens"]) for s in entries]).astype(np.int64)  # [shards + 1]
        self._open: collections.OrderedDict[int, _Shard] = collections.OrderedDict()

    def shard(self, s: int) -> _Shard:
        if s in self._open:
            self._open.move_to_end(s)
        else:
            self._open[s] = _Shard(self.set.directory, self.set.manifest["shards"][s], self.set.token_dtype)
            while len(self._open) > MAX_OPEN_SHARDS:
                self._open.popitem(last=False)[1].close()
        return self._open[s]

    def __del__(self):
        for shard in getattr(self, "_open", {}).values():
            shard.close()

    def token_position(self, doc: int) -> int:
        """Global position of the first token of global document `doc` (0 <= doc <= the document count, which
        gives the total)."""
        if doc >= int(self.first_doc[-1]):
            return int(self.first_token[-1])
        s = int(np.searchsorted(self.first_doc, doc, side="right")) - 1
        d = doc - int(self.first_doc[s])
        return int(self.first_token[s]) + int(self.shard(s).offsets(d, d + 1)[0])

    def document_at(self, position: int) -> int:
        """Global index of the document holding the token at global `position` (0 <= position < total)."""
        s = int(np.searchsorted(self.first_token, position, side="right")) - 1
        return int(self.first_doc[s]) + self.shard(s).document_at(position - int(self.first_token[s]))

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens at global positions [start, stop) (int32 [stop - start]) and the global index of each one's
        document (int64 [stop - start]). Reads those tokens and the offsets of the documents they lie in."""
        tokens, docs = [], []
        s = int(np.searchsorted(self.first_token, start, side="right")) - 1
        while start < stop:
            shard_start, shard_stop = int(self.first_token[s]), int(self.first_token[s + 1])
            end = min(stop, shard_stop)
            if end > start:
                shard = self.shard(s)
                a, b = start - shard_start, end - shard_start
                ids = shard.tokens(a, b)
                if ids.size and int(ids.max()) >= self.set.vocab_size:
                    raise DataError(
                        f"shard {s} of {self.set.directory} holds token id {int(ids.max())} at or above its "
                        f"tokenizer's {self.set.vocab_size} ids: the shard set is damaged (check it with "
                        f"jaxpar.data.shards.ShardSet(DIR).verify()); re-tokenize it"
                    )
                tokens.append(ids.astype(np.int32))
                d0, d1 = shard.document_at(a), shard.document_at(b - 1)
                offsets = shard.offsets(d0, d1 + 1)  # starts of the documents the tokens lie in
                local = np.searchsorted(offsets, np.arange(a, b), side="right") - 1
                docs.append(int(self.first_doc[s]) + d0 + local)
                start = end
            s += 1
        if not tokens:
            return np.empty(0, np.int32), np.empty(0, np.int64)
        return np.concatenate(tokens), np.concatenate(docs)


class ShardRows:
    """Documents [doc_start, doc_stop) of a shard set, packed into sequences of T tokens on demand (module
    docstring): the row source of a `jaxpar.data.DataLoader` or `EvalLoader`.

    Attributes:
      num_sequences: N = ceil((num_tokens - 1) / T) rows. seq_len: T. num_tokens: the split's tokens. keys: the
        batch keys `rows` gives.
      pad_id: the id of padded positions (loss_mask 0, segment id 0).
      shard_set: the `ShardSet` read (its `digest` goes into a loader's state: `check_shard_set`).

    Args:
      shards: the opened shard set (`_Shards`), shared by the splits of one set.
      doc_start, doc_stop: the split's documents, 0 <= doc_start < doc_stop <= the set's document count.
      seq_len: T >= 1.
      document_masking: serve "segment_ids" and mask cross-document targets.
      pad_id: the id written into padded positions.
    """

    def __init__(self, shards: _Shards, doc_start: int, doc_stop: int, seq_len: int, document_masking: bool, pad_id):
        self._shards = shards
        self.shard_set = shards.set
        self.doc_start, self.doc_stop = doc_start, doc_stop
        self._token_start = shards.token_position(doc_start)
        self.num_tokens = shards.token_position(doc_stop) - self._token_start
        self.seq_len = seq_len
        self.num_sequences = -(-max(self.num_tokens - 1, 0) // seq_len)
        self.document_masking = document_masking
        self.pad_id = pad_id
        self.keys = BATCH_KEYS + ((SEGMENT_IDS,) if document_masking else ())

    def rows(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Packed rows `ids` (int [R], each in [0, N)): {"inputs", "targets": int32 [R, T], "loss_mask": float32
        [R, T]} and with document masking "segment_ids": int32 [R, T], equal to those rows of `pack` over the
        split's token stream. Reads only those rows' tokens.

        Raises:
          IndexError: an id outside [0, N).
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_sequences):
            raise IndexError(f"rows {ids.tolist()} outside [0, {self.num_sequences})")
        t = self.seq_len
        window = np.full((ids.size, t + 1), self.pad_id, np.int32)
        real = np.zeros((ids.size, t + 1), np.float32)
        doc = np.zeros((ids.size, t + 1), np.int64)
        for r, i in enumerate(ids.tolist()):
            start = i * t
            stop = min(start + t + 1, self.num_tokens)
            tokens, docs = self._shards.read(self._token_start + start, self._token_start + stop)
            n = stop - start
            window[r, :n], real[r, :n], doc[r, :n] = tokens, 1.0, docs
            doc[r, n:] = docs[-1]  # padding: the last document's, as `pack` numbers it
        out = {"inputs": window[:, :-1], "targets": window[:, 1:], "loss_mask": real[:, 1:]}
        if self.document_masking:
            out["loss_mask"] = out["loss_mask"] * (doc[:, :-1] == doc[:, 1:])
            segments = (doc[:, :-1] - doc[:, :1] + 1).astype(np.int32)
            out[SEGMENT_IDS] = np.where(real[:, :-1] > 0, segments, 0).astype(np.int32)
        return {k: np.ascontiguousarray(v) for k, v in out.items()}


def check_shard_set(recorded: str | None, shard_set: ShardSet | None, key: str) -> None:
    """Checks that a loader state saved over a shard set whose `digest` was `recorded` resumes over that same set
    (`key`: the config key naming the set's directory, e.g. "data.path"). A state saved by an earlier jaxpar
    records none: the set cannot be checked, which is logged (warning, logger "jaxpar.data"), and the resume goes
    on (the next checkpoint records it).

    Raises:
      ConfigError: the set now holds other shards (re-tokenized or replaced since), naming its directory and the
        fix.
      ValueError: the state names a shard set but this loader reads none.
    """
    if recorded is None:
        if shard_set is not None:
            _log.warning(
                "the checkpoint's data position records no shard-set digest (saved by an earlier jaxpar): cannot "
                "check that %s=%s still holds the shard set the run was trained on",
                key,
                shard_set.directory,
            )
        return
    if shard_set is None:
        raise ValueError(f"the data position indexes a shard set ({SHARD_SET_KEY} {recorded}), but {key} reads none")
    if recorded != shard_set.digest:
        raise ConfigError(
            f"{key}={shard_set.directory!r} holds another shard set than the one the checkpoint's data position "
            f"indexes (digest of its shard checksums {shard_set.digest[:16]}..., the checkpoint's "
            f"{recorded[:16]}...): it was re-tokenized or replaced since, so resuming would serve other batches; "
            f"put the shard set the run was trained on back in {shard_set.directory} (tokenize new data into "
            f"another directory), or train on this one in a new run: another train.run_dir, with --restore-from "
            f"naming this run's to carry its parameters and optimizer state over"
        )


def _open_set(path: str, key: str) -> ShardSet:
    """The shard set at `path` (`key` names the config key in errors).

    Raises:
      ConfigError: not a shard set, an unfinished one, or one whose shard files are missing or shorter than the
        manifest says (a cheap check of headers and sizes; `ShardSet.verify` compares every byte's checksum).
    """
    directory = os.path.expanduser(path)
    problem = directory_problem(directory)
    if problem is not None:
        raise ConfigError(
            f"{key}={path!r} {problem}; data.source=shards needs a shard set made by "
            f"`jaxpar-data tokenize INPUT --tokenizer TOKENIZER --out DIR` (then {key}=DIR)"
        )
    try:
        shard_set = ShardSet(directory)
        for entry in shard_set.manifest["shards"]:  # every file there, of the size its header and manifest say
            for name, dtype, size in (
                (entry["tokens_file"], shard_set.token_dtype, int(entry["tokens"])),
                (entry["offsets_file"], np.dtype(np.int64), int(entry["documents"]) + 1),
            ):
                fd, _ = _npy_data(os.path.join(directory, name), dtype, size)
                os.close(fd)
    except DataError as e:
        raise ConfigError(f"{key}={path!r}: {e}") from None
    return shard_set


def pad_id_for(shard_set: ShardSet) -> int:
    """The padding id of a set's packed rows: the byte tokenizer's PAD, else its EOS, else 0 (padding is never a
    target and sits in no segment, so any id below the vocabulary size will do)."""
    tok = shard_set.manifest["tokenizer"]
    if tok["kind"] == "byte":
        return PAD_ID
    return int(tok["eos_id"]) if tok.get("eos_id") is not None else 0


def check_vocab(shard_set: ShardSet, vocab_size: int | None, vocab_multiple: int, key: str) -> None:
    """Refuses a model vocabulary smaller than the shard set's tokenizer's.

    Raises:
      ConfigError: `vocab_size` < the manifest's vocab_size, naming the size to set (rounded up to a multiple of
        `vocab_multiple`, mesh.tensor).
    """
    need = shard_set.vocab_size
    if vocab_size is None or vocab_size >= need:
        return
    fix = -(-need // vocab_multiple) * vocab_multiple
    multiple = f", a multiple of mesh.tensor={vocab_multiple}" if vocab_multiple > 1 else ""
    raise ConfigError(
        f"{key}={shard_set.directory!r} was tokenized with a {shard_set.manifest['tokenizer']['kind']} tokenizer of "
        f"{need} ids, but model.vocab_size={vocab_size}; set model.vocab_size={fix} (at least {need}{multiple})"
    )


def shard_splits(
    cfg: DataConfig, vocab_size: int | None = None, vocab_multiple: int = 1
) -> tuple[ShardRows, ShardRows, ShardSet]:
    """(train rows, validation rows, the training shard set) of a `data.source: shards` config (module docstring).

    Raises:
      ConfigError: `data.path` (or `data.validation_path`) is not a complete shard set, its tokenizer has more
        ids than `vocab_size`, the validation set was made with another tokenizer or BOS/EOS choice, or the
        set holds fewer than 2 documents (with no validation_path).
    """
    train_set = _open_set(cfg.path, "data.path")
    check_vocab(train_set, vocab_size, vocab_multiple, "data.path")
    train_shards = _Shards(train_set)
    pad = pad_id_for(train_set)
    masking = cfg.document_masking
    if cfg.validation_path:
        val_set = _open_set(cfg.validation_path, "data.validation_path")
        same = ("tokenizer", "add_bos", "add_eos")
        differ = [k for k in same if train_set.manifest[k] != val_set.manifest[k]]
        if differ:
            raise ConfigError(
                f"data.validation_path={cfg.validation_path!r} was tokenized differently from data.path={cfg.path!r} "
                f"({', '.join(differ)} differ); tokenize both with the same --tokenizer and options"
            )
        if train_set.num_documents < 1 or val_set.num_documents < 1:
            raise ConfigError("data.path and data.validation_path must each hold at least one document; add data")
        train = ShardRows(train_shards, 0, train_set.num_documents, cfg.seq_len, masking, pad)
        val = ShardRows(_Shards(val_set), 0, val_set.num_documents, cfg.seq_len, masking, pad)
        return train, val, train_set
    d = train_set.num_documents
    if d < 2:
        raise ConfigError(
            f"data.path={cfg.path!r} holds {d} document(s), which cannot be split into train and validation; "
            f"tokenize more documents, or give a validation shard set as data.validation_path"
        )
    split = _split_document(train_shards, cfg.validation_fraction)
    train = ShardRows(train_shards, 0, split, cfg.seq_len, masking, pad)
    val = ShardRows(train_shards, split, d, cfg.seq_len, masking, pad)
    return train, val, train_set


def _split_document(shards: _Shards, validation_fraction: float) -> int:
    """The first validation document: the tail documents [split, documents) are the fewest whole documents holding at
    least `validation_fraction` of the tokens; 1 <= split <= documents - 1."""
    total, d = int(shards.first_token[-1]), int(shards.first_doc[-1])
    boundary = total - int(np.ceil(total * validation_fraction))  # validation starts at or before this position
    split = shards.document_at(boundary) if boundary < total else d - 1
    return min(max(split, 1), d - 1)
