"""The hang watchdog's diagnosis from heartbeats, its timer in one process, and the fault-injection spec.
The two-process stall is in test_multiprocess_faults.py."""

import json
import logging
import threading
import time

import jax
import pytest

from jaxpar.log import configure_logging
from jaxpar.training import faults
from jaxpar.training.watchdog import EXIT_HUNG, Watchdog, diagnose


def _beat(step, age, in_jax=True, where="jax/_src/stages.py:1 __call__"):
    return {"step": step, "time": 1000.0 - age, "in_jax": in_jax, "where": where}


def test_diagnose_names_dead_behind_and_stalled_processes():
    now, timeout = 1000.0, 30.0
    # all alive at one step, all in jax: nobody to blame (a device or collective hang)
    assert diagnose({0: _beat(5, 1), 1: _beat(5, 2)}, 2, now, timeout) == []
    # process 1 outside jax while process 0 waits in the collective
    stalled = diagnose({0: _beat(5, 1), 1: _beat(5, 1, False, "jaxpar/data/loader.py:90 next_batch")}, 2, now, timeout)
    assert len(stalled) == 1 and stalled[0].startswith("process 1: stuck at step 5 in jaxpar/data/loader.py:90")
    # process 2 is behind the others
    behind = diagnose({0: _beat(7, 1), 1: _beat(7, 1), 2: _beat(6, 1)}, 3, now, timeout)
    assert len(behind) == 1 and "process 2: stuck at step 6" in behind[0] and "reached step 7" in behind[0]
    # a stale heartbeat: dead; a missing one: never started
    dead = diagnose({0: _beat(5, 1), 1: _beat(5, 45)}, 3, now, timeout)
    assert dead[0].startswith("process 1: last heartbeat 45 s ago at step 5 (dead")
    assert dead[1].startswith("process 2: no heartbeat")
    assert len(dead) == 2


def test_single_process_watchdog_fires_after_timeout_and_not_while_beating(capsys):
    configure_logging()  # the commands' stderr line (idempotent; alone this file would otherwise see no output)
    exits = []
    fired = threading.Event()

    def fake_exit(code):
        exits.append(code)
        fired.set()

    with Watchdog(0.5, exit=fake_exit) as dog:
        for step in range(1, 8):  # beating every 0.1 s keeps it quiet
            dog.beat(step)
            time.sleep(0.1)
        assert exits == []
        assert fired.wait(5.0)  # then no beat: it fires
    assert exits == [EXIT_HUNG]
    err = capsys.readouterr().err
    assert "process 0 made no progress for" in err and "at step 7" in err
    assert "this single process) is stuck in" in err and "exiting with status 124" in err


class _Store:
    """An in-memory stand-in for jax's coordination-service key-value client, logging every set."""

    def __init__(self, events):
        self.data, self.events = {}, events

    def key_value_set(self, key, value, allow_overwrite=False):
        self.events.append(("set", key))
        self.data[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.data.items() if k.startswith(prefix)]


def test_peers_report_before_process_0_ends_the_coordination_service(monkeypatch):
    """Process 0 hosts the store, and jax aborts every peer when it exits: a peer marks itself reported only after
    its diagnosis is logged, and process 0 exits only once every live peer has (a race that lost process 1's lines)."""
    events = []
    store = _Store(events)
    for p in (0, 1):
        store.data[f"jaxpar/heartbeat/{p}"] = json.dumps(
            {"step": 5, "time": time.time(), "in_jax": p == 0, "where": "x.py:1 f"}
        )
    monkeypatch.setattr(jax, "process_count", lambda: 2)

    def fire(process):
        monkeypatch.setattr(jax, "process_index", lambda: process)
        dog = Watchdog(1.0, exit=lambda code: events.append(("exit", process)))
        dog._client = store
        dog._fire(2.0, None)

    monkeypatch.setattr(logging.getLogger("jaxpar.training"), "error", lambda msg: events.append(("log", msg)))
    waiter = threading.Thread(target=fire, args=(0,))
    waiter.start()
    time.sleep(0.5)
    assert ("exit", 0) not in events  # process 1 has not reported: process 0 waits
    fire(1)
    waiter.join(10)
    order = [e if e[0] != "log" else ("log",) for e in events]
    assert order.index(("log",), order.index(("set", "jaxpar/hung/1"))) < order.index(("set", "jaxpar/reported/1"))
    assert order.index(("set", "jaxpar/reported/1")) < order.index(("exit", 0))
    logs = [e[1] for e in events if e[0] == "log"]
    assert len(logs) == 2 and all("missing process 1: stuck at step 5 in x.py:1 f" in log for log in logs)


def test_disabled_watchdog_starts_no_thread():
    with Watchdog(0.0, exit=lambda code: pytest.fail("fired")) as dog:
        assert dog._thread is None


def test_fault_spec_parses_and_rejects_bad_entries():
    assert faults.parse("stall@5:1, kill@3,nan@7:0") == [
        faults.Fault("stall", 5, 1),
        faults.Fault("kill", 3, None),
        faults.Fault("nan", 7, 0),
    ]
    assert faults.parse("") == []
    for bad in ("stall", "explode@3", "kill@x", "stall@5:"):
        with pytest.raises(ValueError, match="kind@step\\[:process\\]"):
            faults.parse(bad)


def test_injector_fires_each_fault_once_on_its_process(monkeypatch):
    import jax.numpy as jnp
    import numpy as np

    injector = faults.FaultInjector("nan@2,nan@3:1")  # the second targets process 1, not this one
    state = {"params": {"w": jnp.ones(3)}, "step": 0}
    assert injector.before_step(1, state) is state
    poisoned = injector.before_step(2, state)
    assert np.isnan(np.asarray(poisoned["params"]["w"])).all()
    assert injector.before_step(2, state) is state  # once only: a rerun after a rollback is spared
    assert injector.before_step(3, state) is state
