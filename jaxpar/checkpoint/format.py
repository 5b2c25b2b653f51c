"""The format of a checkpoint step: which version of the layout it has, which jaxpar wrote it, and which versions
this jaxpar reads.

Every step `jaxpar.checkpoint.store.Checkpointer.save` writes holds, beside `state/`, `data/` and `config/`, a
JSON item `format/`:

    {"format_version": 1, "jaxpar_version": "0.1.0"}

A restore reads it before anything else of the step (its config, its arrays) and refuses a version this jaxpar
does not read (`CheckpointFormatError`). A step without the item was written before jaxpar recorded versions; its
layout is version 1's, so it reads as version 1.

Version 1: `state/` the train state {"step", "params", "opt_state"[, "master"][, "fp8"]} (Orbax's StandardSave of
jax Arrays; "fp8", FP8 delayed scaling's amax history, is optional both ways: `jaxpar.checkpoint.store`), `data/`
the data iterator's position, `config/` the run's resolved config (`Config.to_dict`).
"""

from __future__ import annotations

from typing import TypeGuard

from jaxpar import __version__ as JAXPAR_VERSION
from jaxpar.config.errors import ConfigError

FORMAT_VERSION = 1
"""The format version this jaxpar writes. A change that an older jaxpar would misread, or that makes this jaxpar
read an older step differently, bumps it: a state tree with other keys or nesting (params, opt_state, master),
an item added, removed or renamed, another meaning of a data position or a config key. The same change either
teaches the restore to read the previous versions (converting them as it reads) and adds them to
`READ_VERSIONS`, or leaves them out of it, so that they are refused by name. A change after which older steps
still read as they were keeps the version: a new config key whose default keeps the old behaviour (an older
jaxpar refuses a newer step's config key it does not know, naming the key). docs/checkpoints.md states the rule;
tests/fixtures/checkpoint_v1 holds version 1 to it."""

READ_VERSIONS = (1,)  # the format versions this jaxpar restores
FORMAT_ITEM = "format"  # the step's JSON item holding `format_record()`
UNRECORDED_VERSION = 1  # a step without the item: written before versions were recorded, laid out as version 1


class CheckpointFormatError(ConfigError):
    """A checkpoint step of a format version this jaxpar does not read (a newer jaxpar wrote it). A ConfigError,
    so commands exit with status 2 and the message; nothing of the step is read, renamed or removed.

    Attributes:
      step_dir: the step's directory; version: the format version found; written_by: the jaxpar version that
        wrote it (None if not recorded).
    """

    def __init__(self, step_dir: str, version: object, written_by: str | None):
        self.step_dir, self.version, self.written_by = step_dir, version, written_by
        by = f" (written by jaxpar {written_by})" if written_by else ""
        super().__init__(
            f"checkpoint {step_dir} has format version {version!r}{by}; this jaxpar ({JAXPAR_VERSION}) reads "
            f"format version{'s' if len(READ_VERSIONS) > 1 else ''} {', '.join(map(str, READ_VERSIONS))}; "
            f"restore it with a jaxpar that reads version {version!r}"
            + (f" (jaxpar {written_by} or later)" if written_by else "")
        )

    def __reduce__(self):  # keeps the fields through pickling (multiprocessing, pytest-xdist)
        return type(self), (self.step_dir, self.version, self.written_by)


def format_record() -> dict:
    """What `Checkpointer.save` writes as the step's `format` item: {"format_version", "jaxpar_version"}."""
    return {"format_version": FORMAT_VERSION, "jaxpar_version": JAXPAR_VERSION}


def reads(version: object) -> TypeGuard[int]:
    """Whether this jaxpar restores a step of format version `version` (as recorded: any JSON value)."""
    return isinstance(version, int) and not isinstance(version, bool) and version in READ_VERSIONS


def check_format(record: dict | None, step_dir: str) -> int:
    """The format version of the step at `step_dir` whose `format` item is `record` (None: the step has none,
    version `UNRECORDED_VERSION`).

    Raises:
      CheckpointFormatError: a version outside `READ_VERSIONS` (or a record without a version).
    """
    if record is None:
        return UNRECORDED_VERSION
    version = record.get("format_version")
    if not reads(version):
        raise CheckpointFormatError(step_dir, version, record.get("jaxpar_version"))
    return version
