"""Data pipeline: byte tokenizer, corpus sources, packing, a Grain-ordered sharded loader, a one-pass
validation loader, a loader over a script's own iterator, offline tokenization into token shards
(`jaxpar.data.tokenize_corpus`, `jaxpar.data.shards`, `jaxpar.data.text_tokenizer`), and a shard set's rows
packed lazily for the loaders (`jaxpar.data.stream`, `data.source: shards`), and weighted mixtures of sources
(`jaxpar.data.mixture`, `data.sources`).

Imports are lazy: `import jaxpar.data` (or one of its jax-free modules, such as the tokenizers and the shard
format, which `jaxpar-data` and its worker processes load) does not import jax.
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "BOS_ID": "jaxpar.data.tokenizer",
    "BYTE_VOCAB": "jaxpar.data.tokenizer",
    "ByteTokenizer": "jaxpar.data.tokenizer",
    "DataInfo": "jaxpar.data.info",
    "DataLoader": "jaxpar.data.loader",
    "EOS_ID": "jaxpar.data.tokenizer",
    "EvalLoader": "jaxpar.data.loader",
    "IteratorLoader": "jaxpar.data.iterator",
    "MixtureEvalLoader": "jaxpar.data.mixture",
    "MixtureLoader": "jaxpar.data.mixture",
    "PAD_ID": "jaxpar.data.tokenizer",
    "PackedRows": "jaxpar.data.loader",
    "ShardRows": "jaxpar.data.stream",
    "build_loaders": "jaxpar.data.build",
    "load_tokens": "jaxpar.data.sources",
    "pack": "jaxpar.data.packing",
    "shard_splits": "jaxpar.data.stream",
    "split_documents": "jaxpar.data.sources",
    "unigram_entropy": "jaxpar.data.stats",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'jaxpar.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
