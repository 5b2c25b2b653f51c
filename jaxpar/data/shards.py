"""Token shard sets: the on-disk format `jaxpar-data tokenize` writes, and a memory-mapped reader.

A shard set is a directory:

  manifest.json                   what the set holds (below)
  shard-00000.tokens.npy          token ids of shard 0, 1-D, `token_dtype` (uint16 when the vocabulary has at most
                                  65,536 ids, else uint32): its documents one after another
  shard-00000.offsets.npy         int64 [documents + 1]: document d of the shard is tokens[offsets[d]:offsets[d+1]]
                                  (offsets[0] = 0, offsets[-1] = the shard's token count)
  shard-00001.tokens.npy ...
  tokenizer/FILE                  a copy of the tokenizer file (none for the byte tokenizer)

Both kinds of shard file are plain `.npy` arrays: `np.load(path, mmap_mode="r", allow_pickle=False)` maps them
without reading them. A document with BOS / EOS added (manifest `add_bos`, `add_eos`) starts / ends with those ids.
Documents are never split: a shard ends before the document that would take it past `shard_tokens`, so a shard
holds at most `shard_tokens` tokens unless one document alone is longer. Shards follow the input order (files
sorted by path relative to the input root, then lines or rows in file order), so the concatenation of all shards
is the corpus in order and global document k is the k-th over the shards.

manifest.json (JSON, `format_version` 1):
  format, format_version    "jaxpar-token-shards", 1
  complete                  false while `jaxpar-data tokenize` is writing (the shards listed are finished)
  tokenizer                 kind, source_path, sha256 (of the file), pattern (tiktoken), vocab_size, bos_id,
                            eos_id, file (its copy, relative to the set; null for byte)
  add_bos, add_eos          whether each document got BOS / EOS
  token_dtype               "uint16" or "uint32"
  shard_tokens              the bound on a shard's token count
  input                     format (text, jsonl, parquet), field (JSONL key / Parquet column), root (absolute),
                            files: [{path (relative to root), bytes}], bytes (their sum)
  tokens, documents         totals over the shards
  empty_documents, invalid_utf8_documents
                            documents skipped for holding no text; documents whose bytes were not UTF-8 (each bad
                            sequence became U+FFFD)
  shards                    [{tokens_file, offsets_file, tokens, documents, tokens_sha256, offsets_sha256,
                             empty_documents, invalid_utf8_documents, end}] with end = {file, record,
                            input_bytes}: the input position after the shard's last document (file index, line
                            or row within it) and the input bytes read up to there, from which a rerun continues

What identifies a set's data (`shard_set_digest`, recorded with a run's data position in its checkpoints) is the
SHA-256 of its shards' file checksums: the same digest means the same token files and document indexes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator, Sequence

import numpy as np

from jaxpar.config.data_sources import TOKEN_DTYPES
from jaxpar.data.errors import DataError

FORMAT = "jaxpar-token-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PARTIAL = ".partial"  # suffix of a file being written; renamed into place when complete
IDENTITY_KEYS = ("format", "format_version", "tokenizer", "add_bos", "add_eos", "token_dtype", "shard_tokens", "input")


def shard_names(index: int) -> tuple[str, str]:
    """(tokens file, offsets file) names of shard `index`."""
    return f"shard-{index:05d}.tokens.npy", f"shard-{index:05d}.offsets.npy"


def token_dtype_for(vocab_size: int, requested: str = "auto") -> np.dtype:
    """uint16 when every id of a `vocab_size` vocabulary fits (vocab_size <= 65,536), else uint32; `requested`
    ("auto" or one of `jaxpar.config.data_sources.TOKEN_DTYPES`) may force one.

    Raises:
      DataError: `requested` is not one of those, or cannot hold ids up to vocab_size - 1.
    """
    if requested not in ("auto", *TOKEN_DTYPES):
        raise DataError(f"--token-dtype {requested!r} is not one of auto, {', '.join(TOKEN_DTYPES)}")
    dtype = np.dtype(("uint16" if vocab_size <= 1 << 16 else "uint32") if requested == "auto" else requested)
    if vocab_size - 1 > np.iinfo(dtype).max:
        raise DataError(
            f"a vocabulary of {vocab_size} ids does not fit --token-dtype {requested} (ids up to "
            f"{np.iinfo(dtype).max}); use --token-dtype uint32 or auto"
        )
    return dtype


class _HashingFile:
    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data) -> None:
        self.sha.update(data)
        self.f.write(data)


def write_npy(path: str, pieces: Sequence[np.ndarray], dtype: np.dtype) -> str:
    """Writes the concatenation of 1-D `pieces` as a `.npy` array of `dtype` at `path`, atomically: into
    `path + PARTIAL`, flushed to disk, then renamed. The bytes equal `np.save`'s. Returns the file's hex SHA-256.

    Raises:
      ValueError: a piece holds a value `dtype` cannot represent (checked before anything is written).
    """
    dtype = np.dtype(dtype)
    for piece in pieces:
        if piece.size and np.issubdtype(piece.dtype, np.integer) and piece.dtype != dtype:
            lo, hi = int(piece.min()), int(piece.max())
            if lo < np.iinfo(dtype).min or hi > np.iinfo(dtype).max:
                raise ValueError(f"values in [{lo}, {hi}] do not fit {dtype.name}")
    n = sum(int(p.size) for p in pieces)
    tmp = path + PARTIAL
    with open(tmp, "wb") as raw:
        f = _HashingFile(raw)
        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (n,)}
        np.lib.format.write_array_header_1_0(f, header)
        for piece in pieces:
            f.write(np.ascontiguousarray(piece, dtype=dtype).tobytes())
        raw.flush()
        os.fsync(raw.fileno())
    os.replace(tmp, path)
    return f.sha.hexdigest()


def write_json(path: str, obj: dict) -> None:
    """Writes `obj` as indented JSON at `path` atomically (a `PARTIAL` file flushed, then renamed)."""
    tmp = path + PARTIAL
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(directory: str) -> dict:
    """The manifest of a shard set directory.

    Raises:
      DataError: no manifest.json, not JSON, not a jaxpar token shard set, or a newer format version.
    """
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise DataError(f"{directory} holds no {MANIFEST}; make a shard set with jaxpar-data tokenize")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except ValueError as e:
        raise DataError(f"{path} is not JSON ({e}); re-run jaxpar-data tokenize into a new directory") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path} is not a jaxpar token shard manifest (format {FORMAT!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{path} has format_version {manifest.get('format_version')!r}; this jaxpar reads version "
            f"{FORMAT_VERSION}: re-tokenize, or use the jaxpar that wrote it"
        )
    return manifest


def shard_set_digest(manifest: dict) -> str:
    """Hex SHA-256 of the UTF-8 text holding one line "TOKENS_SHA256 OFFSETS_SHA256\\n" per shard of `manifest`, in
    shard order: it identifies the token stream and document index a set holds (any other tokenizer, input, order
    or shard size gives other files) from the manifest alone, without reading the shards."""
    lines = "".join(f"{s['tokens_sha256']} {s['offsets_sha256']}\n" for s in manifest["shards"])
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file's bytes, read in 8 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 23):
            h.update(block)
    return h.hexdigest()


def shard_files_ok(directory: str, shard: dict) -> bool:
    """Whether both files of a manifest shard entry exist with their recorded SHA-256."""
    for kind in ("tokens", "offsets"):
        name, digest = shard[f"{kind}_file"], shard[f"{kind}_sha256"]
        path = os.path.join(directory, name)
        if not os.path.isfile(path) or file_sha256(path) != digest:
            return False
    return True


@contextlib.contextmanager
def exclusive(directory: str) -> Iterator[None]:
    """Holds an exclusive lock on `directory` (a `.lock` file in it, `fcntl.flock`) while writing.

    Raises:
      DataError: another process holds it.
    """
    import fcntl

    with open(os.path.join(directory, ".lock"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(
                f"another jaxpar-data process is writing {directory}; wait for it or use another --out"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class ShardSet:
    """A complete shard set, read through memory maps (nothing is loaded until its pages are touched).

    Attributes:
      directory, manifest: the set and its manifest.
      token_dtype: uint16 or uint32. vocab_size: the tokenizer's.
      num_shards, num_tokens, num_documents: totals.
      digest: what identifies its data (`shard_set_digest`).

    Raises:
      DataError: the directory is not a shard set, or its tokenization was not finished (rerun the command).
    """

    def __init__(self, directory: str):
        self.directory = directory
        self.manifest = read_manifest(directory)
        if not self.manifest.get("complete"):
            raise DataError(
                f"{directory} is an unfinished shard set (jaxpar-data tokenize was interrupted); rerun the same "
                f"command to finish it"
            )
        self.token_dtype = np.dtype(self.manifest["token_dtype"])
        self.vocab_size = int(self.manifest["tokenizer"]["vocab_size"])
        self._shards = self.manifest["shards"]
        self.num_shards = len(self._shards)
        self.num_tokens = int(self.manifest["tokens"])
        self.num_documents = int(self.manifest["documents"])
        self._first_doc = np.cumsum([0] + [s["documents"] for s in self._shards])
        self.digest = shard_set_digest(self.manifest)

    def _load(self, name: str, dtype: np.dtype, size: int) -> np.ndarray:
        path = os.path.join(self.directory, name)
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"{path} cannot be read ({e}); the shard set is damaged: re-tokenize") from None
        if array.dtype != dtype or array.shape != (size,):
            raise DataError(
                f"{path} holds {array.dtype.name} {array.shape}, the manifest says {dtype.name} ({size},): re-tokenize"
            )
        return array

    def tokens(self, shard: int) -> np.ndarray:
        """Token ids of shard `shard`: a read-only memory map, `token_dtype` [tokens of the shard]."""
        s = self._shards[shard]
        return self._load(s["tokens_file"], self.token_dtype, int(s["tokens"]))

    def offsets(self, shard: int) -> np.ndarray:
        """Document offsets of shard `shard` into `tokens(shard)`: a read-only memory map, int64 [documents + 1]."""
        s = self._shards[shard]
        return self._load(s["offsets_file"], np.dtype(np.int64), int(s["documents"]) + 1)

    def document(self, index: int) -> np.ndarray:
        """Tokens of global document `index` (0-based over all shards), with its BOS / EOS: a memory-mapped view.

        Raises:
          IndexError: `index` is outside [0, num_documents).
        """
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document {index} is outside [0, {self.num_documents})")
        shard = int(np.searchsorted(self._first_doc, index, side="right")) - 1
        offsets = self.offsets(shard)
        d = index - int(self._first_doc[shard])
        return self.tokens(shard)[int(offsets[d]) : int(offsets[d + 1])]

    def verify(self) -> None:
        """Checks every shard file against the SHA-256 in the manifest (reads every byte).

        Raises:
          DataError: naming the first shard whose files are missing or differ.
        """
        for i, s in enumerate(self._shards):
            if not shard_files_ok(self.directory, s):
                raise DataError(
                    f"shard {i} of {self.directory} ({s['tokens_file']}, {s['offsets_file']}) is missing or differs "
                    f"from its checksum; rerun the jaxpar-data tokenize command that made it"
                )
