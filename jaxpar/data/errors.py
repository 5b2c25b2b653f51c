"""The error the offline data tools raise for bad input: it names the problem and the fix."""

from __future__ import annotations


class DataError(ValueError):
    """Bad input to `jaxpar-data` (a missing file, an unknown tokenizer, a JSONL line without the field, an output
    directory holding another shard set, ...). The message names the problem and how to fix it."""
