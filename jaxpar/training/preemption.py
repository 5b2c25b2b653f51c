"""Preemption (SIGTERM) handling: every process agrees on one step at which to save and stop.

Multi-process runs use jax's preemption sync manager (started by `jax.distributed.initialize`; it turns a
SIGTERM delivered to any process into a step that every process reaches, so all of them save the same step).
A single process installs its own SIGTERM handler that raises a flag checked between steps.
"""

from __future__ import annotations

import signal

import jax
from jax.experimental import multihost_utils


class PreemptionWatch:
    """`reached(step)` is True once a SIGTERM has arrived (on any process) and `step` is the agreed stop step.

    Use as a context manager; the single-process SIGTERM handler is removed on exit.
    """

    def __init__(self):
        self._multi = jax.process_count() > 1
        self._flag = False
        self._previous = None

    def __enter__(self) -> PreemptionWatch:
        if not self._multi:
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def _on_sigterm(self, signum, frame) -> None:
        self._flag = True

    def reached(self, step: int) -> bool:
        if self._multi:
            return multihost_utils.reached_preemption_sync_point(step)
        return self._flag
