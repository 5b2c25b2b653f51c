"""Which lines of a launched process's output `jaxpar-launch` shows: the libraries' own chatter is dropped, errors
and everything unknown are kept.

Three libraries under jax print to the process's stdout/stderr by themselves, outside Python's `logging`:

* Gloo (jax.distributed's CPU collectives) prints one connection line per peer mesh it builds, about 40 for a
  two-process run of configs/tiny.yaml, from several threads at once, so lines arrive interleaved and split;
* absl, the C++ logging of jaxlib/XLA, prints `I`/`W`/`E`/`F` lines with its own prefix (INFO lines only when
  TF_CPP_MIN_LOG_LEVEL=0: jax sets it to 1 unless the user set it);
* XLA's slow-compile alarm prints a multi-line banner at ERROR severity when a compile passes 2 minutes, which
  under load on CPU says nothing about a bug.

`RULES` is the table every line meets, first match wins; lines no rule matches are kept, absl WARNING lines among
them. `OutputFilter` applies it to one process's lines, with the state that spans lines (a banner's `*****` lines,
the newlines Gloo's split lines leave behind).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KEEP, DROP = "keep", "drop"


# absl's log prefix after its severity letter, `I1204 00:19:27.239434    7550 coordination_service.h:482] ` (MMDD,
# time, thread, file:line of the C++ source). Before absl is initialised the date and time read
# `0000 00:00:<unix seconds>`.
def _absl(severities: str, file: str = r"[^ :\]]+") -> str:
    return rf"[{severities}]\d{{4}} \d\d:\d\d:\d+\.\d+ +\d+ {file}:\d+\]"


ABSL_PREFIX = re.compile(_absl("IWEF"))

# Gloo's TCP transport, tcp::Context::printConnectivityInfo: std::cout << "[Gloo] Rank " << rank << " is connected
# to " << n << " peer ranks. " << "Expected number of connected peer ranks is : " << size - 1 << std::endl, printed
# unconditionally (no setting turns it off). Each `<<` is its own write, so lines of concurrent threads interleave.
GLOO_CONNECTED = re.compile(
    r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. Expected number of connected peer ranks is : \1(?!\d)"
)
# What is left of such lines when other threads' writes split them: only their words, digits and spaces.
GLOO_FRAGMENTS = re.compile(
    r"^(?=.*(?:\[Gloo\]|connected|peer ranks))"
    r"(?:\[Gloo\]|Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :|\d|\s)+$"
)


@dataclass(frozen=True)
class Rule:
    """One row of the table: lines in which `pattern` is found get `verdict` (KEEP or DROP)."""

    name: str
    verdict: str
    source: str
    pattern: re.Pattern[str]


RULES: tuple[Rule, ...] = (
    Rule(
        "xla-slow-compile",
        DROP,
        "XLA's SlowCompilationAlarm (logged from slow_operation_alarm.cc): LOG(ERROR) after 2 min of compiling, "
        "a `*****` / `[Compiling module M] Very slow compile? If you want to file a bug, ...` / `*****` block, "
        "and `The operation took ...` when the compile ends",
        re.compile("^" + _absl("EW", r"slow_operation_alarm\.cc") + r"|Very slow compile\? If you want to file a bug"),
    ),
    Rule(
        "absl-info",
        DROP,
        "absl INFO lines (coordination service, PjRt client), by their severity even where they name an error "
        "(`Polling for error from coordination service`)",
        re.compile("^" + _absl("I")),
    ),
    Rule("error", KEEP, "any line that names an error or a traceback", re.compile(r"error|Traceback", re.IGNORECASE)),
    Rule("absl-error", KEEP, "absl ERROR and FATAL lines", re.compile("^" + _absl("EF"))),
    Rule(
        "absl-preinit",
        DROP,
        "absl, once, at the first log line before absl::InitializeLog(), which jaxlib never calls",
        re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$"),
    ),
    Rule(
        "gloo-partial-mesh",
        KEEP,
        "Gloo's connection line when fewer peers than expected connected (followed by `is NOT connected to: [...]`, "
        "which no rule drops): the expected count is there and differs from the connected one. A line whose count "
        "another thread's write split off is a fragment",
        re.compile(
            r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. Expected number of connected peer ranks is : "
            r"(?!\1(?!\d))\d+"
        ),
    ),
    Rule("gloo-fragment", DROP, "pieces of Gloo's connection lines split by other threads' writes", GLOO_FRAGMENTS),
)


def rule_for(line: str) -> Rule | None:
    """The first row of `RULES` whose pattern is in `line` (one line, no newline), or None for an unknown line
    (kept)."""
    return next((rule for rule in RULES if rule.pattern.search(line)), None)


class OutputFilter:
    """Filters one process's output line by line; keeps the state that spans lines, so use one per process."""

    def __init__(self) -> None:
        self._in_banner = False  # inside XLA's slow-compile block: its `*****` and blank lines go with it
        self._after_gloo = False  # after Gloo chatter a blank line is another thread's std::endl

    def __call__(self, line: str) -> list[str]:
        """The lines to show, without newlines, for one line as read (with or without its newline): none, the
        line (less any whole Gloo connection lines inside it), or several where an absl line was glued to the end
        of another line (a progress bar that ends without a newline)."""
        line = line.rstrip("\n")
        starts = [0] + [m.start() for m in ABSL_PREFIX.finditer(line) if m.start() > 0]
        pieces = [line[a:b] for a, b in zip(starts, starts[1:] + [len(line)])]
        return [piece for piece in (self._one(p) for p in pieces) if piece is not None]

    def _one(self, piece: str) -> str | None:
        text = GLOO_CONNECTED.sub("", piece)
        if not text.strip():  # a blank line, or nothing but whole Gloo lines
            self._after_gloo |= text != piece
            return None if self._after_gloo or self._in_banner else text
        if self._in_banner and not text.strip().strip("*"):
            return None
        if self._after_gloo and text.strip().isdigit():  # a count split off a Gloo line by another thread's write
            return None
        rule = rule_for(text)
        self._in_banner = rule is not None and rule.name == "xla-slow-compile"
        self._after_gloo = text != piece or (rule is not None and rule.name == "gloo-fragment")
        return text if rule is None or rule.verdict == KEEP else None
