"""Hang watchdog: every process exits non-zero when its training loop makes no progress for `timeout_s`.

A process that stalls or dies leaves its peers blocked inside a collective, where no Python code runs and no
exception arrives: XLA collectives have no timeout. So a daemon thread watches the time since the loop's last
`beat` (one per step, per validation batch and per checkpoint save), and after `timeout_s` without one it prints
a diagnosis and ends the process with `os._exit(EXIT_HUNG)` (the main thread cannot be interrupted).

Diagnosis. In a multi-process run every watchdog thread also publishes a heartbeat to jax's distributed
key-value store (the coordination service that `jax.distributed.initialize` starts in process 0) every
`timeout_s / 5` seconds: the loop's step, the wall time, and where the loop's thread is, from its innermost Python
frame (inside jax means it waits on a device or a collective). On a timeout a process reads all heartbeats and
names as missing every process whose heartbeat is older than `timeout_s` (it died), that is behind the furthest
step, or that sits outside jax while its peers wait inside it (it stalled before entering the collective they
wait in). If the store cannot be reached, process 0 (its host) is named. The store is reached through the client
jax itself uses, which jax does not expose (`jaxpar.parallel.jax_private.distributed_client`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import Any

import jax

from jaxpar.parallel import jax_private

EXIT_HUNG = 124  # as `timeout(1)`
_KEY = "jaxpar/heartbeat/"
_HUNG_KEY = "jaxpar/hung/"  # set when a process's watchdog fires: its peers fire too
_REPORTED_KEY = "jaxpar/reported/"  # set once its diagnosis is printed: process 0 may now end the service
_JAX_DIR = os.path.dirname(jax.__file__) + os.sep  # the installed jax package's directory


def _kv_client():
    """jax's coordination-service client, or None in a single-process run."""
    if jax.process_count() == 1:
        return None
    return jax_private.distributed_client()


def _call_with_timeout(fn, timeout_s: float):
    """fn() in a daemon thread; raises TimeoutError if it has not returned within `timeout_s` seconds."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except Exception as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"no answer in {timeout_s:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def diagnose(heartbeats: dict[int, dict], num_processes: int, now: float, timeout_s: float) -> list[str]:
    """Names the processes that are missing, one line each, from heartbeats
    {process: {"step": int, "time": unix seconds, "in_jax": bool, "where": "file:line function"}}.

    A process is missing if it published no heartbeat; if its last one is older than `timeout_s` seconds (dead
    or unreachable); if its step is behind the furthest process's; or, when all are at one step, if it sits
    outside jax while a peer waits inside jax (stalled before the collective its peers wait in). Returns []
    when every process is alive at the same step and in the same state (all wait on the device).
    """
    alive = {p: h for p, h in heartbeats.items() if now - h["time"] <= timeout_s}
    furthest = max((h["step"] for h in alive.values()), default=0)
    someone_waits = any(h.get("in_jax") for h in alive.values())
    missing = []
    for p in range(num_processes):
        h = heartbeats.get(p)
        if h is None:
            missing.append(f"process {p}: no heartbeat at all (never started the loop, or died before it)")
        elif p not in alive:
            missing.append(
                f"process {p}: last heartbeat {now - h['time']:.0f} s ago at step {h['step']} (dead or unreachable)"
            )
        elif h["step"] < furthest:
            missing.append(
                f"process {p}: stuck at step {h['step']} in {h.get('where', '?')} while others reached step {furthest}"
            )
        elif someone_waits and not h.get("in_jax"):
            missing.append(
                f"process {p}: stuck at step {h['step']} in {h.get('where', '?')}, outside the "
                f"collective its peers wait in"
            )
    return missing


def _where(thread_id: int | None) -> tuple[str, bool]:
    """("file:line function", inside jax?) of the innermost Python frame of thread `thread_id`."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return "unknown", False
    code = frame.f_code
    short = "/".join(code.co_filename.split(os.sep)[-3:])
    return f"{short}:{frame.f_lineno} {code.co_name}", code.co_filename.startswith(_JAX_DIR)


class Watchdog:
    """Exits the process with `EXIT_HUNG` after `timeout_s` seconds without a `beat`; 0 disables it.

    Use as a context manager around the training loop; `beat(step)` marks progress.
    """

    def __init__(self, timeout_s: float, exit=os._exit):
        self.timeout_s = float(timeout_s)
        self._exit = exit
        self._step = 0
        self._last_beat = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: Any = None  # the coordination-service client (`_kv_client`), None in one process
        self._thread_id: int | None = None

    def __enter__(self) -> Watchdog:
        if self.timeout_s > 0:
            self._client = _kv_client()
            self._thread_id = threading.get_ident()  # the loop's thread
            self._last_beat = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="jaxpar-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def beat(self, step: int) -> None:
        """Marks progress of the training loop at `step` (1-based step being run)."""
        self._step = step
        self._last_beat = time.monotonic()

    def _publish(self) -> None:
        if self._client is not None:
            where, in_jax = _where(self._thread_id)
            value = json.dumps({"step": self._step, "time": time.time(), "where": where, "in_jax": in_jax})
            self._client.key_value_set(f"{_KEY}{jax.process_index()}", value, allow_overwrite=True)

    def _heartbeats(self) -> dict[int, dict]:
        entries = self._client.key_value_dir_get(_KEY)
        return {int(k.rsplit("/", 1)[-1]): json.loads(v) for k, v in entries}

    def _hung(self, key: str = _HUNG_KEY) -> dict[int, str]:
        """Processes whose watchdog has fired (or, with `_REPORTED_KEY`, has printed its diagnosis)."""
        return {int(k.rsplit("/", 1)[-1]): v for k, v in self._client.key_value_dir_get(key)}

    def _run(self) -> None:
        interval = max(min(self.timeout_s / 5, 10.0), 0.1)
        while not self._stop.wait(interval):
            try:
                _call_with_timeout(self._publish, interval)
            except Exception:  # noqa: BLE001 - an unreachable store is diagnosed on timeout
                pass
            idle = time.monotonic() - self._last_beat
            if idle > self.timeout_s:
                self._fire(idle, None)
                return
            if self._client is not None:  # a peer's watchdog fired: every process reports and exits
                try:
                    hung = _call_with_timeout(self._hung, interval)
                except Exception:  # noqa: BLE001
                    hung = {}
                if hung:
                    self._fire(idle, min(hung))
                    return

    def _fire(self, idle: float, fired_by: int | None) -> None:
        me, n = jax.process_index(), jax.process_count()
        reason = (
            f"made no progress for {idle:.0f} s"
            if fired_by is None
            else f"stops because process {fired_by}'s watchdog fired (idle here {idle:.0f} s)"
        )
        lines = [f"jaxpar watchdog: process {me} {reason} at step {self._step} (train.watchdog_s={self.timeout_s:g})"]
        heartbeats: dict[int, dict] | None = None  # None: the store was not reached
        if self._client is None:
            lines.append(
                f"process {me} (this single process) is stuck in {_where(self._thread_id)[0]}: a hung "
                f"device, collective or input"
            )
        else:
            try:
                _call_with_timeout(
                    lambda: self._client.key_value_set(f"{_HUNG_KEY}{me}", lines[0], allow_overwrite=True), 10.0
                )
                heartbeats = _call_with_timeout(self._heartbeats, 10.0)
                missing = diagnose(heartbeats, n, time.time(), self.timeout_s)
                lines += [
                    f"missing {m}" + (" <- this process" if m.startswith(f"process {me}:") else "") for m in missing
                ]
                if not missing:
                    lines.append(f"every process is alive at step {self._step}: all wait on a device or collective")
            except Exception as e:  # noqa: BLE001
                lines.append(f"missing process 0: the coordination service it hosts is unreachable ({e})")
                heartbeats = None
        lines.append(f"exiting with status {EXIT_HUNG}; restart to resume from the last complete checkpoint")
        logging.getLogger("jaxpar.training").error("\n".join(lines))
        sys.stdout.flush()
        sys.stderr.flush()
        if self._client is not None and heartbeats is not None:
            try:
                if me == 0:  # this process hosts the coordination service: let the others report first
                    self._await_peers(heartbeats, n)
                else:
                    _call_with_timeout(
                        lambda: self._client.key_value_set(f"{_REPORTED_KEY}{me}", "1", allow_overwrite=True), 10.0
                    )
            except Exception:  # noqa: BLE001 - the diagnosis is printed; exiting is all that is left
                pass
        self._exit(EXIT_HUNG)

    def _await_peers(self, heartbeats: dict[int, dict], n: int) -> None:
        """Waits (at most 2 publishing intervals + 5 s) until every other live process has printed its diagnosis.

        A peer marks `_REPORTED_KEY` only after its lines are flushed: when process 0 exits, the coordination
        service it hosts goes with it, and jax aborts every peer still connected (status -6, its diagnosis lost).
        After the last mark it waits 1 s more, for the peers' own `os._exit`.
        """
        now = time.time()
        alive = {p for p, h in heartbeats.items() if now - h["time"] <= self.timeout_s} - {0}
        deadline = time.monotonic() + 2 * max(min(self.timeout_s / 5, 10.0), 0.1) + 5
        while time.monotonic() < deadline:
            if alive <= set(_call_with_timeout(lambda: self._hung(_REPORTED_KEY), 5.0)):
                time.sleep(1.0)
                return
            time.sleep(0.1)
