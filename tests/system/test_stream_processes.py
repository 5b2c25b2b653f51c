"""`data.source: shards` with real processes: `jaxpar-launch` starts K jax processes (gloo on CPU) that each run
tests/stream_worker.py, a `DataLoader` over a shard set's lazily packed rows, and record the rows they hold and the
rows they read. Each process reads only its own rows, and another process count serves the same global batches
and resumes exactly. Shape letters: G global batch size."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from jaxpar.config.schema import DataConfig
from jaxpar.data.shards import read_manifest, shard_set_digest
from jaxpar.data.stream import SHARD_SET_KEY, shard_splits
from jaxpar.data.tokenize_corpus import TokenizeOptions, tokenize_corpus

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
sys.path.insert(0, HERE)
from stream_worker import GLOBAL_BATCH as G  # noqa: E402
from stream_worker import SEQ_LEN  # noqa: E402
from tokenize_helpers import STDLIB_FILES, stdlib_path  # noqa: E402

WORKER = os.path.join(HERE, "stream_worker.py")
BATCHES = 4


def _run(shard_set, out_dir, processes: int, devices: int, batches: int, resume_state=None) -> list[dict]:
    """Launches `processes` x `devices` workers; returns their JSON results ordered by process index."""
    args = [str(shard_set), str(out_dir), "--batches", str(batches)]
    if resume_state is not None:
        os.makedirs(out_dir, exist_ok=True)
        state_file = os.path.join(out_dir, "resume_state.json")
        with open(state_file, "w") as f:
            json.dump(resume_state, f)
        args += ["--resume", state_file]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.path.dirname(HERE))
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


def _global_batches(shard_set, results: list[dict]) -> list[dict[int, list]]:
    """Assembles each global batch {row: [inputs, targets, loss_mask, segment_ids]} from the processes' rows, and
    checks that each process read exactly the G / K rows its shards hold (those rows' contents, in row order),
    disjoint from the other processes'."""
    train, _, _ = shard_splits(DataConfig(source="shards", path=str(shard_set), seq_len=SEQ_LEN))
    k = len(results)
    out = []
    for b in range(len(results[0]["batches"])):
        rows, read = {}, set()
        for r in results:
            held, asked = r["batches"][b], r["asked"][b]
            assert len(held) == len(asked) == G // k, f"process {r['process_index']} read {len(asked)} rows"
            assert not read & set(asked), "two processes read the same sample"
            read |= set(asked)
            want = train.rows(np.array(asked))
            for j, (row, *values) in enumerate(held):
                for key, value in zip(("inputs", "targets", "loss_mask", "segment_ids"), values):
                    np.testing.assert_array_equal(value, want[key][j])
                rows[row] = values
        assert sorted(rows) == list(range(G))
        out.append(rows)
    return out


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("stream") / "set"
    inputs = tuple(stdlib_path(n) for n in STDLIB_FILES)
    tokenize_corpus(TokenizeOptions(inputs, str(out), "byte", shard_tokens=9000, workers=1, progress=False))
    return out


@pytest.mark.timeout(400)
def test_each_process_reads_only_its_rows_and_another_process_count_resumes_the_same_batches(shard_set, tmp_path):
    """Three launches of jax processes (a few seconds in all). 2 processes x 2 devices read 4 global batches, each
    process only its half; 1 process x 4 devices serves the same 4 batches; 1 process x 2 devices resumes from
    the 2-process state after 2 batches and serves batches 2 and 3."""
    two = _run(shard_set, tmp_path / "two", processes=2, devices=2, batches=BATCHES)
    want = _global_batches(shard_set, two)
    digest = {SHARD_SET_KEY: shard_set_digest(read_manifest(str(shard_set)))}  # the set the position indexes
    assert two[0]["states"] == two[1]["states"] == [{"next_sample": (b + 1) * G, **digest} for b in range(BATCHES)]
    one = _run(shard_set, tmp_path / "one", processes=1, devices=4, batches=BATCHES)
    assert _global_batches(shard_set, one) == want
    resumed = _run(shard_set, tmp_path / "resumed", 1, 2, batches=2, resume_state=two[0]["states"][1])
    assert _global_batches(shard_set, resumed) == want[2:]
    assert resumed[0]["states"] == two[0]["states"][2:]
