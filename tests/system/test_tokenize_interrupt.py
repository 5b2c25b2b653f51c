"""`jaxpar-data tokenize` killed (SIGKILL, in the middle of writing a shard) or interrupted (SIGINT, as Ctrl-C sends)
with a pool of 2 worker processes: the same command run again continues from the finished shards and ends with the
bytes of an uninterrupted run. The signal is raised by the process itself at a chosen point (a patched shard
writer), so the test does not depend on timing."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from tokenize_helpers import write_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs jaxpar-data's main with the shard writer patched: on its 3rd call, half a tokens file is written under its
# temporary name and then the signal is sent to this process.
_SIGNAL_AT_THIRD_SHARD = """
import os, signal, sys
from jaxpar.cli import data
from jaxpar.data import shards

real, calls = shards.write_npy, []

def write_npy(path, pieces, dtype):
    calls.append(path)
    if len(calls) == 5:  # tokens of shard 0, offsets of shard 0, tokens of shard 1, ..., tokens of shard 2
        with open(path + shards.PARTIAL, "wb") as f:
            f.write(b"half")
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    return real(path, pieces, dtype)

shards.write_npy = write_npy
# Ctrl-C raises KeyboardInterrupt, as in a terminal, even where this test runs as a background job (whose shell
# hands it SIGINT ignored, which Python then keeps)
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(data.main(sys.argv[2:]))
"""


def _files(directory: str) -> dict[str, str]:
    out = {}
    for d, _, names in os.walk(directory):
        for n in names:
            if n != ".lock":
                path = os.path.join(d, n)
                out[os.path.relpath(path, directory)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def _processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds `marker` (from /proc), waiting up to 30 s for exiting ones to go."""
    deadline = time.monotonic() + 30
    while True:
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/environ", "rb") as f:
                        environ = f.read()
                    with open(f"/proc/{name}/stat") as f:
                        state = f.read().rsplit(")", 1)[1].split()[0]
                except OSError:
                    continue
                if marker.encode() in environ and state != "Z":
                    found.append(int(name))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


@pytest.mark.parametrize("sig, status", [("SIGKILL", -signal.SIGKILL), ("SIGINT", 130)])
def test_interrupted_run_continues_to_the_same_bytes(tmp_path, sig, status):
    write_corpus(str(tmp_path))
    marker = f"JAXPAR_TEST_RUN={uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": ROOT, "JAXPAR_TEST_RUN": marker.split("=", 1)[1]}
    args = ["tokenize", str(tmp_path / "text"), "--tokenizer", "byte", "--shard-tokens", "4000", "--workers", "2"]
    args += ["--no-progress"]
    whole = subprocess.run(
        [sys.executable, "-m", "jaxpar.cli.data", *args, "--out", str(tmp_path / "whole")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert whole.returncode == 0, whole.stderr
    cut = subprocess.Popen(
        [sys.executable, "-c", _SIGNAL_AT_THIRD_SHARD, sig, *args, "--out", str(tmp_path / "cut")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, err = cut.communicate(timeout=300)
    assert cut.returncode == status, err
    if sig == "SIGINT":
        assert "interrupted; the finished shards" in err and "run the same command again" in err
    manifest = json.load(open(tmp_path / "cut" / "manifest.json"))
    assert not manifest["complete"] and len(manifest["shards"]) == 2
    assert any(n.endswith(".partial") for n in os.listdir(tmp_path / "cut"))
    assert _processes_with(marker) == []  # no worker outlives the command
    again = subprocess.run(
        [sys.executable, "-m", "jaxpar.cli.data", *args, "--out", str(tmp_path / "cut")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr
    assert "2 finished shards verified; continuing after them" in again.stdout
    assert _files(str(tmp_path / "cut")) == _files(str(tmp_path / "whole"))
