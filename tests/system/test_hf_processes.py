"""Hugging Face weights in and out of a job of 2 real processes (`jax.distributed` on 127.0.0.1 through
`jaxpar-launch`, 4 CPU devices each; tests/hf_load_worker.py): each process reads only the slices of the
safetensors its own devices hold, and they are the eager load's bit for bit; `import-hf` and `export-hf` run on both
processes and give the fixture's tensors back bit for bit (Llama, and Mixtral's stacked experts)."""

import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from hf_helpers import MIXTRAL, UNTIED, assert_same_tensors
from step_helpers import child_env, to_host

import jaxpar
from jaxpar.model.hf import load_hf

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where hf_load_worker.py is
WORKER = os.path.join(HERE, "hf_load_worker.py")
ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipeline=1"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_read_their_own_slices_and_convert_both_ways(tmp_path):
    """Slow (about 6 s on 2 CPU cores: two jax processes that start, import and export two models)."""
    launch = [sys.executable, "-m", "jaxpar.cli.launch", "-n", "2", "--devices-per-process", "4", "--grace", "2"]
    cmd = [*launch, "--", sys.executable, WORKER, str(tmp_path), UNTIED, MIXTRAL]
    env = child_env(drop=("XLA_FLAGS",), JAX_PLATFORMS="cpu", PYTHONPATH=os.path.dirname(HERE))
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the 2 processes timed out:\n{stdout[-3000:]}{stderr[-2000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-2000:]
    for fixture in (UNTIED, MIXTRAL):
        here = tmp_path / os.path.basename(fixture)
        records = [json.loads((here / f"process_{i}.json").read_text()) for i in range(2)]
        for r in records:
            print(os.path.basename(fixture), r)
            # Each process read exactly the distinct blocks its own devices hold: a part of the files, not all.
            assert r["equal"] and r["read"] == r["blocks"] and r["read"] < r["total"]
        assert sum(r["read"] for r in records) >= records[0]["total"]  # between them, every tensor
        assert_same_tensors(str(here / "export"), fixture)
        restored = jaxpar.restore(str(here / "run"), ONE_DEVICE, devices=jax.devices()[:1])
        assert restored.step == 0
        jax.tree.map(np.testing.assert_array_equal, to_host(restored.params), load_hf(fixture).params)
