"""Corpus statistics that give training losses a reference point."""

from __future__ import annotations

import numpy as np


def unigram_entropy(tokens: np.ndarray, mask: np.ndarray | None = None) -> float:
    """Entropy of the empirical token distribution of a stream, in nats per token.

    This is the cross-entropy of the best context-free predictor (one that always predicts the stream's own
    token frequencies), so a validation loss in nats below this value shows the model uses context.

    Args:
      tokens: integer array of token ids, any shape.
      mask: optional array of tokens' shape; only positions where it is nonzero are counted (e.g. a packed
        batch's `targets` with its `loss_mask`, to skip padding).

    Returns:
      H = -sum_v p_v log p_v over the counted tokens, in nats; 0.0 for a single symbol.

    Raises:
      ValueError: no token is counted.
    """
    tokens = np.asarray(tokens).reshape(-1)
    if mask is not None:
        tokens = tokens[np.asarray(mask).reshape(-1) != 0]
    if tokens.size == 0:
        raise ValueError("unigram_entropy needs at least one counted token")
    _, counts = np.unique(tokens, return_counts=True)
    return unigram_entropy_of_counts(counts)


def unigram_entropy_of_counts(counts: np.ndarray) -> float:
    """`unigram_entropy` from per-token counts (any integer array; zeros are ignored), in nats per token.

    Raises:
      ValueError: the counts sum to 0.
    """
    counts = np.asarray(counts).reshape(-1)
    counts = counts[counts > 0]
    if counts.sum() == 0:
        raise ValueError("unigram_entropy needs at least one counted token")
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())
