"""The mixture's row assignment alone (`jaxpar.data.mixture_plan`, no jax): over 10,000 global batches every
source's realised share stays within +-0.5% of its weight (in fact within one row of its quota at every batch),
each batch holds exactly B rows, and a batch's rows are interleaved so that any contiguous slice (a process's
share) holds every source in about its share. Shape letters: B global batch rows, Q sources."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpar.data.mixture_plan import batch_counts, normalised, row_sources

BATCHES = 10_000


def realised_counts(weights, global_batch_size: int, num_batches: int) -> np.ndarray:
    """Rows each source gets over batches [0, num_batches) from the start: int64 [sources]."""
    w = normalised(weights)
    taken = np.zeros(w.size, np.int64)
    for _ in range(num_batches):
        taken += batch_counts(w, global_batch_size, taken)
    return taken


@pytest.mark.parametrize(
    "weights,g",
    [([0.7, 0.3], 8), ([0.5, 0.3, 0.2], 32), ([5, 3, 1, 1], 16), ([0.97, 0.02, 0.01], 8), ([1, 1, 1], 4)],
)
def test_shares_over_10000_batches_track_the_weights(weights, g):
    w = normalised(weights)
    taken = np.zeros(w.size, np.int64)
    worst = 0.0
    for k in range(BATCHES):
        counts = batch_counts(w, g, taken)
        assert counts.sum() == g and (counts >= 0).all()
        taken += counts
        worst = max(worst, float(np.abs(taken - (k + 1) * g * w).max()))
    shares = taken / taken.sum()
    assert np.abs(shares - w).max() <= 0.005, (shares, w)
    assert worst < 1.0  # every source within one row of its quota after every batch
    np.testing.assert_array_equal(taken, realised_counts(weights, g, BATCHES))


def test_another_batch_size_midway_keeps_every_source_within_one_row_of_its_quota():
    """A run resumed with another train.global_batch_size: 8 rows per batch, then 16, then 4; the counts depend on
    the rows served so far only, so the quotas hold over all rows whatever batch served them."""
    w = normalised([0.7, 0.3])
    taken = np.zeros(2, np.int64)
    for g in [8] * 50 + [16] * 50 + [4] * 50:
        counts = batch_counts(w, g, taken)
        assert counts.sum() == g and (counts >= 0).all()
        taken += counts
        assert np.abs(taken - taken.sum() * w).max() < 1.0
    assert taken.tolist() == [980, 420]  # of 1,400 rows: 0.7 and 0.3


def test_a_source_below_one_row_per_batch_still_gets_its_share():
    """0.1% of 8 rows per batch: one row every 125 batches, none skipped."""
    taken = realised_counts([0.999, 0.001], 8, BATCHES)
    assert taken[1] == 80 and taken.sum() == 8 * BATCHES


def test_rows_are_interleaved_so_every_half_of_the_batch_holds_each_source():
    source, within = row_sources(np.array([6, 2]))
    assert source.tolist() == [0, 0, 1, 0, 0, 0, 1, 0]
    for s in (0, 1):  # each source's rows take its positions 0, 1, ... in batch order
        assert within[source == s].tolist() == list(range(int((source == s).sum())))
    source, _ = row_sources(np.array([16, 8, 8]))
    for half in (source[:16], source[16:]):
        assert np.bincount(half, minlength=3).tolist() == [8, 4, 4]


def test_weights_must_be_positive_and_finite():
    for bad in ([], [1, 0], [1, -1], [1, float("nan")], [float("inf")]):
        with pytest.raises(ValueError, match="finite numbers > 0"):
            normalised(bad)
    np.testing.assert_allclose(normalised([7, 3]), [0.7, 0.3])
