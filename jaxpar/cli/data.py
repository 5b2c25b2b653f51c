"""`jaxpar-data tokenize INPUT ... --tokenizer TOKENIZER --out DIR`: tokenize text, JSONL or Parquet once, offline,
into a directory of memory-mappable token shards with a manifest (`jaxpar.data.shards` describes the format).

INPUT: files, directories (every file in them, recursively) or quoted glob patterns. One text file is one
document; with JSONL one line is one document (its --field), with Parquet one row (its --field column). The format
follows from the file names (.jsonl / .ndjson, .parquet, else text) or from --format.

TOKENIZER: `byte` (jaxpar's byte-level tokenizer), a Hugging Face tokenizer.json (or the directory holding it), a
tiktoken .tiktoken ranks file (with --tiktoken-pattern naming the encoding whose split pattern it uses, unless it
is a published file such as cl100k_base's), or a SentencePiece .model; `KIND:PATH` names the kind explicitly
(hf, tiktoken, sentencepiece). Nothing is downloaded. The set keeps a copy of the tokenizer file. The byte
tokenizer and text / JSONL input need nothing more; the other tokenizers and Parquet input need the `data` extra
(pip install 'jaxpar[data]'), which the error names when it is missing.

Runs over all cores (--workers) with a progress bar. Interrupted (Ctrl-C, a kill), the same command continues from
the finished shards; run again when finished, it does nothing; pointed at a directory holding shards of another
tokenizer, input or options, it refuses. The result does not depend on --workers.

Examples:
  jaxpar-data tokenize 'jaxpar/**/*.py' 'tools/*.py' --tokenizer byte --out runs/data/jaxpar_src

Exit status: 0; 2 for bad input or a missing extra (the message names the problem and the fix); 130 when
interrupted.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxpar.config.data_sources import TOKEN_DTYPES
from jaxpar.data.corpus_files import FORMATS

COMMANDS = ("tokenize",)


def tokenize_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxpar-data tokenize", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files, directories or quoted glob patterns")
    p.add_argument("--tokenizer", required=True, help="byte, a tokenizer file (.json, .tiktoken, .model) or KIND:PATH")
    p.add_argument("--out", required=True, help="output directory of the shard set")
    p.add_argument("--format", default="auto", choices=("auto", *FORMATS), help="input format (default: auto)")
    p.add_argument(
        "--field", "--column", dest="field", default="text", help="JSONL key / Parquet column of the text (text)"
    )
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=None,
        help="tokens per shard at most, unless one document is longer (default 100000000)",
    )
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: os.cpu_count())")
    p.add_argument("--token-dtype", default="auto", choices=("auto", *TOKEN_DTYPES), help="id dtype (auto)")
    p.add_argument(
        "--add-bos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="open each document with BOS (default: when the tokenizer has one)",
    )
    p.add_argument(
        "--add-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="close each document with EOS (default: when the tokenizer has one)",
    )
    p.add_argument(
        "--bos-token",
        default=None,
        help="hf / sentencepiece: the token string to use as BOS (default: the one the tokenizer's own post_processor "
        "puts before a text, none for Qwen; docs/data.md)",
    )
    p.add_argument(
        "--eos-token",
        default=None,
        help="hf / sentencepiece: the token string to use as EOS (default: the family's end of text, not a chat "
        "end-of-turn token; docs/data.md)",
    )
    p.add_argument(
        "--tiktoken-pattern",
        default=None,
        help="tiktoken: the encoding whose split pattern the ranks use (gpt2, r50k_base, p50k_base, cl100k_base, "
        "o200k_base)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _top_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxpar-data", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("command", choices=COMMANDS, help="tokenize: text, JSONL or Parquet -> token shards")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        _top_parser().parse_args(argv[:1])  # prints usage (or help) and exits 2 (0 for --help)
        return 2
    args = tokenize_parser().parse_args(argv[1:])

    from jaxpar.config.extras import MissingExtra
    from jaxpar.data.errors import DataError
    from jaxpar.data.tokenize_corpus import DEFAULT_SHARD_TOKENS, TokenizeOptions, tokenize_corpus
    from jaxpar.log import configure_logging

    configure_logging()
    log = logging.getLogger("jaxpar.data")
    opts = TokenizeOptions(
        inputs=tuple(args.inputs),
        out=args.out,
        tokenizer=args.tokenizer,
        format=args.format,
        field=args.field,
        shard_tokens=DEFAULT_SHARD_TOKENS if args.shard_tokens is None else args.shard_tokens,
        workers=args.workers,
        token_dtype=args.token_dtype,
        add_bos=args.add_bos,
        add_eos=args.add_eos,
        bos_token=args.bos_token,
        eos_token=args.eos_token,
        tiktoken_pattern=args.tiktoken_pattern,
        progress=not args.no_progress,
    )
    try:
        result = tokenize_corpus(opts)
    except (DataError, MissingExtra) as e:
        print(f"jaxpar-data tokenize: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"jaxpar-data tokenize: interrupted; the finished shards in {args.out} are kept: run the same command "
            f"again to continue",
            file=sys.stderr,
        )
        return 130
    m = result.manifest
    if result.shards_written:
        rate = result.tokens_written / result.seconds if result.seconds > 0 else float("nan")
        log.info(
            "wrote %d shards (%d documents, %d tokens) in %.1f s: %.3g tokens/s with %s workers",
            result.shards_written,
            result.documents_written,
            result.tokens_written,
            result.seconds,
            rate,
            args.workers or os.cpu_count(),
        )
    log.info(
        "%s: %d documents, %d tokens (%s, vocabulary %d) in %d shards; manifest.json lists them with checksums",
        os.path.abspath(args.out),
        m["documents"],
        m["tokens"],
        m["token_dtype"],
        m["tokenizer"]["vocab_size"],
        len(m["shards"]),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
