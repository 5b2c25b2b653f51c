"""Global batches of packed sequences as sharded jax Arrays, with exactly resumable state.

Shape key: G global batch size (sequences per step over all devices), T sequence length, N packed sequences.

The sample order is a Grain `MapDataset`: the N sequence ids, shuffled, repeated forever with a fresh shuffle
each epoch (Grain folds the epoch into the seed). Global batch k reads G consecutive positions of that stream;
a batch never straddles an epoch boundary (the last N mod G positions of each epoch are skipped), so no
sequence appears twice in one batch. The state is one integer, the next stream position, so a run resumes
exactly and the order does not depend on the number of processes.

Validation is served by `EvalLoader` instead: one pass over the split (or its first sequences) in file order,
every sequence exactly once, the last global batch filled with padding rows of loss_mask 0. Which global batch
row holds which sequence, or padding, depends on the row's global index alone, so every process agrees.

Each process gathers only the rows its addressable devices hold and assembles the global array with
`jax.make_array_from_process_local_data`. Every process reads and packs the whole corpus (cheap at this
library's scale).
"""

from __future__ import annotations

from collections.abc import Iterator

import grain
import jax
import numpy as np

from jaxpar.batch import BATCH_DTYPES, BATCH_KEYS, SEGMENT_IDS
from jaxpar.config import ConfigError, DataConfig
from jaxpar.data.packing import pack
from jaxpar.data.sources import load_tokens
from jaxpar.data.stats import unigram_entropy
from jaxpar.data.tokenizer import BOS_ID, PAD_ID


def serves_segment_ids(data_cfg: DataConfig) -> bool:
    """Whether the config's corpus is packed with segment ids: `data.document_masking` on a text source (each
    document opens with BOS, `jaxpar.data.sources`); a flat `tokens` file has no document index."""
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


class DataLoader:
    """Serves global batches {"inputs": int32 [G, T], "targets": int32 [G, T], "loss_mask": float32 [G, T]}, with
    "segment_ids": int32 [G, T] when `packed` has them (document masking, `jaxpar.data.pack`).

    Args:
      packed: output of `jaxpar.data.pack`, N sequences of T tokens.
      global_batch_size: G, sequences per batch over all processes.
      sharding: NamedSharding of each [G, T] batch array, typically P(("data", "fsdp"), None).
      seed: shuffle seed (taken modulo 2**32).
      shuffle: False keeps the packed order.
      split: name used in error messages ("train" or "validation").

    Raises:
      ConfigError: N < G, so a batch could not hold G distinct sequences.
      ValueError: `packed` lacks a key or its arrays disagree in shape.
    """

    def __init__(
        self,
        packed: dict[str, np.ndarray],
        global_batch_size: int,
        sharding: jax.sharding.NamedSharding,
        seed: int,
        shuffle: bool = True,
        split: str = "train",
    ):
        self.num_sequences, self.seq_len = _packed_shape(packed)
        self.global_batch_size = global_batch_size
        if self.num_sequences < global_batch_size:
            raise ConfigError(
                f"the {split} split has {self.num_sequences} sequences of {self.seq_len} tokens, fewer than "
                f"train.global_batch_size={global_batch_size}; lower train.global_batch_size or data.seq_len, "
                f"or add data (data.max_bytes, data.validation_fraction)"
            )
        self._packed = {k: packed[k] for k in _keys(packed)}
        self._sharding = sharding
        self._global_shape = (global_batch_size, self.seq_len)
        self._local_rows = _process_rows(sharding, self._global_shape)
        order = grain.MapDataset.range(self.num_sequences)
        if shuffle:
            order = order.shuffle(seed=seed % 2**32)
        self._order = order.repeat()
        self._next_sample = 0

    @property
    def batches_per_epoch(self) -> int:
        """floor(N / G): full batches per pass over the data."""
        return self.num_sequences // self.global_batch_size

    def next_batch(self) -> dict[str, jax.Array]:
        """Returns the next global batch, each array of shape [G, T] placed with `sharding`."""
        n, g = self.num_sequences, self.global_batch_size
        epoch, offset = divmod(self._next_sample, n)
        if offset + g > n:  # the batch would cross into the next epoch: skip the remainder
            epoch, offset = epoch + 1, 0
        start = epoch * n + offset
        ids = np.fromiter(
            (self._order[start + r] for r in self._local_rows), dtype=np.int64, count=len(self._local_rows)
        )
        self._next_sample = start + g
        return {
            k: jax.make_array_from_process_local_data(self._sharding, v[ids], self._global_shape)
            for k, v in self._packed.items()
        }

    def get_state(self) -> dict:
        """Returns {"next_sample": int}, the next position in the shuffled, repeated sample stream (JSON-safe)."""
        return {"next_sample": int(self._next_sample)}

    def set_state(self, state: dict) -> None:
        """Resumes from a `get_state` dict; the following `next_batch` equals the one the saver would have served.

        Raises:
          ValueError: `state` lacks a non-negative integer "next_sample".
        """
        value = state.get("next_sample") if isinstance(state, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"data loader state must be {{'next_sample': int >= 0}}, got {state!r}")
        self._next_sample = int(value)


class EvalLoader:
    """One pass over a validation split: global batches {"inputs", "targets": int32 [G, T], "loss_mask":
    float32 [G, T]} (and "segment_ids" when `packed` has them; 0 on padding rows) in file order, each sequence
    exactly once, never repeated.

    Batch b holds, in row r, sequence b*G + r while that is below `num_scored`, else a padding row (inputs
    and targets `PAD_ID`, loss_mask 0), so a token-mean over all batches is the mean over exactly the scored
    sequences' valid tokens. The rows depend only on the global row index: every process pads the same rows.

    Args:
      packed: output of `jaxpar.data.pack`, N >= 1 sequences of T tokens.
      global_batch_size: G, rows per batch over all processes.
      sharding: NamedSharding of each [G, T] batch array, as for `DataLoader`.
      max_batches: 0 scores the whole split (ceil(N / G) batches, the last padded); B > 0 scores its first
        min(B * G, N) sequences (`train.eval_batches`).

    Raises:
      ConfigError: the split holds no sequence, or `max_batches` < 0.
      ValueError: `packed` lacks a key or its arrays disagree in shape.
    """

    def __init__(
        self,
        packed: dict[str, np.ndarray],
        global_batch_size: int,
        sharding: jax.sharding.NamedSharding,
        max_batches: int = 0,
    ):
        self.num_sequences, self.seq_len = _packed_shape(packed)
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
        self._packed = {k: packed[k][: self.num_scored] for k in _keys(packed)}
        self._sharding = sharding
        self._global_shape = (g, self.seq_len)
        self._local_rows = _process_rows(sharding, self._global_shape)

    @property
    def num_tokens(self) -> int:
        """Valid (loss_mask = 1) target tokens of the scored sequences: what one pass's token-mean covers."""
        return int(self._packed["loss_mask"].sum())

    def scored(self) -> dict[str, np.ndarray]:
        """The scored sequences as host arrays {"inputs", "targets", "loss_mask"}: [num_scored, T] each."""
        return dict(self._packed)

    def batches(self) -> Iterator[dict[str, jax.Array]]:
        """Yields the `num_batches` global batches of one pass, each array [G, T] placed with `sharding`."""
        rows = len(self._local_rows)
        for b in range(self.num_batches):
            ids = b * self.global_batch_size + self._local_rows
            real = ids < self.num_scored
            local = {
                k: np.full((rows, self.seq_len), 0 if k in ("loss_mask", SEGMENT_IDS) else PAD_ID, BATCH_DTYPES[k])
                for k in self._packed
            }
            for k in self._packed:
                local[k][real] = self._packed[k][ids[real]]
            yield {
                k: jax.make_array_from_process_local_data(self._sharding, v, self._global_shape)
                for k, v in local.items()
            }


def _process_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, int]) -> np.ndarray:
    """Batch rows this process's devices hold, in the layout make_array_from_process_local_data expects.

    That layout is the distinct row blocks of the addressable shards (several devices may hold the same
    block), sorted by their first row and concatenated.
    """
    blocks = set()
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        blocks.add(index[0].indices(global_shape[0])[:2])
    blocks = sorted(blocks)
    if len({stop - start for start, stop in blocks}) != 1:
        raise ValueError(
            f"uneven batch-row blocks {blocks} for global shape {global_shape}; shard the batch dimension evenly"
        )
    return np.concatenate([np.arange(start, stop) for start, stop in blocks])


def build_loaders(
    data_cfg: DataConfig,
    global_batch_size: int,
    sharding: jax.sharding.NamedSharding,
    vocab_size: int | None = None,
    eval_batches: int = 0,
    vocab_multiple: int = 1,
) -> tuple[DataLoader, EvalLoader, dict]:
    """Reads, splits and packs the corpus; returns (train_loader, val_loader, info).

    `vocab_multiple` (mesh.tensor) is what model.vocab_size must be a multiple of; the fix an out-of-vocabulary
    token error suggests is the smallest size that holds every id and is such a multiple.

    The train loader shuffles with `data.seed`; the validation loader is an `EvalLoader` over the first
    `eval_batches` global batches' worth of validation sequences in file order (0: all of them).
    info: {"train_tokens", "val_tokens" (stream lengths), "train_sequences", "val_sequences" (packed),
    "val_scored_sequences", "val_scored_tokens" (what each evaluation covers), "seq_len"} (ints) and
    "val_unigram_entropy" (nats/token over the scored target tokens, see `jaxpar.data.unigram_entropy`).

    Raises:
      ConfigError: from `load_tokens`, a train split with fewer than `global_batch_size` sequences, an empty
        validation split, or a token id >= `vocab_size` (when given).
    """
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
    train_loader = DataLoader(train, global_batch_size, sharding, data_cfg.seed, shuffle=True, split="train")
    val_loader = EvalLoader(val, global_batch_size, sharding, max_batches=eval_batches)
    scored = val_loader.scored()
    info = {
        "train_tokens": int(len(train_tokens)),
        "val_tokens": int(len(val_tokens)),
        "train_sequences": train_loader.num_sequences,
        "val_sequences": val_loader.num_sequences,
        "val_scored_sequences": val_loader.num_scored,
        "val_scored_tokens": val_loader.num_tokens,
        "seq_len": data_cfg.seq_len,
        "val_unigram_entropy": unigram_entropy(scored["targets"], scored["loss_mask"]),
    }
    return train_loader, val_loader, info
