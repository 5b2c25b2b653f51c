"""Offline tokenization of a corpus into a token shard set (`jaxpar.data.shards` describes the format), in parallel,
resumable, and with the same bytes whatever the number of workers.

How: the main process reads the input in order (`jaxpar.data.corpus_files`) and hands chunks of documents to a
pool of worker processes (spawned; each builds the tokenizer once from the shard set's copy of the file); results
come back in submission order, and only the main process decides where shards end (from token counts alone) and
writes them. The output therefore depends on the input, the tokenizer and the options, never on the worker count
or on timing. At most 4 chunks per worker are in flight, so memory stays bounded whatever the corpus size.

Resume: the manifest is rewritten (atomically) after each shard, listing the finished shards with their SHA-256
and the input position after each. A rerun into the same directory checks that the tokenizer, input and options
are the same (else it refuses: shards of two tokenizers or corpora are never mixed), keeps the leading shards whose
files match their checksums, and continues from the position after the last of them; the shards it writes are the
ones an uninterrupted run writes. A finished set is left as it is.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxpar.config.paths import output_dir_problem
from jaxpar.data import corpus_files, shards
from jaxpar.data.errors import DataError
from jaxpar.data.shards import file_sha256
from jaxpar.data.text_tokenizer import load_tokenizer, parse_tokenizer_spec, tokenizer_identity
from jaxpar.data.tokenizer_spec import TokenizerSpec

_log = logging.getLogger("jaxpar.data")
CHUNK_DOCUMENTS = 256  # a chunk handed to a worker: at most this many documents ...
CHUNK_BYTES = 4 << 20  # ... or this many input bytes (a longer document is a chunk of its own)
IN_FLIGHT_PER_WORKER = 4
DEFAULT_SHARD_TOKENS = 100_000_000


@dataclasses.dataclass(frozen=True)
class TokenizeOptions:
    """What `jaxpar-data tokenize` was asked to do (its flags say the same).

    Attributes:
      inputs: files, directories or glob patterns. out: the shard set directory.
      tokenizer: `byte`, `KIND:PATH` or a tokenizer file path (`jaxpar.data.text_tokenizer.parse_tokenizer_spec`).
      format: auto, text, jsonl or parquet. field: the JSONL key / Parquet column holding the text.
      shard_tokens: a shard's bound in tokens (documents are not split: a longer document is a shard of its own).
      workers: worker processes (None: os.cpu_count(); 1 tokenizes in this process).
      token_dtype: auto, uint16 or uint32.
      add_bos, add_eos: put the tokenizer's BOS / EOS around each document (None: when the tokenizer has one).
      bos_token, eos_token: hf / sentencepiece: the token strings to use as BOS / EOS.
      tiktoken_pattern: tiktoken: the known encoding whose split pattern the ranks file was made with.
      progress: show a progress bar (tqdm, on stderr).
    """

    inputs: tuple[str, ...]
    out: str
    tokenizer: str
    format: str = "auto"
    field: str = "text"
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    workers: int | None = None
    token_dtype: str = "auto"
    add_bos: bool | None = None
    add_eos: bool | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    tiktoken_pattern: str | None = None
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class TokenizeResult:
    """`manifest` as written; `seconds`, `tokens_written`, `documents_written` and `shards_written` of this run
    (0 when the set was already complete); `shards_kept`, the finished shards found and verified."""

    manifest: dict
    seconds: float
    tokens_written: int
    documents_written: int
    shards_written: int
    shards_kept: int


@dataclasses.dataclass(frozen=True)
class _WorkerConfig:
    spec: TokenizerSpec
    format: str
    field: str  # the JSONL key ("" for text and Parquet, whose records arrive as their text)
    files: tuple[str, ...]
    bos: int | None  # the id put before each document, or None
    eos: int | None
    vocab_size: int
    dtype: str


_WORKER: dict = {}


def _exit_with_parent(parent: int, every_s: float = 0.5) -> None:
    """Ends this worker process once `parent` is gone (a killed command must not leave workers behind: they
    would wait on the task queue forever)."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _init_worker(config: _WorkerConfig, pool: bool) -> None:
    if pool:
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the main process, which stops the pool
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
        _exit_with_parent(os.getppid())
    _WORKER["config"] = config
    _WORKER["tokenizer"] = load_tokenizer(config.spec)


def _encode_chunk(chunk: list[tuple[int, int, bytes | str]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokenizes a chunk of records (file index, record index, payload) in a worker.

    Returns (lengths int64 [R]: tokens of each record's document with BOS / EOS, -1 for a document without text;
    tokens `dtype` [sum of lengths >= 0]: the documents one after another; invalid bool [R]: bytes that were not
    UTF-8).

    Raises:
      DataError: a JSONL line is not an object with the field as a string, or the tokenizer gave an id outside
        its vocabulary.
    """
    cfg: _WorkerConfig = _WORKER["config"]
    tok = _WORKER["tokenizer"]
    texts, invalid = [], np.zeros(len(chunk), bool)
    for r, (file, record, payload) in enumerate(chunk):
        if isinstance(payload, str):  # a Parquet row's text
            text = payload
        elif cfg.format == "jsonl":
            text, invalid[r] = corpus_files.jsonl_text(payload, cfg.files[file], record, cfg.field)
        else:
            try:
                text = payload.decode("utf-8")
            except UnicodeDecodeError:
                text, invalid[r] = payload.decode("utf-8", errors="replace"), True
        texts.append(text)
    nonempty = [t for t in texts if t]
    encode_batch = getattr(tok, "encode_batch", None)
    encoded = iter(encode_batch(nonempty) if encode_batch else [tok.encode(t) for t in nonempty])
    bos = [np.array([cfg.bos], np.int64)] if cfg.bos is not None else []
    eos = [np.array([cfg.eos], np.int64)] if cfg.eos is not None else []
    lengths, pieces = np.full(len(chunk), -1, np.int64), []
    for r, text in enumerate(texts):
        if text:
            ids = np.asarray(next(encoded), np.int64)
            pieces += [*bos, ids, *eos]
            lengths[r] = len(ids) + len(bos) + len(eos)
    flat = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= cfg.vocab_size):
        raise DataError(
            f"the tokenizer gave ids in [{flat.min()}, {flat.max()}], outside its vocabulary of {cfg.vocab_size}; "
            f"the tokenizer file is inconsistent: check it"
        )
    return lengths, flat.astype(cfg.dtype), invalid


def _chunks(records: Iterator[corpus_files.Record]) -> Iterator[list[corpus_files.Record]]:
    chunk, size = [], 0
    for rec in records:
        chunk.append(rec)
        size += len(rec.payload)
        if len(chunk) >= CHUNK_DOCUMENTS or size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _payloads(chunk: list[corpus_files.Record]) -> list[tuple[int, int, bytes | str]]:
    return [(r.file, r.record, r.payload) for r in chunk]


def _in_order(chunks, workers: int, config: _WorkerConfig):
    """(chunk, result) pairs in input order; `workers` > 1 spreads them over a spawned process pool."""
    if workers == 1:
        _init_worker(config, pool=False)
        for chunk in chunks:
            yield chunk, _encode_chunk(_payloads(chunk))
        return
    import concurrent.futures
    import multiprocessing

    pool = concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker, initargs=(config, True)
    )
    try:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            pending.append((chunk, pool.submit(_encode_chunk, _payloads(chunk))))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                chunk0, future = pending.popleft()
                yield chunk0, future.result()
        while pending:
            chunk0, future = pending.popleft()
            yield chunk0, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _manifest(identity: dict, complete: bool, entries: list[dict]) -> dict:
    """The manifest (`jaxpar.data.shards` states its keys): the identity, then the totals, then the shards."""
    totals = {
        key: sum(int(s[key]) for s in entries)
        for key in ("tokens", "documents", "empty_documents", "invalid_utf8_documents")
    }
    return {**identity, "complete": complete, **totals, "shards": entries}


def _write_shard(directory: str, index: int, pieces: list[np.ndarray], lengths: list[int], dtype: np.dtype) -> dict:
    """Writes shard `index` (tokens and offsets, each atomically); returns its manifest entry without `end` and
    the per-shard counts."""
    tokens_file, offsets_file = shards.shard_names(index)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return {
        "tokens_file": tokens_file,
        "offsets_file": offsets_file,
        "tokens": int(offsets[-1]),
        "documents": len(lengths),
        "tokens_sha256": shards.write_npy(os.path.join(directory, tokens_file), pieces, dtype),
        "offsets_sha256": shards.write_npy(os.path.join(directory, offsets_file), [offsets], np.dtype(np.int64)),
    }


def _resolve(opts: TokenizeOptions) -> tuple[TokenizerSpec, corpus_files.Corpus, dict, _WorkerConfig, int]:
    """Every check that needs no output: (spec, corpus, manifest identity, worker config without its tokenizer
    copy, workers)."""
    if opts.shard_tokens < 1:
        raise DataError(f"--shard-tokens {opts.shard_tokens} must be at least 1 (e.g. 100000000)")
    workers = (os.cpu_count() or 1) if opts.workers is None else opts.workers
    if workers < 1:
        raise DataError(f"--workers {workers} must be at least 1")
    spec = parse_tokenizer_spec(opts.tokenizer, opts.tiktoken_pattern, opts.bos_token, opts.eos_token)
    corpus = corpus_files.find_corpus(list(opts.inputs), opts.format, opts.field)
    corpus_files.check_corpus(corpus)
    tokenizer = load_tokenizer(spec)
    identity = tokenizer_identity(spec, tokenizer)
    add = {}
    for what, asked, special in (("bos", opts.add_bos, tokenizer.bos_id), ("eos", opts.add_eos, tokenizer.eos_id)):
        if asked and special is None:
            raise DataError(
                f"--add-{what}: this {spec.kind} tokenizer has no {what.upper()} token; name one with "
                f"--{what}-token (hf, sentencepiece) or use --no-add-{what}"
            )
        add[what] = special is not None if asked is None else bool(asked)
    dtype = shards.token_dtype_for(identity["vocab_size"], opts.token_dtype)
    copy = os.path.join("tokenizer", os.path.basename(spec.path)) if spec.path else None
    manifest = {
        "format": shards.FORMAT,
        "format_version": shards.FORMAT_VERSION,
        "tokenizer": {**identity, "file": copy},
        "add_bos": add["bos"],
        "add_eos": add["eos"],
        "token_dtype": dtype.name,
        "shard_tokens": int(opts.shard_tokens),
        "input": corpus.describe(),
    }
    config = _WorkerConfig(
        dataclasses.replace(
            spec, fixed_ids=True, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pattern=identity["pattern"]
        ),
        corpus.format,
        corpus.record_field if corpus.format == "jsonl" else "",
        corpus.files,
        tokenizer.bos_id if add["bos"] else None,
        tokenizer.eos_id if add["eos"] else None,
        identity["vocab_size"],
        dtype.name,
    )
    return spec, corpus, manifest, config, workers


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


def _check_not_foreign(out: str) -> None:
    """Raises DataError when the directory `out` holds files but no manifest (it is not a shard set)."""
    if os.path.isfile(os.path.join(out, shards.MANIFEST)):
        return
    strays = [n for n in os.listdir(out) if n != ".lock" and not n.endswith(shards.PARTIAL)]
    if strays:
        raise DataError(
            f"--out {out} is a non-empty directory that is not a jaxpar token shard set (it holds "
            f"{', '.join(sorted(strays)[:5])}); choose a new or empty directory"
        )


def _prepare_output(out: str, identity: dict) -> tuple[bool, list[dict]]:
    """(complete, finished shards to keep) of the existing directory `out`: none for a new or empty one, else the
    leading shards of its manifest whose files match their checksums.

    Raises:
      DataError: `out` is a non-empty directory that is not a shard set, or a shard set of another tokenizer,
        input or options.
    """
    _check_not_foreign(out)
    if not os.path.isfile(os.path.join(out, shards.MANIFEST)):
        return False, []
    old = shards.read_manifest(out)
    differ = _differences({k: old.get(k) for k in shards.IDENTITY_KEYS}, identity)
    if differ:
        raise DataError(
            f"--out {out} holds shards made with another tokenizer, input or options (they differ in "
            f"{', '.join(differ[:8])}); choose another --out, or delete {out} to tokenize again"
        )
    kept = []
    for i, entry in enumerate(old.get("shards", [])):
        if not shards.shard_files_ok(out, entry):
            _log.warning("shard %d of %s is missing or fails its checksum: tokenizing again from there", i, out)
            break
        kept.append(entry)
    return bool(old.get("complete")) and len(kept) == len(old.get("shards", [])), kept


def _copy_tokenizer(out: str, spec: TokenizerSpec, identity: dict) -> str | None:
    """Copies the tokenizer file into the set (once); returns the copy's absolute path (None for byte).

    Raises:
      DataError: the file changed while it was being copied.
    """
    info, source = identity["tokenizer"], spec.path
    if info["file"] is None or source is None:  # the byte tokenizer has no file
        return None
    dest = os.path.join(out, info["file"])
    if os.path.isfile(dest) and file_sha256(dest) == info["sha256"]:
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    shutil.copyfile(source, dest + shards.PARTIAL)
    if file_sha256(dest + shards.PARTIAL) != info["sha256"]:
        raise DataError(f"{spec.path} changed while it was being copied; run the command again")
    os.replace(dest + shards.PARTIAL, dest)
    return dest


def _remove_partials(out: str) -> None:
    for d, _, names in os.walk(out):
        for name in names:
            if name.endswith(shards.PARTIAL):
                os.remove(os.path.join(d, name))


def tokenize_corpus(opts: TokenizeOptions) -> TokenizeResult:
    """Tokenizes `opts.inputs` into the shard set `opts.out` (module docstring), or continues an interrupted run.

    Returns a `TokenizeResult` with the final manifest.

    Raises:
      DataError: bad input, found before any tokenizing (missing inputs, an unknown tokenizer kind or pattern, a
        JSONL file whose first line lacks the field, a Parquet file without the column, a vocabulary too large
        for --token-dtype, an output directory holding something else), or while reading (a later JSONL line
        without the field, a null Parquet cell); the shards finished until then are kept.
      KeyboardInterrupt: after stopping the workers; the finished shards are kept and a rerun continues.
    """
    out = os.path.abspath(opts.out)
    if os.path.isdir(out):
        _check_not_foreign(out)
    problem = output_dir_problem(out)  # a file in the way, no permission, a read-only file system
    if problem is not None:
        raise DataError(f"--out {opts.out!r} {problem}; give a directory you can write for the shard set")
    spec, corpus, identity, config, workers = _resolve(opts)
    t0 = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    with shards.exclusive(out):
        complete, entries = _prepare_output(out, identity)
        kept = len(entries)
        if complete:
            manifest = _manifest(identity, True, entries)
            _log.info("%s is already complete: %d shards, %d tokens; nothing to do", out, kept, manifest["tokens"])
            return TokenizeResult(manifest, time.perf_counter() - t0, 0, 0, 0, kept)
        _remove_partials(out)
        shards.write_json(os.path.join(out, shards.MANIFEST), _manifest(identity, False, entries))
        copy = _copy_tokenizer(out, spec, identity)
        config = dataclasses.replace(config, spec=dataclasses.replace(config.spec, path=copy))
        if kept:
            _log.info("%s: %d finished shards verified; continuing after them", out, kept)
        written = _run(out, corpus, identity, entries, config, workers, opts)
    seconds = time.perf_counter() - t0
    manifest = _manifest(identity, True, entries)
    if manifest["invalid_utf8_documents"]:
        _log.warning(
            "%d of %d documents were not valid UTF-8 (each bad byte sequence became U+FFFD): binary files among "
            "the inputs? manifest.json counts them per shard",
            manifest["invalid_utf8_documents"],
            manifest["documents"],
        )
    return TokenizeResult(manifest, seconds, *written, kept)


def _run(
    out: str,
    corpus: corpus_files.Corpus,
    identity: dict,
    entries: list[dict],
    config: _WorkerConfig,
    workers: int,
    opts: TokenizeOptions,
) -> tuple[int, int, int]:
    """Tokenizes from the position after the finished shards `entries` (appended to) to the end of the input;
    returns (tokens, documents, shards) written."""
    from tqdm import tqdm

    dtype = np.dtype(config.dtype)
    manifest_path = os.path.join(out, shards.MANIFEST)
    start, start_bytes = ((0, 0), 0)
    if entries:
        end = entries[-1]["end"]
        start, start_bytes = (end["file"], end["record"]), end["input_bytes"]
    written = [0, 0, 0]
    state: dict[str, Any] = {"pieces": [], "lengths": [], "tokens": 0, "empty": 0, "invalid": 0}

    def close(end: tuple[int, int], input_bytes: int) -> None:
        entry = _write_shard(out, len(entries), state["pieces"], state["lengths"], dtype)
        entry.update(
            empty_documents=state["empty"],
            invalid_utf8_documents=state["invalid"],
            end={"file": end[0], "record": end[1], "input_bytes": input_bytes},
        )
        entries.append(entry)
        shards.write_json(manifest_path, _manifest(identity, False, entries))
        written[0] += entry["tokens"]
        written[1] += entry["documents"]
        written[2] += 1
        state.update(pieces=[], lengths=[], tokens=0, empty=0, invalid=0)

    bar = tqdm(
        total=sum(corpus.sizes),
        initial=start_bytes,
        unit="B",
        unit_scale=True,
        desc="tokenize",
        disable=not opts.progress,
        dynamic_ncols=True,
    )
    after, after_bytes = start, start_bytes
    results = _in_order(_chunks(corpus_files.records(corpus, start)), workers, config)
    with bar, contextlib.closing(results):
        for chunk, (lengths, flat, invalid) in results:
            pos = 0
            for rec, n, bad in zip(chunk, lengths.tolist(), invalid.tolist()):
                if n >= 0 and state["lengths"] and state["tokens"] + n > opts.shard_tokens:
                    close(after, after_bytes)
                if n < 0:
                    state["empty"] += 1
                else:
                    state["pieces"].append(flat[pos : pos + n])
                    state["lengths"].append(n)
                    state["tokens"] += n
                    state["invalid"] += int(bad)
                    pos += n
                after, after_bytes = rec.after, rec.input_bytes
            bar.update(after_bytes - bar.n)
            bar.set_postfix(shards=len(entries), tokens=sum(e["tokens"] for e in entries) + state["tokens"])
    # A finished shard ends just before a document with text, so after the last finished shard at least one
    # such document follows, unless that shard was the last one.
    if state["lengths"]:
        close((len(corpus.files), 0), sum(corpus.sizes))
    if not entries:
        raise DataError(f"the input under {corpus.root} holds no document with text; give files holding text")
    shards.write_json(manifest_path, _manifest(identity, True, entries))
    return written[0], written[1], written[2]
