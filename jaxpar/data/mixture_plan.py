"""Which rows of each global batch a data mixture takes from which source: deterministic, no randomness, no jax.

Shape letters as in the `jaxpar` glossary; Q: the mixture's sources, B: the rows of a global batch.

Counts (`batch_counts`): each batch gives source s the rows that bring its running total closest to its share of
all rows so far. With C_s the rows source s has had so far, R = sum_s C_s all rows so far (i*B after i batches of
B rows) and w_s its normalised weight, the demand of the next batch of B rows is d_s = (R + B)*w_s - C_s, which
sums to B; source s gets floor(d_s) rows (0 when d_s < 0), and the rows left over go one each to the sources with
the largest remainders d_s - floor(d_s) (ties to the lower index): the largest-remainder (Hamilton) apportionment
of B rows, carried over from batch to batch. Then |C_s - R*w_s| < 1 after every batch whenever B*w_s >= 1 for
all s (by induction: the error before a batch lies in (-1, 1), so d_s > 0 and the error after it, the count
minus d_s, lies in (-1, 1) again), so over n batches a source's realised share misses its weight by less than
1/(n*B) (tests/unit/test_mixture_plan.py measures it over 10,000 batches). The counts depend on the rows served
so far, not on how many batches served them, so B may change between batches (a run resumed with another
`train.global_batch_size`) and the bound still holds.

Placement (`row_sources`): within a batch the sources' rows are interleaved, not blocked, so that each process's
slice of the batch holds every source in about its share: source s's j-th row (0 <= j < c_s) sits at key
(j + 1/2) / c_s, and the rows are ordered by key (ties to the lower source index): stride scheduling.
"""

from __future__ import annotations

import numpy as np


def normalised(weights) -> np.ndarray:
    """Weights divided by their sum: float64 [Q].

    Raises:
      ValueError: no weight, or a weight that is not a finite number > 0.
    """
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.size == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"mixture weights must be finite numbers > 0, got {w.tolist()}")
    return w / w.sum()


def batch_counts(weights: np.ndarray, global_batch_size: int, taken: np.ndarray) -> np.ndarray:
    """Rows of the next global batch per source: int64 [Q] summing to B (module docstring).

    Args:
      weights: normalised weights, float64 [Q] (`normalised`).
      global_batch_size: B, the next batch's rows.
      taken: C, int [Q]: each source's rows in the batches so far (of any sizes).
    """
    g = global_batch_size
    taken = np.asarray(taken, dtype=np.int64)
    demand = (int(taken.sum()) + g) * weights - taken.astype(np.float64)
    counts = np.maximum(np.floor(demand), 0).astype(np.int64)
    left = g - int(counts.sum())
    if left > 0:
        remainder = np.where(demand > 0, demand - counts, -np.inf)
        order = np.lexsort((np.arange(len(weights)), -remainder))  # largest remainder first, then lower index
        counts[order[:left]] += 1
    elif left < 0:  # cannot happen while sum(demand) = B; kept so that the counts always sum to B
        for s in np.argsort(-counts, kind="stable")[:-left]:
            counts[s] -= 1
    return counts


def row_sources(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source of each row: int64 [B], the row's index within its source's rows of the batch: int64 [B]) for
    per-source row counts `counts` (int [Q], sum B), interleaved by stride scheduling (module docstring)."""
    counts = np.asarray(counts, dtype=np.int64)
    source = np.repeat(np.arange(counts.size), counts)
    within = np.concatenate([np.arange(c) for c in counts]) if counts.size else np.zeros(0, np.int64)
    key = (within + 0.5) / np.maximum(counts[source], 1)
    order = np.lexsort((source, key))
    return source[order], within[order].astype(np.int64)
