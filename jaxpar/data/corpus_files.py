"""The input of `jaxpar-data tokenize`: which files, in which format, read as documents in a fixed order.

Formats:
  text     one file is one document (any file: a directory is taken recursively, every regular file in it)
  jsonl    one line is one document: the string under `field` of the line's JSON object (blank lines skipped)
  parquet  one row is one document: the string in column `field` (read with pyarrow, of the `data` extra)

Files are sorted by their path relative to the input root (the deepest directory holding all of them); within a
file, lines or rows keep their order. A position in the input is (file index, record index): the line index
(0-based, blank lines counted) or row index within the file, 0 for a text file. `records(corpus, start)` reads
from a position, which is how an interrupted run continues.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Iterator

from jaxpar.config.extras import require
from jaxpar.data.errors import DataError

FORMATS = ("text", "jsonl", "parquet")
_SUFFIX_FORMAT = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
_PARQUET_BATCH_ROWS = 1024


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Input files in reading order.

    Attributes:
      format: one of `FORMATS`. field: the JSONL key / Parquet column (None for text).
      root: absolute directory the paths are relative to. files: sorted relative paths. sizes: their bytes.
    """

    format: str
    field: str | None
    root: str
    files: tuple[str, ...]
    sizes: tuple[int, ...]

    def path(self, index: int) -> str:
        return os.path.join(self.root, self.files[index])

    @property
    def record_field(self) -> str:
        """`field` of a JSONL or Parquet corpus, the key / column its records are read from.

        Raises:
          ValueError: a text corpus (its records are whole files).
        """
        if self.field is None:
            raise ValueError(f"a {self.format} corpus has no record field")
        return self.field

    def describe(self) -> dict:
        """The manifest's `input` entry: {format, field, root, files: [{path, bytes}], bytes}."""
        return {
            "format": self.format,
            "field": self.field,
            "root": self.root,
            "files": [{"path": p, "bytes": s} for p, s in zip(self.files, self.sizes)],
            "bytes": sum(self.sizes),
        }


@dataclasses.dataclass(frozen=True)
class Record:
    """One document's raw input: `payload` (bytes of a text file or of a JSONL line, str of a Parquet cell) at
    (`file`, `record`); `after` the position just past it and `input_bytes` the input bytes read up to there."""

    file: int
    record: int
    payload: bytes | str
    after: tuple[int, int]
    input_bytes: int


def _expand(spec: str) -> list[str]:
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    if os.path.isfile(path):
        return [path]
    return glob.glob(path, recursive=True)


def find_corpus(inputs: list[str], fmt: str = "auto", field: str = "text") -> Corpus:
    """The corpus that `inputs` (files, directories, glob patterns) name.

    `fmt` "auto" takes jsonl when every file ends in .jsonl / .ndjson, parquet when every file ends in .parquet,
    text otherwise.

    Raises:
      DataError: no inputs, an input that matches no file, an unknown format, or an automatic format with
        JSONL or Parquet files mixed with others.
    """
    if not inputs:
        raise DataError("no input given; name text files, a directory, a glob such as 'corpus/*.txt', or JSONL files")
    if fmt not in ("auto", *FORMATS):
        raise DataError(f"--format {fmt!r} is not one of auto, {', '.join(FORMATS)}")
    found: set[str] = set()
    for spec in inputs:
        files = [os.path.abspath(f) for f in _expand(spec) if os.path.isfile(f)]
        if not files:
            what = "a directory with no files in it" if os.path.isdir(os.path.expanduser(spec)) else "no file"
            raise DataError(
                f"input {spec!r} matches {what}; give an existing file, a directory of text files, or a glob "
                f"pattern (quote it: 'corpus/**/*.txt')"
            )
        found.update(files)
    files = sorted(found)
    root = os.path.commonpath([os.path.dirname(f) for f in files])
    kinds = {_SUFFIX_FORMAT.get(os.path.splitext(f)[1].lower(), "text") for f in files}
    if fmt == "auto":
        if len(kinds) > 1 and kinds & {"jsonl", "parquet"}:
            raise DataError(
                f"the inputs mix file types ({', '.join(sorted(kinds))} by their names); give one kind per run, "
                f"or force one with --format {'|'.join(FORMATS)}"
            )
        fmt = kinds.pop()
    rels = tuple(os.path.relpath(f, root).replace(os.sep, "/") for f in files)
    order = sorted(range(len(rels)), key=rels.__getitem__)
    return Corpus(
        fmt,
        None if fmt == "text" else field,
        root,
        tuple(rels[i] for i in order),
        tuple(os.path.getsize(files[i]) for i in order),
    )


def check_corpus(corpus: Corpus) -> None:
    """Checks what can be checked before tokenizing: the corpus holds bytes; each JSONL file's first non-blank
    line is a JSON object with a string under the field; each Parquet file has the field as a string column.
    (A later JSONL line without the field fails when it is read, naming its file and line.)

    Raises:
      DataError: naming the file (and line) and the fix.
    """
    if sum(corpus.sizes) == 0:
        raise DataError(f"the input files under {corpus.root} are all empty; give files holding text")
    for i, rel in enumerate(corpus.files):
        if corpus.format == "jsonl":
            with open(corpus.path(i), "rb") as f:
                for line_no, line in enumerate(f):
                    if line.strip():
                        jsonl_text(line, rel, line_no, corpus.record_field)
                        break
        elif corpus.format == "parquet":
            _parquet_column_check(corpus.path(i), rel, corpus.record_field)


def jsonl_text(line: bytes, rel: str, line_index: int, field: str) -> tuple[str, bool]:
    """(text under `field`, whether the line had bytes that are not UTF-8) of one JSONL line.

    Raises:
      DataError: the line is not a JSON object, lacks `field`, or its value is not a string.
    """
    invalid = False
    try:
        text_line = line.decode("utf-8")
    except UnicodeDecodeError:
        text_line, invalid = line.decode("utf-8", errors="replace"), True
    try:
        obj = json.loads(text_line)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{rel} line {line_index + 1} is not JSON ({e.msg}); JSONL input needs one JSON object per line"
        ) from None
    if not isinstance(obj, dict) or field not in obj:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise DataError(
            f"{rel} line {line_index + 1} has no field {field!r} (found {keys}); set --field to the key holding "
            f"the text"
        )
    value = obj[field]
    if not isinstance(value, str):
        raise DataError(
            f"{rel} line {line_index + 1}: field {field!r} holds a {type(value).__name__}, not a string; point "
            f"--field at the text"
        )
    return value, invalid


def _parquet_file(path: str, rel: str):
    pq = require("pyarrow.parquet", "Parquet input (--format parquet, .parquet files)")

    try:
        return pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 -- pyarrow raises several types for a file that is not Parquet
        raise DataError(f"{rel} is not a Parquet file ({e}); give .parquet files, or --format text / jsonl") from None


def _parquet_column_check(path: str, rel: str, field: str) -> None:
    pa = require("pyarrow", "Parquet input (--format parquet, .parquet files)")

    schema = _parquet_file(path, rel).schema_arrow
    if field not in schema.names:
        raise DataError(f"{rel} has no column {field!r} (columns: {schema.names}); set --field to the text column")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"):
        raise DataError(f"{rel}: column {field!r} holds {kind}, not strings; set --field to the text column")


def records(corpus: Corpus, start: tuple[int, int] = (0, 0)) -> Iterator[Record]:
    """The corpus's records from position `start` on, in order (module docstring).

    Raises:
      DataError: a Parquet cell is null, or a file cannot be read as its format.
    """
    before = sum(corpus.sizes[: start[0]])
    for i in range(start[0], len(corpus.files)):
        first = start[1] if i == start[0] else 0
        if corpus.format == "text":
            if first == 0:
                with open(corpus.path(i), "rb") as f:
                    payload = f.read()
                yield Record(i, 0, payload, (i + 1, 0), before + corpus.sizes[i])
        elif corpus.format == "jsonl":
            yield from _jsonl_records(corpus, i, first, before)
        else:
            yield from _parquet_records(corpus, i, first, before)
        before += corpus.sizes[i]


def _jsonl_records(corpus: Corpus, i: int, first: int, before: int) -> Iterator[Record]:
    with open(corpus.path(i), "rb") as f:
        done = 0
        for line_index, line in enumerate(f):
            done += len(line)
            if line_index < first or not line.strip():
                continue
            yield Record(i, line_index, line, (i, line_index + 1), before + done)


def _parquet_records(corpus: Corpus, i: int, first: int, before: int) -> Iterator[Record]:
    rel = corpus.files[i]
    pf = _parquet_file(corpus.path(i), rel)
    meta = pf.metadata
    total = max(meta.num_rows, 1)
    group, row = 0, 0
    while group < meta.num_row_groups and row + meta.row_group(group).num_rows <= first:
        row += meta.row_group(group).num_rows
        group += 1
    if group == meta.num_row_groups:
        return
    batches = pf.iter_batches(
        batch_size=_PARQUET_BATCH_ROWS, row_groups=list(range(group, meta.num_row_groups)), columns=[corpus.field]
    )
    for batch in batches:
        for value in batch.column(0).to_pylist():
            if row >= first:
                if value is None:
                    raise DataError(
                        f"{rel} row {row} has no text (null in column {corpus.field!r}); drop or fill such rows"
                    )
                yield Record(i, row, value, (i, row + 1), before + corpus.sizes[i] * (row + 1) // total)
            row += 1
