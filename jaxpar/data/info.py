"""What the loaders of a data config hold, and what each evaluation covers: `build_loaders`' `DataInfo`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataInfo:
    """Token and sequence counts of a data config's splits (`jaxpar.data.build_loaders`), or of one source of a
    mixture (`sources`).

    Attributes:
      train_tokens, val_tokens: the token streams' lengths of the training and validation splits.
      train_sequences, val_sequences: the packed sequences of `seq_len` tokens in each.
      val_scored_sequences, val_scored_tokens: what each evaluation covers (`train.eval_batches` global batches'
        worth of validation sequences, or all of them; the tokens their loss masks count).
      val_unigram_entropy: nats per token of the unigram distribution of the scored target tokens
        (`jaxpar.data.unigram_entropy`), the loss of a model that learned token frequencies only.
      seq_len: tokens per sequence (`data.seq_len`).
      shard_set: the training shard set's directory for `data.source: shards`, else None.
      weight: a mixture source's normalised weight; None for a whole config.
      sources: a mixture's sources by name, each with its own counts ({} without `data.sources`); the totals
        above are then over all sources (`val_unigram_entropy` over all their scored tokens).
    """

    train_tokens: int
    val_tokens: int
    train_sequences: int
    val_sequences: int
    val_scored_sequences: int
    val_scored_tokens: int
    val_unigram_entropy: float
    seq_len: int
    shard_set: str | None = None
    weight: float | None = None
    sources: dict[str, DataInfo] = dataclasses.field(default_factory=dict)

    def val_coverage(self) -> str:
        """What each evaluation scores, in words (for log lines): "N validation tokens (a of b validation
        sequences)"."""
        return (
            f"{self.val_scored_tokens:,} validation tokens ({self.val_scored_sequences:,} of "
            f"{self.val_sequences:,} validation sequences)"
        )
