"""Injected faults for testing recovery with real processes: `JAXPAR_INJECT_FAULT="kind@step[:process],..."`.

Kinds, each acting at the start of training step `step` (1-based) on process `process` (all processes if
omitted), before the step is dispatched:

    stall     the process sleeps (forever, in practice): its peers block in the step's collectives
    kill      the process sends itself SIGKILL (a crashed host: no cleanup, no checkpoint)
    sigterm   the process sends itself SIGTERM (a preemption notice)
    nan       the parameters are multiplied by NaN (a corrupted state: every later gradient is NaN)

    JAXPAR_INJECT_FAULT="stall@5:1" jaxpar-launch -n 2 -- jaxpar-train configs/tiny.yaml

The trainer reads the variable once, at start. It is meant for tests and fire drills; leave it unset otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import sys
import time

import jax
import jax.numpy as jnp

ENV = "JAXPAR_INJECT_FAULT"
_LOGGER = logging.getLogger("jaxpar.training")
KINDS = ("stall", "kill", "sigterm", "nan")
_SPEC = re.compile(r"(?P<kind>[a-z]+)@(?P<step>[0-9]+)(?::(?P<process>[0-9]+))?")


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    process: int | None  # None: every process


def parse(spec: str) -> list[Fault]:
    """Parses "kind@step[:process],..." (see the module docstring).

    Raises:
      ValueError: an entry that does not match, or an unknown kind.
    """
    faults = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        match = _SPEC.fullmatch(entry)
        if match is None or match["kind"] not in KINDS:
            raise ValueError(
                f"{ENV}: bad entry {entry!r}; expected kind@step[:process] with kind in {KINDS}, e.g. stall@5:1"
            )
        process = match["process"]
        faults.append(Fault(match["kind"], int(match["step"]), None if process is None else int(process)))
    return faults


class FaultInjector:
    """Applies the faults of `JAXPAR_INJECT_FAULT` (or `spec`) that target this process."""

    def __init__(self, spec: str | None = None):
        spec = os.environ.get(ENV, "") if spec is None else spec
        me = jax.process_index()
        self.faults = [f for f in parse(spec) if f.process in (None, me)]
        if self.faults:
            _LOGGER.warning(
                f"jaxpar: process {me} will inject faults {[(f.kind, f.step) for f in self.faults]} ({ENV})"
            )

    def before_step(self, step: int, state: dict) -> dict:
        """Injects this step's faults, each once (a rerun of the step after a rollback is spared); returns the
        (possibly poisoned) state."""
        due = [f for f in self.faults if f.step == step]
        self.faults = [f for f in self.faults if f.step != step]
        for fault in due:
            _LOGGER.warning(f"jaxpar: injecting {fault.kind} at step {step} on process {jax.process_index()}")
            sys.stdout.flush()
            if fault.kind == "stall":
                while True:
                    time.sleep(3600)
            elif fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            elif fault.kind == "nan":
                state = dict(state, params=jax.tree.map(lambda x: x * jnp.nan, state["params"]))
        return state
