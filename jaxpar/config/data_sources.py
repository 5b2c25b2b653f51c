"""A data mixture's entries (`data.sources`) resolved against the `data` section, and the checks of one source.

Each entry of `data.sources` names a source and its weight; its null keys take the `data` section's values
(`jaxpar.config.schema.DataSourceConfig`). `source_configs` gives every entry as a whole single-source
`DataConfig` (with `sources` empty), so one source of a mixture is read exactly as the same settings alone.
"""

from __future__ import annotations

import dataclasses
import math
import re

from jaxpar.config.checks import check_choice, check_not_empty, check_positive
from jaxpar.config.errors import ConfigError
from jaxpar.config.keys import example
from jaxpar.config.schema import DataConfig

TEXT_SOURCES = ("stdlib", "text", "jsonl")  # data.source: text read and tokenised as the run loads it
TOKEN_SOURCES = ("tokens", "shards")  # data.source: ids tokenised before the run (a token file, a shard set)
GENERATED_SOURCES = ("synthetic",)  # data.source: ids generated from data.seed, nothing read (jaxpar.data.synthetic)
SOURCE_KINDS = TEXT_SOURCES + TOKEN_SOURCES + GENERATED_SOURCES
TOKEN_DTYPES = ("uint16", "uint32")  # data.token_dtype, and the id dtypes of a shard set (`jaxpar.data.shards`)
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_INHERITED = ("source", "path", "validation_path", "text_field", "token_dtype", "validation_fraction", "max_bytes")


def source_configs(d: DataConfig) -> list[tuple[str, float, DataConfig]]:
    """(name, normalised weight, single-source `DataConfig`) of each `data.sources` entry, in order; the weights
    sum to 1 (each entry's weight / the sum of weights). Not validated: see `check_data`."""
    total = math.fsum(s.weight for s in d.sources)
    out = []
    for s in d.sources:
        own = {k: getattr(s, k) for k in _INHERITED if getattr(s, k) is not None}
        out.append((s.name, s.weight / total, dataclasses.replace(d, sources=(), **own)))
    return out


def check_source(d: DataConfig, key: str = "data") -> None:
    """Checks one source's settings (`key` prefixes the keys named in errors: "data" or "data.sources[i]").

    Raises:
      ConfigError: an unknown source or token dtype, a missing path, a path for a generated source,
        validation_path on a non-shards source, an empty text_field, or a validation_fraction or max_bytes out of range.
    """
    check_choice(f"{key}.source", d.source, SOURCE_KINDS)
    check_choice(f"{key}.token_dtype", d.token_dtype, TOKEN_DTYPES)
    check_not_empty(f"{key}.text_field", d.text_field, "the JSONL key or Parquet column that holds the text")
    if d.source in GENERATED_SOURCES and d.path:
        inherited = " (a mixture entry without a path takes data.path: give it path: '')" if "[" in key else ""
        raise ConfigError(
            f"{key}.path={d.path!r} does not apply to {key}.source={d.source}, which reads nothing (its ids are "
            f"generated from data.seed); drop {key}.path{inherited}, or set {key}.source to the kind of file it is"
        )
    if d.source not in ("stdlib",) + GENERATED_SOURCES and not d.path:
        what = (
            "the shard set directory (jaxpar-data tokenize --out DIR)"
            if d.source == "shards"
            else "a directory, glob or file"
        )
        raise ConfigError(f"{key}.path is required for {key}.source={d.source}; give {what}")
    if d.validation_path and d.source != "shards":
        raise ConfigError(
            f"{key}.validation_path applies to {key}.source=shards, not {d.source}; drop it, "
            f"{example(f'{key}.validation_path', '')} ({key}.validation_fraction sets the held-out share)"
        )
    check_positive(f"{key}.max_bytes", d.max_bytes, allow_zero=True)
    if not 0.0 < d.validation_fraction < 1.0:
        raise ConfigError(
            f"{key}.validation_fraction={d.validation_fraction} must lie strictly between 0 and 1; "
            f"{example(f'{key}.validation_fraction')}"
        )


def check_data(d: DataConfig) -> None:
    """Checks the `data` section: the single source, or every entry of a mixture and the mixture itself.

    Raises:
      ConfigError: from `check_source`; for `data.sources`: a missing, malformed or repeated name, a weight that
        is not a finite number > 0, or a `tokens` source mixed with others under document masking (its rows
        carry no segment ids).
    """
    if not d.sources:
        check_source(d)
        return
    seen: dict[str, int] = {}
    for i, s in enumerate(d.sources):
        key = f"data.sources[{i}]"
        if not s.name or not _NAME.fullmatch(s.name):
            raise ConfigError(
                f"{key}.name={s.name!r}: every source needs a name of letters, digits, '_', '-' or '.' (it names "
                f"the source's metrics, val_loss/<name>), {example(f'{key}.name', 'web')}"
            )
        if s.name in seen:
            raise ConfigError(
                f"{key}.name={s.name!r} repeats data.sources[{seen[s.name]}].name; give each source its own name"
            )
        seen[s.name] = i
        if not math.isfinite(s.weight) or s.weight <= 0:
            raise ConfigError(
                f"{key}.weight={s.weight} must be a finite number > 0 (weights are normalised to sum to 1; drop "
                f"a source to leave it out), {example(f'{key}.weight')}"
            )
    resolved = source_configs(d)
    for i, (_, _, sd) in enumerate(resolved):
        check_source(sd, f"data.sources[{i}]")
    kinds = {sd.source for _, _, sd in resolved}
    if d.document_masking and "tokens" in kinds and len(kinds) > 1:
        raise ConfigError(
            "data.sources mixes a `tokens` source (a flat token file, no document index, so no segment ids) with "
            "sources packed with document masking; set data.document_masking=false, or tokenize the file's "
            "corpus into a shard set (jaxpar-data tokenize)"
        )
