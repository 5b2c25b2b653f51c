"""Packs a token stream into fixed-length next-token-prediction sequences.

Shape key: N sequences, T tokens per sequence (`data.seq_len`).
"""

from __future__ import annotations

import numpy as np

from jaxpar.data.tokenizer import PAD_ID


def pack(tokens: np.ndarray, seq_len: int, pad_id: int = PAD_ID, bos_id: int | None = None) -> dict[str, np.ndarray]:
    """Cuts a 1-D token stream into windows of T+1 tokens taken with stride T.

    Window i covers stream positions [i*T, i*T + T]; its inputs are the first T tokens and its targets the
    last T, so every stream token after the first is a target exactly once. The last window, when partial, is
    filled with `pad_id`; its padded target positions get loss_mask 0.

    Without `bos_id` documents are not separated: a sequence may span several documents (their BOS/EOS tokens
    mark the boundaries) and attend across them. With `bos_id` (document masking) each `bos_id` token starts a
    document, and the result also holds "segment_ids": the documents of each row numbered 1, 2, ... from the row's
    first token (0 on padding), which keep attention within each document and restart the rotary positions at
    each one (`jaxpar.model.attention`); a target in another document than its input (the next document's
    first token, predicted from the previous document's last) gets loss_mask 0. A document cut by a row boundary
    continues in the next row as a new segment.

    Args:
      tokens: 1-D integer array of L token ids (any integer dtype; ids must fit in int32).
      seq_len: T >= 1.
      pad_id: the id written into padded positions.
      bos_id: the id that opens every document, or None (no document masking).

    Returns:
      {"inputs": int32 [N, T], "targets": int32 [N, T], "loss_mask": float32 [N, T]} with N = ceil((L-1)/T)
      (0 when L < 2), and with `bos_id` "segment_ids": int32 [N, T].

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
    out = {
        "inputs": stream[idx_NT],
        "targets": stream[idx_NT + 1],
        "loss_mask": real[idx_NT + 1],
    }
    if bos_id is not None:
        document = np.cumsum(stream == bos_id)  # document index of each stream position (padding: the last one's)
        doc_in, doc_target = document[idx_NT], document[idx_NT + 1]
        out["loss_mask"] = out["loss_mask"] * (doc_in == doc_target)
        segments = (doc_in - doc_in[:, :1] + 1).astype(np.int32)
        out["segment_ids"] = np.where(real[idx_NT] > 0, segments, 0).astype(np.int32)
    return out
