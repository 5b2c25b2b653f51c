"""Packs a token stream into fixed-length next-token-prediction sequences.

Shape key: N sequences, T tokens per sequence (`data.seq_len`).
"""

from __future__ import annotations

import numpy as np

from jaxpar.data.tokenizer import PAD_ID


def pack(tokens: np.ndarray, seq_len: int, pad_id: int = PAD_ID) -> dict[str, np.ndarray]:
    """Cuts a 1-D token stream into windows of T+1 tokens taken with stride T.

    Window i covers stream positions [i*T, i*T + T]; its inputs are the first T tokens and its targets the
    last T, so every stream token after the first is a target exactly once. The last window, when partial, is
    filled with `pad_id`; its padded target positions get loss_mask 0. Documents are not separated: a sequence
    may span several documents (their BOS/EOS tokens mark the boundaries).

    Args:
      tokens: 1-D integer array of L token ids (any integer dtype; ids must fit in int32).
      seq_len: T >= 1.
      pad_id: the id written into padded positions.

    Returns:
      {"inputs": int32 [N, T], "targets": int32 [N, T], "loss_mask": float32 [N, T]} with N = ceil((L-1)/T)
      (0 when L < 2).

    Raises:
      ValueError: `tokens` is not 1-D or `seq_len` < 1.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"pack expects a 1-D token stream, got shape {tokens.shape}")
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    n_targets = max(len(tokens) - 1, 0)
    n_seq = -(-n_targets // seq_len)
    stream = np.full(n_seq * seq_len + 1, pad_id, dtype=np.int32)
    stream[: len(tokens)] = tokens[: len(stream)]
    real = np.zeros(n_seq * seq_len + 1, dtype=np.float32)
    real[: len(tokens)] = 1.0
    idx_NT = np.arange(n_seq)[:, None] * seq_len + np.arange(seq_len)[None, :]
    return {
        "inputs": stream[idx_NT],
        "targets": stream[idx_NT + 1],
        "loss_mask": real[idx_NT + 1],
    }
