"""Byte-level tokenizer: ids 0..255 are UTF-8 bytes, then three special tokens.

No vocabulary file and no download: every string round-trips exactly, at about one token per ASCII character.
"""

from __future__ import annotations

import numpy as np

PAD_ID = 256  # fills the tail of the last packed sequence; never a target (loss_mask 0)
BOS_ID = 257  # opens every document
EOS_ID = 258  # closes every document
BYTE_VOCAB = 259  # 256 byte values + PAD, BOS, EOS


class ByteTokenizer:
    """UTF-8 bytes as token ids.

    Attributes:
      vocab_size: 259 (`BYTE_VOCAB`); the model's embedding table needs at least this many rows.
      pad_id, bos_id, eos_id: the special ids 256, 257, 258.
    """

    vocab_size = BYTE_VOCAB
    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    def encode(self, text: str) -> np.ndarray:
        """Returns the UTF-8 bytes of `text` as a uint16 array of shape [len(text.encode())], no specials."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        """Returns the text of a 1-D sequence of ids; special ids are skipped, broken UTF-8 becomes U+FFFD.

        Raises:
          ValueError: an id is negative or >= 259.
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= BYTE_VOCAB):
            raise ValueError(f"token ids must lie in [0, {BYTE_VOCAB}); got range [{ids.min()}, {ids.max()}]")
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")
