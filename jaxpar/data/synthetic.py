"""Token ids generated from a seed (`data.source: synthetic`): a corpus for benchmarks and smoke tests that reads
nothing, with a loss floor known exactly.

Shape letters as in the `jaxpar` glossary; T: the sequence length (`data.seq_len`), V: the vocabulary
(`model.vocab_size`), R: the rows asked for.

The corpus is `SEQUENCES` rows of T + 1 token ids in [0, V), each generated on its own from (`data.seed`, its
index r), so any row is made without the others, and a process makes only the rows of its slice of a batch. The
last round(`data.validation_fraction` * SEQUENCES) rows (at least one) are the validation split, the others the
training split, served by `jaxpar.data.DataLoader` in row order (the rows are independent draws already, so the
served stream depends on no shuffle), each epoch the same rows: the resume state is the global sample position,
as for every source, valid for any number of processes.

Definition. s = `data.seed` mod 2**32, k = `data.synthetic_branching`, raw(e, n) = the first n outputs of numpy's
PCG64 bit generator seeded with `SeedSequence(e)` (`random_raw`: uint64; numpy keeps bit generator streams and
SeedSequence stable across versions, unlike its distributions, which are not used), and every other step integer
arithmetic here, so the ids depend on no numpy, jax or Python version (tests/unit/test_synthetic.py pins some):
  successors  base[v] = raw([s, 0, 0], V)[v] mod V: token v is followed by one of v's k successors
              (base[v] + j) mod V, j in [0, k), distinct since k < V.
  row r       u = raw([s, 1, r], 2(T + 1)); b_t = u[t], x_t = u[T + 1 + t] for window positions t in [0, T].
  documents   position 0 opens a document; with `data.document_masking` position t >= 1 opens a new one when
              b_t mod L = 0, L = max(T // 4, 2) (so documents of about L tokens, about 5 per row); without it the
              row is one document.
  tokens      a document's first token is x_t mod V; each later token is (base[previous] + (x_t mod k)) mod V.
              k = 0: every token is x_t mod V, uniform and independent.
  packing     inputs = tokens [0, T), targets = tokens [1, T]; loss_mask 1, except that with document masking a
              target opening a document is not predicted from the previous one (0); segment_ids number the
              documents of the inputs from 1. No row is padded.

Loss floor: every scored target follows its input within one document, drawn uniformly from its k successors,
so the cross-entropy of a model that has learned the chain is log(k) nats per token, and no model does better; k
= 0 gives log(V) (a model at exactly log(V) has learned nothing, but no more is there to learn). The mod-k and
mod-V reductions of 64-bit draws bias a choice by less than V / 2**64.
"""

from __future__ import annotations

import numpy as np

from jaxpar.config import ConfigError, DataConfig
from jaxpar.data.batch import BATCH_DTYPES, BATCH_KEYS, SEGMENT_IDS

SEQUENCES = 1 << 20  # rows of the synthetic corpus, both splits


def _raw(entropy: list[int], n: int) -> np.ndarray:
    """The first `n` uint64 outputs of PCG64 seeded with `SeedSequence(entropy)`: uint64 [n]."""
    return np.random.PCG64(np.random.SeedSequence(entropy)).random_raw(n)


class SyntheticRows:
    """Rows [first, first + N) of the synthetic corpus (module docstring) as a `jaxpar.data.loader.RowSource`.

    Attributes:
      num_sequences: N. seq_len: T. keys: the batch keys `rows` gives. pad_id: 0 (rows are never padded; an
        `EvalLoader`'s padding rows use it). shard_set: None.

    Args:
      seed: `data.seed`. vocab_size: V >= 1. branching: k, 0 <= k < V. seq_len: T >= 1.
      first, num_sequences: the split's rows of the corpus. document_masking: serve segment ids.

    Raises:
      ValueError: k outside [0, V).
    """

    pad_id = 0
    shard_set = None

    def __init__(
        self,
        seed: int,
        vocab_size: int,
        branching: int,
        seq_len: int,
        first: int,
        num_sequences: int,
        document_masking: bool,
    ):
        if not 0 <= branching < vocab_size:
            raise ValueError(f"branching={branching} must lie in [0, vocab_size={vocab_size})")
        self._seed, self.vocab_size, self.branching = seed % 2**32, vocab_size, branching
        self.seq_len, self.first, self.num_sequences = seq_len, first, num_sequences
        self.document_masking = document_masking
        self.keys = BATCH_KEYS + ((SEGMENT_IDS,) if document_masking else ())
        self._base = _raw([self._seed, 0, 0], vocab_size) % np.uint64(vocab_size)  # uint64 [V]: successors' first

    def rows(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Rows `ids` (int [R], each in [0, N)) of the split: {"inputs", "targets": int32 [R, T], "loss_mask":
        float32 [R, T]} and with document masking "segment_ids": int32 [R, T].

        Raises:
          IndexError: an id outside [0, N).
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_sequences):
            raise IndexError(f"rows {ids.tolist()} outside [0, {self.num_sequences})")
        t, v, k = self.seq_len, np.uint64(self.vocab_size), self.branching
        u = np.zeros((ids.size, 2 * (t + 1)), np.uint64)
        for row, i in enumerate(ids.tolist()):
            u[row] = _raw([self._seed, 1, self.first + i], 2 * (t + 1))
        b, x = u[:, : t + 1], u[:, t + 1 :]  # uint64 [R, T + 1] each
        opens = np.zeros((ids.size, t + 1), bool)
        opens[:, 0] = True
        if self.document_masking:
            opens[:, 1:] = b[:, 1:] % np.uint64(max(t // 4, 2)) == 0  # documents of about T / 4 tokens
        tokens = x % v  # each document's first token; with k = 0 every token
        if k:
            step = x % np.uint64(k)
            for p in range(1, t + 1):  # the chain: each token one of the previous token's k successors
                chained = (self._base[tokens[:, p - 1]] + step[:, p]) % v
                tokens[:, p] = np.where(opens[:, p], tokens[:, p], chained)
        tokens = tokens.astype(np.int32)
        out = {
            "inputs": tokens[:, :t],
            "targets": tokens[:, 1:],
            "loss_mask": (~opens[:, 1:]).astype(BATCH_DTYPES["loss_mask"]),
        }
        if self.document_masking:
            out[SEGMENT_IDS] = np.cumsum(opens[:, :t], axis=1, dtype=np.int32)
        return {key: np.ascontiguousarray(a) for key, a in out.items()}


def synthetic_splits(cfg: DataConfig, vocab_size: int | None) -> tuple[SyntheticRows, SyntheticRows]:
    """(train rows, validation rows) of a `data.source: synthetic` config (module docstring).

    Raises:
      ConfigError: no `vocab_size` (model.vocab_size) is given, or `data.synthetic_branching` is outside
        [0, vocab_size).
    """
    if vocab_size is None:
        raise ConfigError("data.source=synthetic draws ids below model.vocab_size; give the model's vocab_size")
    k = cfg.synthetic_branching
    if not 0 <= k < vocab_size:
        raise ConfigError(
            f"data.synthetic_branching={k} must lie in [0, model.vocab_size={vocab_size}): each id's number of "
            f"successors (0: uniform ids)"
        )
    n_val = min(max(round(cfg.validation_fraction * SEQUENCES), 1), SEQUENCES - 1)
    n_train = SEQUENCES - n_val
    common = dict(seed=cfg.seed, vocab_size=vocab_size, branching=k, seq_len=cfg.seq_len)
    train = SyntheticRows(**common, first=0, num_sequences=n_train, document_masking=cfg.document_masking)
    val = SyntheticRows(**common, first=n_train, num_sequences=n_val, document_masking=cfg.document_masking)
    return train, val
