"""jaxpar's messages go through the standard `logging` module, logger "jaxpar" (children "jaxpar.training", ...), so
a script can silence, filter or redirect them: `logging.getLogger("jaxpar").setLevel(logging.WARNING)`.

The library attaches no handler of its own (only a `NullHandler`). The commands (`jaxpar-train`, ...) and the
example scripts call `configure_logging()`: plain lines, info and warnings on stdout and errors on stderr, as
they have always printed. Multi-process runs: the training loop speaks from process 0 only, except for the
lines that name their process (the process summary at start, injected faults, the watchdog's report);
`jaxpar-launch` also prefixes every line with its process index.
"""

from __future__ import annotations

import logging
import sys

GB = 1e9  # decimal, as GPU vendors state memory
_BYTE_UNITS = (("TB", 1e12), ("GB", GB), ("MB", 1e6), ("kB", 1e3))

LOGGER = logging.getLogger("jaxpar")
LOGGER.addHandler(logging.NullHandler())
_CONFIGURED = "_jaxpar_configured"


class _CurrentStream(logging.StreamHandler):
    """A StreamHandler that writes to whatever `sys.stdout` / `sys.stderr` is when a record is emitted, so a
    caller that swaps them (a test capturing output, a command run in-process) still gets the lines."""

    def __init__(self, name: str):
        super().__init__(getattr(sys, name))
        self._name = name

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = getattr(sys, self._name)
        super().emit(record)


class _Below(logging.Filter):
    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


def configure_logging(level: int = logging.INFO) -> None:
    """Plain-line output for a command: records of `level` and up below ERROR to stdout, ERROR and up to stderr.
    Idempotent; touches only the "jaxpar" logger (propagation to the root logger is turned off so that a root
    handler does not print the lines twice)."""
    if getattr(LOGGER, _CONFIGURED, False):
        LOGGER.setLevel(level)
        return
    out = _CurrentStream("stdout")
    out.addFilter(_Below(logging.ERROR))
    err = _CurrentStream("stderr")
    err.setLevel(logging.ERROR)
    for handler in (out, err):
        handler.setFormatter(logging.Formatter("%(message)s"))
        LOGGER.addHandler(handler)
    LOGGER.setLevel(level)
    LOGGER.propagate = False
    setattr(LOGGER, _CONFIGURED, True)


def human_bytes(x: float | None) -> str:
    """Bytes in the largest decimal unit that is at most `x` (GB = 1e9 bytes, as GPU vendors state memory), 4
    significant digits: `26 GB`, `431.4 kB`, `512 B`; `-` for None. The one byte formatter of jaxpar's messages and
    reports."""
    if x is None:
        return "-"
    for unit, scale in _BYTE_UNITS:
        if abs(x) >= scale:
            return f"{x / scale:.4g} {unit}"
    return f"{x:.0f} B"
