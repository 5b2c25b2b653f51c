"""Faults and topology changes with real processes (`jaxpar-launch`, jax.distributed on 127.0.0.1, gloo).

One uninterrupted reference run (2 processes x 4 devices, data=2 fsdp=2 tensor=2, ZeRO-1, 6 steps, a checkpoint
every 2) is compared with: a SIGTERM to one process, a SIGKILL of one process, a stalled process, and restores of
its step-2 checkpoint onto other process counts, meshes and ZeRO stages. Faults are injected with
JAXPAR_INJECT_FAULT (jaxpar.training.faults). Every launch has a hard timeout.
"""

import json
import os
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from step_helpers import child_env

from jaxpar.checkpoint.store import restore_from_path
from jaxpar.cli.launch import free_port
from jaxpar.config import load_config
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.plan import build_plan
from jaxpar.training.state import abstract_state
from jaxpar.training.watchdog import EXIT_HUNG

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")
RUN = [
    "model.n_layers=2",
    "data.seq_len=32",
    "data.max_bytes=300000",
    "data.validation_fraction=0.3",
    "train.global_batch_size=8",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.eval_every=0",
    "train.progress_bar=false",
    "train.sample_tokens=0",
    "train.steps=6",
    "checkpoint.every_steps=2",
    "checkpoint.keep=10",
    "precision.compute_dtype=float32",
    "optimizer.warmup_steps=0",
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.tensor=2",
]
TRAIN = [sys.executable, "-m", "jaxpar.cli.train", CONFIG]
LIMIT = 300  # seconds: hard timeout of every launch


def _env(**extra):
    """Every launch here compiles the same non-pipelined steps in each process: they share the run's cache."""
    return child_env(drop=("JAXPAR_INJECT_FAULT",), compile_cache=True, **extra)


def _stream(cmd, env, timeout=LIMIT):
    """Runs `cmd`; returns (status, [(seconds since start, line)], seconds until it ended). Kills it at `timeout`."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []

    def pump():
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip("\n")))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"{cmd[:6]} did not end within {timeout} s:\n" + "\n".join(text for _, text in lines[-40:]))
    reader.join(timeout=5)
    return proc.returncode, lines, time.monotonic() - start


def _launch(run_dir, *overrides, processes=2, devices=4, fault=None, timeout=LIMIT):
    cmd = [
        sys.executable,
        "-m",
        "jaxpar.cli.launch",
        "-n",
        str(processes),
        "--devices-per-process",
        str(devices),
        "--grace",
        "3",
        "--",
        *TRAIN,
        f"train.run_dir={run_dir}",
        *RUN,
        *overrides,
    ]
    return _stream(cmd, _env(**({"JAXPAR_INJECT_FAULT": fault} if fault else {})), timeout)


def _single(run_dir, devices, *overrides):
    cmd = [*TRAIN, "--cpu-devices", str(devices), f"train.run_dir={run_dir}", *RUN, *overrides]
    return _stream(cmd, _env())


def _text(lines):
    return "\n".join(line for _, line in lines)


def _losses(run_dir):
    """step -> loss, the last row of each step (a resumed run appends)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {row["step"]: row["loss"] for row in map(json.loads, f)}


def _when(lines, text):
    return next(t for t, line in lines if text in line)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    status, lines, _ = _launch(run_dir)
    assert status == 0, _text(lines)[-3000:]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "4", "6"]
    losses = _losses(run_dir)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    return run_dir, losses


@pytest.mark.timeout(2 * LIMIT + 60)
def test_sigterm_to_one_process_saves_an_agreed_step_and_the_restart_matches(reference, tmp_path):
    _, want = reference
    # The signal comes at step 1 of 6: jax agrees on the stop step asynchronously, through the coordination
    # service, and with a signal at step 3 the agreed step sometimes fell after the last one (the run then
    # simply finished, saving step 6).
    status, lines, _ = _launch(tmp_path, fault="sigterm@1:0")
    out = _text(lines)
    assert status == 0, out[-3000:]
    assert "preempted: saved step " in out, out[-3000:]
    saved = int(out.split("preempted: saved step ")[1].split()[0])
    # Only process 0 got the signal; jax's preemption sync point makes both stop at the same step.
    assert saved >= 1 and max(int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit()) == saved
    exit_s = lines[-1][0] - _when(lines, "injecting sigterm")
    print(f"SIGTERM: saved step {saved}, launcher done {exit_s:.1f} s after the signal, 0 steps lost")
    assert exit_s < 60

    status, lines, _ = _launch(tmp_path)
    assert status == 0, _text(lines)[-3000:]
    assert f"resumed at step {saved}" in _text(lines)
    got = _losses(tmp_path)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert got == want  # bitwise: same mesh, same processes


@pytest.mark.timeout(2 * LIMIT + 60)
def test_sigkill_of_one_process_fails_fast_and_the_restart_reproduces_the_losses(reference, tmp_path):
    _, want = reference
    status, lines, _ = _launch(tmp_path, fault="kill@5:1")
    out = _text(lines)
    assert status == 128 + 9, out[-3000:]
    assert "process 1 exited with status 137" in out
    exit_s = lines[-1][0] - _when(lines, "injecting kill")
    assert exit_s < 30  # the launcher stopped the survivor, which is blocked in a collective
    complete = sorted(int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit())
    print(f"SIGKILL: launcher exited {exit_s:.1f} s after the kill; complete checkpoints {complete}")

    status, lines, _ = _launch(tmp_path)
    assert status == 0, _text(lines)[-3000:]
    resumed = int(_text(lines).split("resumed at step ")[1].split()[0])
    assert resumed == complete[-1] and resumed in (2, 4)
    print(f"SIGKILL: resumed at step {resumed}; {4 - resumed} completed steps recomputed")
    assert _losses(tmp_path) == want


@pytest.mark.timeout(LIMIT)
def test_a_stalled_process_makes_every_process_exit_naming_it(tmp_path):
    """Process 1 stalls at step 5; both processes exit with EXIT_HUNG within the watchdog time, naming it."""
    watchdog_s = 15
    port = free_port()
    procs = []
    for i in range(2):
        env = _env(
            JAXPAR_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAXPAR_NUM_PROCESSES="2",
            JAXPAR_PROCESS_ID=str(i),
            JAXPAR_INJECT_FAULT="stall@5:1",
            JAX_NUM_CPU_DEVICES="4",
        )
        cmd = [
            *TRAIN,
            f"train.run_dir={tmp_path}",
            *RUN,
            "train.steps=1000",
            "checkpoint.every_steps=0",
            f"train.watchdog_s={watchdog_s}",
        ]
        procs.append(_Async(cmd, env))
    results = [p.result(LIMIT) for p in procs]
    stall_at = _when(results[1][1], "injecting stall")
    for i, (status, lines, ended) in enumerate(results):
        out = _text(lines)
        assert status == EXIT_HUNG, f"process {i}: status {status}\n{out[-3000:]}"
        assert "missing process 1: stuck at step 5" in out, out[-3000:]
        after = ended - stall_at
        print(f"stall: process {i} exited {after:.1f} s after process 1 stalled (train.watchdog_s={watchdog_s})")
        assert watchdog_s <= after < watchdog_s + 15


class _Async:
    """`_stream` in a thread, for processes that must run side by side."""

    def __init__(self, cmd, env):
        self._out = None
        self._thread = threading.Thread(target=self._run, args=(cmd, env), daemon=True)
        self._thread.start()

    def _run(self, cmd, env):
        self._out = _stream(cmd, env)  # times relative to its own start; both start within milliseconds

    def result(self, timeout):
        self._thread.join(timeout)
        assert self._out is not None, "process did not finish"
        return self._out


# Topology changes: the reference run's step-2 checkpoint (2 processes, data=2 fsdp=2 tensor=2, ZeRO-1) restored
# onto other process counts, meshes and ZeRO stages, then trained to step 6.
TOPOLOGIES = {
    "1 process x 4 devices, fsdp=2 tensor=2": (1, 4, ["mesh.data=1"]),
    "1 process x 1 device": (1, 1, ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]),
    "1 process x 8 devices, fsdp=4 tensor=2, ZeRO-3": (1, 8, ["mesh.data=1", "mesh.fsdp=4", "optimizer.zero_stage=3"]),
    "4 processes x 2 devices, same mesh": (4, 2, []),
}


@pytest.mark.timeout(LIMIT + 60)
@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_resume_on_another_topology_continues_the_losses(reference, tmp_path, name):
    run_dir, want = reference
    processes, devices, overrides = TOPOLOGIES[name]
    restore = [f"checkpoint.restore_from={run_dir / 'checkpoints' / '2'}", *overrides]
    if processes == 1:
        status, lines, _ = _single(tmp_path, devices, *restore)
    else:
        status, lines, _ = _launch(tmp_path, *restore, processes=processes, devices=devices)
    assert status == 0, _text(lines)[-3000:]
    assert "resumed at step 2" in _text(lines)
    got = _losses(tmp_path)
    assert sorted(got) == [3, 4, 5, 6]
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in got)
    print(f"topology {name}: losses of steps 3-6 within {worst:.2e} relative of the reference")
    if overrides:
        assert worst <= 1e-6
    else:
        assert got == {s: want[s] for s in got}  # same mesh: bitwise


def test_restored_values_are_bitwise_equal_on_every_mesh(reference):
    """The step-2 arrays restored onto 1 device and onto three other 8-device layouts are bitwise equal."""
    run_dir, _ = reference
    path = str(run_dir / "checkpoints" / "2")
    layouts = [
        (1, ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]),
        (8, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
        (8, ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2", "optimizer.zero_stage=3"]),
        (8, ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "optimizer.zero_stage=2"]),
        (8, ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=2", "mesh.pipeline=2"]),
    ]
    restored, specs = [], []
    for n, overrides in layouts:
        devices = jax.devices()[:n]
        cfg = load_config(CONFIG, [*RUN, *overrides], num_devices=n)
        plan = build_plan(cfg, build_mesh(cfg, devices))
        state, data_state, _ = restore_from_path(path, abstract_state(plan))
        assert data_state == {"next_sample": 16}
        restored.append(jax.tree.map(np.asarray, state))
        specs.append([(tuple(x.sharding.mesh.shape.items()), x.sharding.spec) for x in jax.tree.leaves(state)])
    assert len({str(s) for s in specs}) == len(layouts)  # the layouts really differ
    for other in restored[1:]:
        for a, b in zip(jax.tree.leaves(restored[0]), jax.tree.leaves(other)):
            np.testing.assert_array_equal(a, b)
