"""The loaders of a `data.sources` mixture: each source's splits read as the same settings alone would read them
(`jaxpar.data.loader.split_rows`), checked to share one tokenizer, then mixed (`jaxpar.data.mixture`)."""

from __future__ import annotations

import jax

from jaxpar.config import ConfigError, DataConfig
from jaxpar.config.data_sources import source_configs
from jaxpar.data.info import DataInfo
from jaxpar.data.loader import EvalLoader, _as_rows, split_rows
from jaxpar.data.mixture import MixtureEvalLoader, MixtureLoader
from jaxpar.data.stats import unigram_entropy_of_counts

_TOKENIZER_KEYS = ("kind", "sha256", "pattern", "vocab_size", "bos_id", "eos_id")


def tokenizer_identity(source: str, shard_set=None) -> dict | None:
    """What must agree between the sources of one mixture: for a shard set its manifest's tokenizer (kind, file
    checksum, tiktoken pattern, vocab_size, BOS and EOS ids) and whether documents got BOS / EOS; {"kind": "byte"}
    for the text sources (stdlib, text, jsonl: the byte tokenizer) and for byte-tokenized shard sets; None for a
    `tokens` file, which records no tokenizer, and for `synthetic` ids, which have none."""
    if source in ("tokens", "synthetic"):
        return None
    if shard_set is None or shard_set.manifest["tokenizer"]["kind"] == "byte":
        return {"kind": "byte"}
    tok = shard_set.manifest["tokenizer"]
    identity = {k: tok.get(k) for k in _TOKENIZER_KEYS}
    identity.update(add_bos=shard_set.manifest.get("add_bos"), add_eos=shard_set.manifest.get("add_eos"))
    return identity


def _check_tokenizers(identities: list[tuple[str, dict | None]]) -> None:
    """Raises ConfigError naming two sources whose tokenizers differ, and what differs."""
    known = [(name, ident) for name, ident in identities if ident is not None]
    for name, ident in known[1:]:
        first, base = known[0]
        if ident != base:
            differ = sorted(k for k in set(ident) | set(base) if ident.get(k) != base.get(k))
            raise ConfigError(
                f"data.sources {first!r} and {name!r} were tokenized differently ({', '.join(differ)} differ: "
                f"{ {k: base.get(k) for k in differ} } vs { {k: ident.get(k) for k in differ} }); a mixture trains "
                f"one embedding table, so tokenize every source with the same --tokenizer and options"
            )


def build_mixture_loaders(
    data_cfg: DataConfig,
    global_batch_size: int,
    sharding: jax.sharding.NamedSharding,
    vocab_size: int | None = None,
    eval_batches: int = 0,
    vocab_multiple: int = 1,
) -> tuple[MixtureLoader, MixtureEvalLoader, DataInfo]:
    """(train loader, validation loader, info) of a config with `data.sources`, as `jaxpar.data.build_loaders`.

    Each source's validation loader scores its first `eval_batches` global batches' worth of validation
    sequences (0: all). info (`jaxpar.data.info.DataInfo`) holds the totals over the sources (val_unigram_entropy
    over all sources' scored tokens) and each source's own counts and normalised weight in `sources`.

    Raises:
      ConfigError: what `build_loaders` raises for one source, prefixed with the source's entry; sources
        tokenized differently (`tokenizer_identity`).
    """
    train, val, weights, identities, per_source = {}, {}, {}, [], {}
    for i, (name, weight, sd) in enumerate(source_configs(data_cfg)):
        where = f"data.sources[{i}] ({name})"
        try:
            train_rows, val_rows, train_len, val_len, shard_set = split_rows(sd, vocab_size, vocab_multiple)
            val[name] = EvalLoader(val_rows, global_batch_size, sharding, max_batches=eval_batches)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        identities.append((name, tokenizer_identity(sd.source, shard_set)))
        train[name], weights[name] = _as_rows(train_rows), weight
        scored, counts = val[name].target_stats()
        per_source[name] = DataInfo(
            weight=weight,
            train_tokens=int(train_len),
            val_tokens=int(val_len),
            train_sequences=train[name].num_sequences,
            val_sequences=val[name].num_sequences,
            val_scored_sequences=val[name].num_scored,
            val_scored_tokens=scored,
            val_unigram_entropy=unigram_entropy_of_counts(counts),
            seq_len=data_cfg.seq_len,
            shard_set=None if shard_set is None else shard_set.directory,
        )
    _check_tokenizers(identities)
    train_loader = MixtureLoader(train, weights, global_batch_size, sharding, data_cfg.seed)
    val_loader = MixtureEvalLoader(val)
    scored_tokens, counts = val_loader.target_stats()
    info = DataInfo(
        train_tokens=sum(v.train_tokens for v in per_source.values()),
        val_tokens=sum(v.val_tokens for v in per_source.values()),
        train_sequences=train_loader.num_sequences,
        val_sequences=val_loader.num_sequences,
        val_scored_sequences=val_loader.num_scored,
        val_scored_tokens=scored_tokens,
        val_unigram_entropy=unigram_entropy_of_counts(counts),
        seq_len=data_cfg.seq_len,
        sources=per_source,
    )
    return train_loader, val_loader, info
