"""`data.sources` mixtures with real processes: `jaxpar-launch` starts K jax processes (gloo on CPU) that each run
tests/mixture_worker.py, a `MixtureLoader` over two shard sets. Each process reads only its own rows, another
process count serves the same global batches, and a run resumes exactly on another process count. Shape letters:
G global batch size, K processes."""

import json
import os
import signal
import subprocess
import sys

import pytest

from jaxpar.data.tokenize_corpus import TokenizeOptions, tokenize_corpus

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
sys.path.insert(0, HERE)
from stream_worker import GLOBAL_BATCH as G  # noqa: E402
from tokenize_helpers import STDLIB_FILES, stdlib_path  # noqa: E402

WORKER = os.path.join(HERE, "mixture_worker.py")
BATCHES = 6


def _run(sets, out_dir, processes: int, devices: int, batches: int, resume_state=None) -> list[dict]:
    """Launches `processes` x `devices` workers; returns their JSON results ordered by process index."""
    args = [str(sets["web"]), str(sets["code"]), str(out_dir), "--batches", str(batches)]
    if resume_state is not None:
        os.makedirs(out_dir, exist_ok=True)
        state_file = os.path.join(out_dir, "resume_state.json")
        with open(state_file, "w") as f:
            json.dump(resume_state, f)
        args += ["--resume", state_file]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=f"{os.path.dirname(HERE)}{os.pathsep}{HERE}")
    cmd = [sys.executable, "-m", "jaxpar.cli.launch", "-n", str(processes), "--devices-per-process", str(devices)]
    cmd += ["--grace", "2", "--", sys.executable, WORKER, *args]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"launch of {processes} processes timed out:\n{stdout[-3000:]}{stderr[-2000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-2000:]
    results = []
    for i in range(processes):
        with open(os.path.join(out_dir, f"process_{i}.json")) as f:
            results.append(json.load(f))
    assert all(r["process_count"] == processes and r["local_devices"] == devices for r in results)
    return results


def _global_batches(results: list[dict]) -> list[dict[int, list]]:
    """Each global batch {row: [inputs, targets, loss_mask, segment_ids]} assembled from the processes' rows;
    checks that each process read exactly G / K rows per batch, none of them read by another process."""
    k = len(results)
    out = []
    for b in range(len(results[0]["batches"])):
        rows, read = {}, []
        for r in results:
            assert len(r["batches"][b]) == len(r["asked"][b]) == G // k
            read += [tuple(a) for a in r["asked"][b]]
            rows.update({row: values for row, *values in r["batches"][b]})
        assert len(set(read)) == len(read) == G and sorted(rows) == list(range(G))
        out.append(rows)
    return out


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    out = {}
    for name, files in (("web", STDLIB_FILES[:3]), ("code", STDLIB_FILES[3:])):
        inputs = tuple(stdlib_path(n) for n in files)
        tokenize_corpus(TokenizeOptions(inputs, str(root / name), "byte", workers=1, progress=False))
        out[name] = root / name
    return out


@pytest.mark.timeout(400)
def test_another_process_count_serves_and_resumes_the_same_mixed_batches(sets, tmp_path):
    """Three launches of jax processes (a few seconds in all). 2 processes x 2 devices read 6 mixed global
    batches, each process only its half of the rows; 1 process x 4 devices serves the same 6 batches; 1 process x
    2 devices resumes from the 2-process state after 3 batches and serves batches 3 to 5."""
    two = _run(sets, tmp_path / "two", processes=2, devices=2, batches=BATCHES)
    want = _global_batches(two)
    assert two[0]["states"] == two[1]["states"]
    assert sum(two[0]["states"][-1]["taken"].values()) == BATCHES * G
    sources = [{name for name, _ in r["asked"][0]} for r in two]
    assert sources[0] == sources[1] == {"web", "code"}  # rows interleaved: each process holds both sources
    one = _run(sets, tmp_path / "one", processes=1, devices=4, batches=BATCHES)
    assert _global_batches(one) == want and one[0]["states"] == two[0]["states"]
    resumed = _run(sets, tmp_path / "resumed", 1, 2, batches=3, resume_state=two[0]["states"][2])
    assert _global_batches(resumed) == want[3:]
    assert resumed[0]["states"] == two[0]["states"][3:]
