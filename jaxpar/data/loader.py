"""Global batches of packed sequences as sharded jax Arrays, with exactly resumable state.

Shape letters as in the `jaxpar` glossary; B: the rows of a global batch (`train.global_batch_size`, sequences per
step over all devices), N: the packed sequences of the split.

The sample order is a Grain `MapDataset`: the N sequence ids, shuffled, repeated forever with a fresh shuffle
each epoch (Grain folds the epoch into the seed). Global batch i reads B consecutive positions of that stream;
a batch never straddles an epoch boundary (the last N mod B positions of each epoch are skipped), so no
sequence appears twice in one batch. The state is one integer, the next stream position, so a run resumes
exactly and the order does not depend on the number of processes; over a shard set it also records the set's
digest, and a resume over a set that changed since is refused (`jaxpar.data.stream.check_shard_set`).

Validation is served by `EvalLoader` instead: one pass over the split (or its first sequences) in file order,
every sequence exactly once, the last global batch filled with padding rows of loss_mask 0. Which global batch
row holds which sequence, or padding, depends on the row's global index alone, so every process agrees.

Each process gathers only the rows its addressable devices hold and assembles the global array with
`jax.make_array_from_process_local_data`. Rows come from a row source: packed arrays in RAM (`PackedRows`, the
`stdlib`, `text`, `jsonl` and `tokens` sources, which every process reads and packs whole), a token shard set
packed lazily row by row (`jaxpar.data.stream.ShardRows`, `data.source: shards`), from which a process reads only
the rows of its own batch slice, or generated rows (`jaxpar.data.synthetic.SyntheticRows`, `data.source:
synthetic`), of which a process makes only those.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import grain
import jax
import numpy as np

from jaxpar.config import ConfigError, DataConfig
from jaxpar.data.batch import BATCH_DTYPES, BATCH_KEYS, SEGMENT_IDS
from jaxpar.data.packing import pack
from jaxpar.data.sources import load_tokens
from jaxpar.data.stream import SHARD_SET_KEY, check_shard_set, shard_splits
from jaxpar.data.synthetic import synthetic_splits
from jaxpar.data.tokenizer import BOS_ID, PAD_ID


def serves_segment_ids(data_cfg: DataConfig) -> bool:
    """Whether the config's corpus is packed with segment ids: `data.document_masking` on a text source (each
    document opens with BOS, `jaxpar.data.sources`) or a shard set (its document index, `jaxpar.data.stream`); a
    flat `tokens` file has no document index. A mixture (`data.sources`) serves them when one of its sources does
    (`jaxpar.config.data_sources.check_data` refuses a `tokens` source mixed with others under document masking)."""
    if data_cfg.sources:
        from jaxpar.config.data_sources import source_configs

        return data_cfg.document_masking and any(sd.source != "tokens" for _, _, sd in source_configs(data_cfg))
    return data_cfg.document_masking and data_cfg.source != "tokens"


def _keys(packed: dict[str, np.ndarray]) -> tuple[str, ...]:
    """The batch keys a loader serves: `BATCH_KEYS`, and "segment_ids" when the packing made them."""
    return BATCH_KEYS + ((SEGMENT_IDS,) if SEGMENT_IDS in packed else ())


def _packed_shape(packed: dict[str, np.ndarray]) -> tuple[int, int]:
    """[N, T] of packed data (`jaxpar.data.pack`).

    Raises:
      ValueError: `packed` lacks a batch key or its arrays disagree in shape.
    """
    missing = [k for k in BATCH_KEYS if k not in packed]
    if missing:
        raise ValueError(f"packed data lacks {missing}; build it with jaxpar.data.pack")
    shapes = {packed[k].shape for k in _keys(packed)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"packed arrays must share one [N, T] shape, got {sorted(shapes)}")
    return next(iter(shapes))


class RowSource(Protocol):
    """Packed sequences a loader serves row by row.

    Attributes:
      num_sequences: N rows. seq_len: T. keys: the batch keys `rows` gives ("inputs", "targets", "loss_mask",
        and "segment_ids" with document masking). pad_id: the id of padded positions.
      shard_set (optional): the `jaxpar.data.shards.ShardSet` the rows are read from, whose digest a loader's
        state records (`jaxpar.data.stream.ShardRows`); absent or None for rows of no shard set.
    """

    num_sequences: int
    seq_len: int
    keys: tuple[str, ...]
    pad_id: int

    def rows(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Rows `ids` (int [R], each in [0, N)): {key: [R, T] of the key's `BATCH_DTYPES` dtype}."""
        ...


class PackedRows:
    """Packed arrays held in RAM (`jaxpar.data.pack`'s output) as a `RowSource`.

    Raises:
      ValueError: `packed` lacks a key or its arrays disagree in shape.
    """

    def __init__(self, packed: dict[str, np.ndarray], pad_id: int = PAD_ID):
        self.num_sequences, self.seq_len = _packed_shape(packed)
        self.keys = _keys(packed)
        self.pad_id = pad_id
        self.packed = {k: packed[k] for k in self.keys}

    def rows(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        return {k: v[ids] for k, v in self.packed.items()}


def _as_rows(data) -> RowSource:
    """A `RowSource` from packed arrays (a dict) or a row source given as is."""
    return PackedRows(data) if isinstance(data, dict) else data


class SampleOrder:
    """The sample stream of N sequences: their ids shuffled (or in order), repeated forever with a fresh shuffle
    each epoch (Grain folds the epoch into the seed), as a Grain `MapDataset`; position p of the stream is read
    without reading the positions before it.

    Args:
      num_sequences: N >= 1. seed: shuffle seed (taken modulo 2**32). shuffle: False keeps the order 0..N-1.
    """

    def __init__(self, num_sequences: int, seed: int, shuffle: bool = True):
        order = grain.MapDataset.range(num_sequences)
        if shuffle:
            order = order.shuffle(seed=seed % 2**32)
        self._order = order.repeat()

    def ids(self, positions) -> np.ndarray:
        """The sequence ids at stream positions `positions` (ints >= 0): int64 [len(positions)]."""
        return np.fromiter((self._order[int(p)] for p in positions), dtype=np.int64, count=len(positions))


def global_arrays(
    sharding: jax.sharding.NamedSharding, local: dict[str, np.ndarray], global_shape: tuple[int, int]
) -> dict[str, jax.Array]:
    """This process's rows `local` ({key: [R, T]}, in `_process_rows` order) as global [B, T] arrays. Under
    context parallelism, where the sequence is split over devices of several processes, each process gives only
    the positions its own devices hold (`_process_columns`)."""
    start, stop = _process_columns(sharding, global_shape)
    if (start, stop) != (0, global_shape[1]):
        local = {k: v[:, start:stop] for k, v in local.items()}
    return {k: jax.make_array_from_process_local_data(sharding, v, global_shape) for k, v in local.items()}


class DataLoader:
    """Serves global batches {"inputs": int32 [B, T], "targets": int32 [B, T], "loss_mask": float32 [B, T]}, with
    "segment_ids": int32 [B, T] when the rows have them (document masking, `jaxpar.data.pack`).

    Args:
      packed: output of `jaxpar.data.pack` (N sequences of T tokens), or a `RowSource` of N rows (e.g. a shard
        set's `jaxpar.data.stream.ShardRows`), from which only this process's rows are read.
      global_batch_size: B, sequences per batch over all processes.
      sharding: NamedSharding of each [B, T] batch array, typically P(("data", "fsdp"), None).
      seed: shuffle seed (taken modulo 2**32).
      shuffle: False keeps the packed order.
      split: name used in error messages ("train" or "validation").

    Raises:
      ConfigError: N < B, so a batch could not hold B distinct sequences.
      ValueError: `packed` lacks a key or its arrays disagree in shape.
    """

    def __init__(
        self,
        packed: dict[str, np.ndarray] | RowSource,
        global_batch_size: int,
        sharding: jax.sharding.NamedSharding,
        seed: int,
        shuffle: bool = True,
        split: str = "train",
    ):
        self._rows = _as_rows(packed)
        self.num_sequences, self.seq_len = self._rows.num_sequences, self._rows.seq_len
        self.global_batch_size = global_batch_size
        if self.num_sequences < global_batch_size:
            raise ConfigError(
                f"the {split} split has {self.num_sequences} sequences of {self.seq_len} tokens, fewer than "
                f"train.global_batch_size={global_batch_size}; lower train.global_batch_size or data.seq_len, "
                f"or add data (data.max_bytes, data.validation_fraction)"
            )
        self._sharding = sharding
        self._global_shape = (global_batch_size, self.seq_len)
        self._local_rows = _process_rows(sharding, self._global_shape)
        self._order = SampleOrder(self.num_sequences, seed, shuffle)
        self._next_sample = 0

    @property
    def batches_per_epoch(self) -> int:
        """floor(N / B): full batches per pass over the data."""
        return self.num_sequences // self.global_batch_size

    def sample_ids(self, start: int, rows: np.ndarray) -> np.ndarray:
        """The sequence ids at stream positions `start + rows` of the shuffled, repeated order: int64 [len(rows)]."""
        return self._order.ids(start + np.asarray(rows, dtype=np.int64))

    def next_batch(self) -> dict[str, jax.Array]:
        """Returns the next global batch, each array of shape [B, T] placed with `sharding`. Reads only the rows
        this process's devices hold."""
        n, g = self.num_sequences, self.global_batch_size
        epoch, offset = divmod(self._next_sample, n)
        if offset + g > n:  # the batch would cross into the next epoch: skip the remainder
            epoch, offset = epoch + 1, 0
        start = epoch * n + offset
        local = self._rows.rows(self.sample_ids(start, self._local_rows))
        self._next_sample = start + g
        return global_arrays(self._sharding, local, self._global_shape)

    def get_state(self) -> dict:
        """Returns {"next_sample": int}, the next position in the shuffled, repeated sample stream, and for rows
        of a shard set "shard_set_sha256": its digest (`jaxpar.data.shards.shard_set_digest`) (JSON-safe)."""
        state: dict = {"next_sample": int(self._next_sample)}
        shard_set = getattr(self._rows, "shard_set", None)
        if shard_set is not None:
            state[SHARD_SET_KEY] = shard_set.digest
        return state

    def set_state(self, state: dict) -> None:
        """Resumes from a `get_state` dict; the following `next_batch` equals the one the saver would have served.

        Raises:
          ConfigError: the state was saved over another shard set than the one read now
            (`jaxpar.data.stream.check_shard_set`).
          ValueError: `state` lacks a non-negative integer "next_sample", or names a shard set while the rows
            are of none.
        """
        value = state.get("next_sample") if isinstance(state, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"data loader state must be {{'next_sample': int >= 0}}, got {state!r}")
        check_shard_set(state.get(SHARD_SET_KEY), getattr(self._rows, "shard_set", None), "data.path")
        self._next_sample = int(value)


class EvalLoader:
    """One pass over a validation split: global batches {"inputs", "targets": int32 [B, T], "loss_mask":
    float32 [B, T]} (and "segment_ids" when the rows have them; 0 on padding rows) in file order, each sequence
    exactly once, never repeated.

    Batch i holds, in row r, sequence i*B + r while that is below `num_scored`, else a padding row (inputs
    and targets the source's pad id, loss_mask 0), so a token-mean over all batches is the mean over exactly the
    scored sequences' valid tokens. The rows depend only on the global row index: every process pads the same rows.

    Args:
      packed: output of `jaxpar.data.pack`, N >= 1 sequences of T tokens, or a `RowSource` of N rows.
      global_batch_size: B, rows per batch over all processes.
      sharding: NamedSharding of each [B, T] batch array, as for `DataLoader`.
      max_batches: 0 scores the whole split (ceil(N / B) batches, the last padded); max_batches > 0
        scores its first min(max_batches * B, N) sequences (`train.eval_batches`).

    Raises:
      ConfigError: the split holds no sequence, or `max_batches` < 0.
      ValueError: `packed` lacks a key or its arrays disagree in shape.
    """

    STATS_ROWS = 256  # rows read at once by `target_stats`

    def __init__(
        self,
        packed: dict[str, np.ndarray] | RowSource,
        global_batch_size: int,
        sharding: jax.sharding.NamedSharding,
        max_batches: int = 0,
    ):
        self._rows = _as_rows(packed)
        self.num_sequences, self.seq_len = self._rows.num_sequences, self._rows.seq_len
        if self.num_sequences == 0:
            raise ConfigError(
                "the validation split holds no sequence (fewer than 2 tokens); raise "
                "data.validation_fraction or add data"
            )
        if max_batches < 0:
            raise ConfigError(f"train.eval_batches={max_batches} must be >= 0 (0: the whole validation split)")
        g = global_batch_size
        self.global_batch_size = g
        self.num_scored = self.num_sequences if max_batches == 0 else min(max_batches * g, self.num_sequences)
        self.num_batches = -(-self.num_scored // g)
        self._sharding = sharding
        self._global_shape = (g, self.seq_len)
        self._local_rows = _process_rows(sharding, self._global_shape)
        self._stats: tuple[int, np.ndarray] | None = None

    def target_stats(self) -> tuple[int, np.ndarray]:
        """(valid target tokens, count of each target id: int64 [largest id + 1]) over the scored sequences, read
        `STATS_ROWS` rows at a time (memory independent of the split's size). Computed once."""
        if self._stats is None:
            total, counts = 0, np.zeros(0, np.int64)
            for lo in range(0, self.num_scored, self.STATS_ROWS):
                part = self._rows.rows(np.arange(lo, min(lo + self.STATS_ROWS, self.num_scored)))
                valid = part["targets"][part["loss_mask"] != 0]
                total += int(valid.size)
                c = np.bincount(valid, minlength=counts.size) if valid.size else np.zeros(counts.size, np.int64)
                counts = np.pad(counts, (0, c.size - counts.size)) + c
            self._stats = (total, counts)
        return self._stats

    @property
    def num_tokens(self) -> int:
        """Valid (loss_mask = 1) target tokens of the scored sequences: what one pass's token-mean covers."""
        return self.target_stats()[0]

    def scored(self) -> dict[str, np.ndarray]:
        """The scored sequences as host arrays {"inputs", "targets", "loss_mask"}: [num_scored, T] each (read
        whole: for a large streamed split use `target_stats`)."""
        out = self._rows.rows(np.arange(self.num_scored))
        return out

    def batches(self) -> Iterator[dict[str, jax.Array]]:
        """Yields the `num_batches` global batches of one pass, each array [B, T] placed with `sharding`. Reads
        only the rows this process's devices hold."""
        rows = len(self._local_rows)
        for b in range(self.num_batches):
            ids = b * self.global_batch_size + self._local_rows
            real = ids < self.num_scored
            local = {
                k: np.full(
                    (rows, self.seq_len), 0 if k in ("loss_mask", SEGMENT_IDS) else self._rows.pad_id, BATCH_DTYPES[k]
                )
                for k in self._rows.keys
            }
            if real.any():
                part = self._rows.rows(ids[real])
                for k in self._rows.keys:
                    local[k][real] = part[k]
            yield global_arrays(self._sharding, local, self._global_shape)


def _process_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, int]) -> np.ndarray:
    """Batch rows this process's devices hold, in the layout make_array_from_process_local_data expects.

    That layout is the distinct row blocks of the addressable shards (several devices may hold the same
    block), sorted by their first row and concatenated.
    """
    found: set[tuple[int, int]] = set()
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        rows = slice(None) if index is None else index[0]  # None: the device holds the whole array
        found.add(rows.indices(global_shape[0])[:2])
    blocks = sorted(found)
    if len({stop - start for start, stop in blocks}) != 1:
        raise ValueError(
            f"uneven batch-row blocks {blocks} for global shape {global_shape}; shard the batch dimension evenly"
        )
    return np.concatenate([np.arange(start, stop) for start, stop in blocks])


def _process_columns(sharding: jax.sharding.Sharding, global_shape: tuple[int, int]) -> tuple[int, int]:
    """(start, stop): the sequence positions this process's devices hold, [0, T) unless the sequence is split over
    devices of several processes (`mesh.context`).

    Raises:
      ValueError: the positions this process holds are not one contiguous range.
    """
    found: set[tuple[int, int]] = set()
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        cols = slice(None) if index is None else index[1]
        found.add(cols.indices(global_shape[1])[:2])
    blocks = sorted(found)
    if any(a[1] != b[0] for a, b in zip(blocks, blocks[1:])):
        raise ValueError(
            f"this process's devices hold sequence positions {blocks} of {global_shape[1]}, not one contiguous "
            f"range; keep each process's devices on consecutive context ranks (jaxpar.build_mesh does)"
        )
    return blocks[0][0], blocks[-1][1]


def split_rows(data_cfg: DataConfig, vocab_size: int | None = None, vocab_multiple: int = 1) -> tuple:
    """(train rows, validation rows, train tokens, validation tokens, shard set) of a single-source `DataConfig`:
    the packed arrays of a text or tokens source (shard set None), a shard set's lazily packed `ShardRows` and
    its `jaxpar.data.shards.ShardSet`, or the generated `jaxpar.data.synthetic.SyntheticRows` (shard set None;
    tokens: rows x T).

    Raises:
      ConfigError: as `build_loaders`.
    """
    shard_set = None
    train: RowSource | dict[str, np.ndarray]
    val: RowSource | dict[str, np.ndarray]
    if data_cfg.source == "shards":
        train, val, shard_set = shard_splits(data_cfg, vocab_size, vocab_multiple)
        train_len, val_len = train.num_tokens, val.num_tokens
    elif data_cfg.source == "synthetic":
        train, val = synthetic_splits(data_cfg, vocab_size)
        train_len, val_len = train.num_sequences * train.seq_len, val.num_sequences * val.seq_len
    else:
        train_tokens, val_tokens = load_tokens(data_cfg)
        if vocab_size is not None:
            largest = int(max(train_tokens.max(), val_tokens.max()))
            if largest >= vocab_size:
                need = -(-(largest + 1) // vocab_multiple) * vocab_multiple
                multiple = f", a multiple of mesh.tensor={vocab_multiple}" if vocab_multiple > 1 else ""
                raise ConfigError(
                    f"data.source={data_cfg.source} holds token id {largest}, but model.vocab_size={vocab_size} "
                    f"allows ids below {vocab_size}; set model.vocab_size to at least {need} (ids up to {largest}"
                    f"{multiple}), or check data.path and data.token_dtype"
                )
        bos_id = BOS_ID if serves_segment_ids(data_cfg) else None
        train = pack(train_tokens, data_cfg.seq_len, bos_id=bos_id)
        val = pack(val_tokens, data_cfg.seq_len, bos_id=bos_id)
        train_len, val_len = len(train_tokens), len(val_tokens)
    return train, val, train_len, val_len, shard_set
