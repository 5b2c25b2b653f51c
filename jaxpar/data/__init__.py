"""Data pipeline: byte tokenizer, corpus sources, packing, a Grain-ordered sharded loader, a one-pass
validation loader, and a loader over a script's own iterator."""

from jaxpar.data.iterator import IteratorLoader
from jaxpar.data.loader import DataLoader, EvalLoader, build_loaders
from jaxpar.data.packing import pack
from jaxpar.data.sources import load_tokens, split_documents
from jaxpar.data.stats import unigram_entropy
from jaxpar.data.tokenizer import BOS_ID, BYTE_VOCAB, EOS_ID, PAD_ID, ByteTokenizer

__all__ = [
    "BOS_ID",
    "BYTE_VOCAB",
    "ByteTokenizer",
    "DataLoader",
    "EOS_ID",
    "EvalLoader",
    "IteratorLoader",
    "PAD_ID",
    "build_loaders",
    "load_tokens",
    "pack",
    "split_documents",
    "unigram_entropy",
]
