"""A script's own data: any iterator of process-local batches with checkpointable state, served as global batches.

The iterator follows Grain's iterator protocol: `next(it)` gives this process's rows of the next global batch,
`it.get_state()` a JSON-safe dict (or bytes, as `grain.DataLoader`'s iterators give) from which `it.set_state`
resumes exactly. A Grain `DatasetIterator` (`iter(grain.MapDataset...)`), a `grain.DataLoader` iterator or a
hand-written class all fit.

Batches: {"inputs": int [R, T], "targets": int [R, T], "loss_mask": float [R, T]} with R = `local_rows` rows, this
process's share of the global batch of B sequences (the `jaxpar` glossary's B; B / number of processes when the
batch is split evenly over the processes' devices, as jaxpar's mesh does); T the sequence length. Token ids are cast
to int32 and the mask to float32; `loss_mask` 0 excludes a position from the loss. A batch may also carry
"segment_ids" (int [R, T], packed documents numbered within each row: attention and rotary positions then stay
within each document, `jaxpar.data.pack`). `IteratorLoader` assembles the global [B, T] arrays with
`jax.make_array_from_process_local_data`, exactly as the built-in `DataLoader` does.

State in a checkpoint: each process's iterator state, gathered to every process (`multihost_utils`), so process
p resumes from its own. Restoring onto another process count is refused unless every process had the same state
(an iterator whose state does not depend on the process).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import jax
import numpy as np

from jaxpar.data.batch import BATCH_DTYPES, BATCH_KEYS, SEGMENT_IDS
from jaxpar.data.loader import _process_rows, global_arrays


class StatefulIterator(Protocol):
    """Grain's iterator protocol (module docstring): `next(it)`, `it.get_state()`, `it.set_state(state)`."""

    def __next__(self) -> Any: ...

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...


def _encode(state: Any) -> dict:
    if isinstance(state, (bytes, bytearray)):
        return {"bytes": bytes(state).decode("utf-8")}
    try:
        json.dumps(state)
    except TypeError as e:
        raise TypeError(f"the data iterator's get_state() must return JSON-safe values or bytes, got {e}") from e
    return {"json": state}


def _decode(entry: dict) -> Any:
    return entry["bytes"].encode("utf-8") if "bytes" in entry else entry["json"]


class IteratorLoader:
    """Serves global batches {"inputs", "targets": int32 [B, T], "loss_mask": float32 [B, T]} from an iterator of
    process-local batches (module docstring), with the `next_batch` / `get_state` / `set_state` interface of
    `jaxpar.data.DataLoader`.

    Args:
      iterator: yields this process's rows of each global batch; has `get_state()` and `set_state(state)`.
      global_batch_size: B, sequences per batch over all processes.
      seq_len: T.
      sharding: NamedSharding of each [B, T] batch array (the step plan's `batch_sharding`).

    Raises:
      TypeError: the iterator lacks `__next__`, `get_state` or `set_state`.
      ValueError: the batch rows cannot be split evenly over this process's devices.
    """

    def __init__(
        self, iterator: StatefulIterator, global_batch_size: int, seq_len: int, sharding: jax.sharding.NamedSharding
    ):
        missing = [name for name in ("__next__", "get_state", "set_state") if not hasattr(iterator, name)]
        if missing:
            raise TypeError(
                f"a data iterator needs __next__, get_state and set_state (Grain's iterator protocol); "
                f"{type(iterator).__name__} lacks {', '.join(missing)}"
            )
        self.iterator = iterator
        self.global_batch_size, self.seq_len = global_batch_size, seq_len
        self._sharding = sharding
        self._global_shape = (global_batch_size, seq_len)
        self.local_rows = len(_process_rows(sharding, self._global_shape))

    def _check(self, batch: Any) -> dict[str, np.ndarray]:
        if not isinstance(batch, dict) or any(k not in batch for k in BATCH_KEYS):
            got = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise ValueError(f"a data iterator must yield dicts with keys {list(BATCH_KEYS)}, got {got}")
        out = {}
        want = (self.local_rows, self.seq_len)
        for key in BATCH_KEYS + ((SEGMENT_IDS,) if SEGMENT_IDS in batch else ()):
            value = np.asarray(batch[key])
            if value.shape != want:
                raise ValueError(
                    f"data iterator batch[{key!r}] has shape {value.shape}; this process holds {want[0]} rows of "
                    f"the global batch of {self.global_batch_size} (the rows its devices hold) of "
                    f"{self.seq_len} tokens (data.seq_len): expected {want}"
                )
            if key != "loss_mask" and not np.issubdtype(value.dtype, np.integer):
                raise ValueError(f"data iterator batch[{key!r}] must hold integer token ids, got {value.dtype}")
            out[key] = value.astype(BATCH_DTYPES[key], copy=False)
        return out

    def next_batch(self) -> dict[str, jax.Array]:
        """The next global batch, each array of shape [B, T] placed with `sharding`.

        Raises:
          ValueError: the iterator's batch lacks a key, has another shape, or non-integer token ids.
          StopIteration: the iterator is exhausted.
        """
        local = self._check(next(self.iterator))
        return global_arrays(self._sharding, local, self._global_shape)

    def get_state(self) -> dict:
        """{"processes": [state of process 0, 1, ...]} (JSON-safe; bytes states are kept as UTF-8 text). Every
        process must call it (it gathers the states across processes)."""
        mine = json.dumps(_encode(self.iterator.get_state()), sort_keys=True)
        if jax.process_count() == 1:
            return {"processes": [json.loads(mine)]}
        from jax.experimental import multihost_utils

        raw = np.frombuffer(mine.encode("utf-8"), np.uint8)
        sizes = multihost_utils.process_allgather(np.array([raw.size], np.int64))
        padded = np.zeros(int(np.max(sizes)), np.uint8)
        padded[: raw.size] = raw
        gathered = multihost_utils.process_allgather(padded)
        return {
            "processes": [
                json.loads(bytes(row[: int(n)]).decode("utf-8"))
                for row, n in zip(np.asarray(gathered), np.asarray(sizes).reshape(-1))
            ]
        }

    def set_state(self, state: dict) -> None:
        """Resumes this process's iterator from a `get_state` dict.

        Raises:
          ValueError: `state` is not a `get_state` dict, or it holds another number of per-process states
            that are not all equal (the iterator's state depends on the process: resume with the same number
            of processes).
        """
        states = state.get("processes") if isinstance(state, dict) else None
        if not isinstance(states, list) or not states or not all(isinstance(s, dict) for s in states):
            raise ValueError(
                f"data iterator state must be {{'processes': [state, ...]}} from get_state(), got {state!r:.200}"
            )
        n, p = len(states), jax.process_count()
        if n != p and any(s != states[0] for s in states):
            raise ValueError(
                f"the checkpoint holds the data iterator states of {n} processes, which differ, but "
                f"this run has {p}; resume with {n} processes (a custom iterator's position is per "
                f"process)"
            )
        self.iterator.set_state(_decode(states[jax.process_index() if n == p else 0]))
