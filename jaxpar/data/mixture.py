"""A weighted data mixture (`data.sources`): global batches whose rows are shared out among several row sources
by weight, exactly resumable, and each source's validation split scored separately.

Shape letters as in the `jaxpar` glossary; Q: the mixture's sources, B: the rows of a global batch.

Training (`MixtureLoader`): each global batch takes c_s rows from source s, placed in the batch as
`jaxpar.data.mixture_plan` says (largest-remainder counts carried over from batch to batch, so each source's
running total stays within one row of its weight's share of all rows so far; rows interleaved by stride
scheduling). Each source has its own sample stream (`jaxpar.data.loader.SampleOrder`: its N_s sequences shuffled
with a seed derived from `data.seed` and the source's index, a fresh shuffle each epoch) read at consecutive
positions: source s's rows of a batch are positions C_s .. C_s + c_s - 1 of its stream, C_s the rows it gave to
the batches before. Unlike a single-source `DataLoader`, a batch may straddle a source's epoch boundary (so a
source with fewer sequences than its rows in one batch repeats some within the batch). The state is
{"taken": {name: C_s}}: Q integers, none of which depends on the number of processes or on the batch size, so a
run resumes exactly on any process count, and with another `train.global_batch_size` each source's stream goes
on where it stopped and the shares stay within one row of the weights (a state saved by an earlier jaxpar also
holds "next_batch", which is not needed). The state also records, as "shard_set_sha256": {name: digest}, the
shard sets the sources are read from, checked on resume (`jaxpar.data.stream.check_shard_set`). Each process
reads only the rows its devices hold, each from its own source.

Validation (`MixtureEvalLoader`): one `EvalLoader` per source; a pass scores every source's split in turn, so a
token-mean over the whole pass (`val_loss`) is the mean over all sources' valid tokens (each source weighted by
its validation tokens, not by its mixture weight), and `jaxpar.training.hooks.evaluation.evaluate_sources`
reports each source's own mean (`val_loss/<name>`).
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np

from jaxpar.config import ConfigError
from jaxpar.data.batch import BATCH_DTYPES
from jaxpar.data.loader import EvalLoader, RowSource, SampleOrder, _process_rows, global_arrays
from jaxpar.data.mixture_plan import batch_counts, normalised, row_sources
from jaxpar.data.stream import SHARD_SET_KEY, check_shard_set


def source_seed(seed: int, index: int) -> int:
    """The shuffle seed of mixture source `index` under `data.seed` = `seed` (independent streams per source)."""
    return int(np.random.SeedSequence([seed % 2**32, index]).generate_state(1)[0])


class MixtureLoader:
    """Serves global batches {"inputs", "targets": int32 [B, T], "loss_mask": float32 [B, T]} (and "segment_ids":
    int32 [B, T] when the sources serve them) mixed from several row sources (module docstring), with the
    `next_batch` / `get_state` / `set_state` interface of `jaxpar.data.DataLoader`.

    Args:
      sources: {name: `RowSource`} (e.g. `jaxpar.data.PackedRows`, `jaxpar.data.ShardRows`), all of one T and
        the same batch keys, each with N_s >= 1 sequences.
      weights: {name: weight > 0}, normalised here.
      global_batch_size: B. sharding: NamedSharding of each [B, T] batch array. seed: `data.seed`.

    Raises:
      ConfigError: a source without sequences, or sources of different T or batch keys.
      ValueError: the names of `sources` and `weights` differ, or a weight is not a finite number > 0.
    """

    def __init__(
        self,
        sources: dict[str, RowSource],
        weights: dict[str, float],
        global_batch_size: int,
        sharding: jax.sharding.NamedSharding,
        seed: int,
    ):
        if list(sources) != list(weights):
            raise ValueError(f"sources {list(sources)} and weights {list(weights)} must name the same sources")
        self.names = list(sources)
        self._sources = [sources[n] for n in self.names]
        self.weights = normalised([weights[n] for n in self.names])
        for name, rows in zip(self.names, self._sources):
            if rows.num_sequences < 1:
                raise ConfigError(f"data source {name!r} has no training sequence; add data to it or drop it")
        lengths = {rows.seq_len for rows in self._sources}
        keys = {rows.keys for rows in self._sources}
        if len(lengths) != 1 or len(keys) != 1:
            raise ConfigError(
                f"the data sources serve rows of different lengths {sorted(lengths)} or keys {sorted(keys)}; "
                f"mix sources packed alike (one data.seq_len, document masking for all or none)"
            )
        self.seq_len, self.keys = lengths.pop(), keys.pop()
        self.global_batch_size = global_batch_size
        self.num_sequences = sum(rows.num_sequences for rows in self._sources)
        self._orders = [SampleOrder(rows.num_sequences, source_seed(seed, i)) for i, rows in enumerate(self._sources)]
        self._sharding = sharding
        self._global_shape = (global_batch_size, self.seq_len)
        self._local_rows = _process_rows(sharding, self._global_shape)
        self._taken = np.zeros(len(self.names), np.int64)

    def plan(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next batch's layout: (rows per source: int64 [Q], source of each batch row: int64 [B], stream
        position of each batch row in its source's stream: int64 [B])."""
        counts = batch_counts(self.weights, self.global_batch_size, self._taken)
        source, within = row_sources(counts)
        return counts, source, self._taken[source] + within

    def next_batch(self) -> dict[str, jax.Array]:
        """Returns the next global batch, each array [B, T] placed with `sharding`; reads from each source only
        the rows this process's devices hold."""
        counts, source, position = self.plan()
        local_source, local_position = source[self._local_rows], position[self._local_rows]
        rows = len(self._local_rows)
        local = {k: np.zeros((rows, self.seq_len), BATCH_DTYPES[k]) for k in self.keys}
        for s, (order, src) in enumerate(zip(self._orders, self._sources)):
            mine = local_source == s
            if mine.any():
                part = src.rows(order.ids(local_position[mine]))
                for k in self.keys:
                    local[k][mine] = part[k]
        self._taken += counts
        return global_arrays(self._sharding, local, self._global_shape)

    def _shard_sets(self) -> dict:
        """{name: `jaxpar.data.shards.ShardSet`} of the sources read from shard sets."""
        sets = {n: getattr(rows, "shard_set", None) for n, rows in zip(self.names, self._sources)}
        return {n: s for n, s in sets.items() if s is not None}

    def get_state(self) -> dict:
        """{"taken": {name: rows source name gave to the batches so far}}, and "shard_set_sha256": {name: digest}
        for the sources read from shard sets (JSON-safe)."""
        state: dict = {"taken": {n: int(t) for n, t in zip(self.names, self._taken)}}
        if sets := self._shard_sets():
            state[SHARD_SET_KEY] = {n: s.digest for n, s in sets.items()}
        return state

    def set_state(self, state: dict) -> None:
        """Resumes from a `get_state` dict, saved with this or another global batch size: the following
        `next_batch` continues each source's stream where the saver stopped (with the saver's batch size, it
        equals the batch the saver would have served).

        Raises:
          ConfigError: a source's shard set is another than the one the state was saved over
            (`jaxpar.data.stream.check_shard_set`).
          ValueError: `state` is not a mixture state of these sources (e.g. a single-source loader's
            {"next_sample": ...}), or a count is negative.
        """
        taken = state.get("taken") if isinstance(state, dict) else None
        if (
            not isinstance(taken, dict)
            or set(taken) != set(self.names)
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in taken.values())
        ):
            raise ValueError(
                f"data loader state must be {{'taken': {{name: int >= 0}}}} for the sources {self.names}, got "
                f"{state!r:.200}"
            )
        recorded, sets = state.get(SHARD_SET_KEY, {}), self._shard_sets()
        if not isinstance(recorded, dict):
            raise ValueError(f"data loader state: {SHARD_SET_KEY} must be {{name: digest}}, got {recorded!r:.200}")
        for i, name in enumerate(self.names):
            check_shard_set(recorded.get(name), sets.get(name), f"data.sources[{i}] ({name}) path")
        self._taken = np.array([taken[n] for n in self.names], dtype=np.int64)


class MixtureEvalLoader:
    """One validation pass over several sources: each source's `EvalLoader` in turn (module docstring), with the
    interface of an `EvalLoader` (`batches`, `num_tokens`, `target_stats`, `num_sequences`, `num_scored`).

    Attributes:
      loaders: {name: `EvalLoader`} in mixture order.
    """

    def __init__(self, loaders: dict[str, EvalLoader]):
        self.loaders = dict(loaders)
        self.num_sequences = sum(v.num_sequences for v in self.loaders.values())
        self.num_scored = sum(v.num_scored for v in self.loaders.values())
        self.num_batches = sum(v.num_batches for v in self.loaders.values())

    def target_stats(self) -> tuple[int, np.ndarray]:
        """(valid target tokens, count of each target id: int64 [largest id + 1]) over all sources' scored
        sequences."""
        total, counts = 0, np.zeros(0, np.int64)
        for loader in self.loaders.values():
            n, c = loader.target_stats()
            size = max(counts.size, c.size)
            total, counts = total + n, np.pad(counts, (0, size - counts.size)) + np.pad(c, (0, size - c.size))
        return total, counts

    @property
    def num_tokens(self) -> int:
        """Valid target tokens of one pass over all sources."""
        return self.target_stats()[0]

    def batches(self) -> Iterator[dict[str, jax.Array]]:
        """Every source's batches, source by source (`EvalLoader.batches`)."""
        for loader in self.loaders.values():
            yield from loader.batches()
