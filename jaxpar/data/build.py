"""`build_loaders`: the training and validation loaders a `data` config names, one source or a mixture."""

from __future__ import annotations

import jax

from jaxpar.config import DataConfig
from jaxpar.data.info import DataInfo
from jaxpar.data.loader import DataLoader, EvalLoader, split_rows
from jaxpar.data.mixture import MixtureEvalLoader, MixtureLoader
from jaxpar.data.mixture_loaders import build_mixture_loaders
from jaxpar.data.stats import unigram_entropy_of_counts


def build_loaders(
    data_cfg: DataConfig,
    global_batch_size: int,
    sharding: jax.sharding.NamedSharding,
    vocab_size: int | None = None,
    eval_batches: int = 0,
    vocab_multiple: int = 1,
) -> tuple[DataLoader | MixtureLoader, EvalLoader | MixtureEvalLoader, DataInfo]:
    """Reads, splits and packs the corpus (or, for `data.source: shards`, opens the shard set to be read lazily,
    `jaxpar.data.stream`); returns (train_loader, val_loader, info). A mixture (`data.sources`) gives a
    `jaxpar.data.MixtureLoader` and `MixtureEvalLoader` instead (`jaxpar.data.mixture_loaders`).

    `vocab_multiple` (mesh.tensor) is what model.vocab_size must be a multiple of; the fix an out-of-vocabulary
    token error suggests is the smallest size that holds every id and is such a multiple.

    The train loader shuffles with `data.seed` (`synthetic` rows, independent draws, are served in row order);
    the validation loader is an `EvalLoader` over the first `eval_batches` global batches' worth of validation
    sequences in file order (0: all of them). info: the splits' counts and what each evaluation covers
    (`jaxpar.data.info.DataInfo`).

    Raises:
      ConfigError: from `load_tokens`, `jaxpar.data.stream.shard_splits` or
        `jaxpar.data.synthetic.synthetic_splits`, a train split with fewer than
        `global_batch_size` sequences, an empty validation split, or a token id >= `vocab_size` (when given; for
        shards, a tokenizer with more ids than `vocab_size`).
    """
    if data_cfg.sources:
        return build_mixture_loaders(data_cfg, global_batch_size, sharding, vocab_size, eval_batches, vocab_multiple)
    train, val, train_len, val_len, shard_set = split_rows(data_cfg, vocab_size, vocab_multiple)
    shuffle = data_cfg.source != "synthetic"  # synthetic rows are independent draws: served in row order
    train_loader = DataLoader(train, global_batch_size, sharding, data_cfg.seed, shuffle=shuffle, split="train")
    val_loader = EvalLoader(val, global_batch_size, sharding, max_batches=eval_batches)
    scored_tokens, counts = val_loader.target_stats()
    info = DataInfo(
        train_tokens=int(train_len),
        val_tokens=int(val_len),
        train_sequences=train_loader.num_sequences,
        val_sequences=val_loader.num_sequences,
        val_scored_sequences=val_loader.num_scored,
        val_scored_tokens=scored_tokens,
        val_unigram_entropy=unigram_entropy_of_counts(counts),
        seq_len=data_cfg.seq_len,
        shard_set=None if shard_set is None else shard_set.directory,
    )
    return train_loader, val_loader, info
