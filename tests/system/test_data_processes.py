"""Per-process data with real processes: `jaxpar-launch` starts K jax processes (gloo on CPU) that each run
tests/data_worker.py, a `DataLoader` over integer ids on the trainer's mesh and batch sharding, and write the batch
rows their shards hold. Shape letters: N sequences, G global batch size."""

import json
import os
import signal
import subprocess
import sys

import grain
import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where data_worker.py is
WORKER = os.path.join(HERE, "data_worker.py")
N, G, SEED = 37, 8, 3  # 4 batches per epoch; N mod G = 5 positions skipped per epoch
BATCHES = 7  # one epoch and 3 batches of the next


def _run(
    out_dir, processes: int, devices: int, batches: int, resume_state: dict | None = None, context: int = 1
) -> list[dict]:
    """Launches `processes` x `devices` workers; returns their JSON results ordered by process index."""
    args = [
        str(out_dir),
        "--batches",
        str(batches),
        "--num-sequences",
        str(N),
        "--global-batch",
        str(G),
        "--seed",
        str(SEED),
    ]
    if context > 1:
        args += ["--context", str(context)]
    if resume_state is not None:
        os.makedirs(out_dir, exist_ok=True)
        state_file = os.path.join(out_dir, "resume_state.json")
        with open(state_file, "w") as f:
            json.dump(resume_state, f)
        args += ["--resume", state_file]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.path.dirname(HERE))
    cmd = [
        sys.executable,
        "-m",
        "jaxpar.cli.launch",
        "-n",
        str(processes),
        "--devices-per-process",
        str(devices),
        "--grace",
        "2",
        "--",
        sys.executable,
        WORKER,
        *args,
    ]
    # Own process group: on a timeout the launcher and every worker it started are killed together.
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
    assert [r["process_index"] for r in results] == list(range(processes))
    assert context > 1 or all(r["process_count"] == processes and r["local_devices"] == devices for r in results)
    return results


def _global_batches(results: list[dict]) -> list[list[int]]:
    """Assembles each global batch (ids by row) from the processes' rows; checks that every process holds only
    its own share: G / K rows, disjoint from the other processes', together every row once."""
    k = len(results)
    out = []
    for b in range(len(results[0]["batches"])):
        rows: dict[int, int] = {}
        for r in results:
            held = dict(map(tuple, r["batches"][b]))
            assert len(held) == G // k, f"process {r['process_index']} holds {len(held)} rows, not G/K = {G // k}"
            assert not rows.keys() & held.keys(), "two processes hold the same batch row"
            rows.update(held)
        assert sorted(rows) == list(range(G))
        out.append([rows[i] for i in range(G)])
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """2 processes x 2 devices (mesh data=2, fsdp=2) read BATCHES global batches without stopping."""
    results = _run(tmp_path_factory.mktemp("uninterrupted"), processes=2, devices=2, batches=BATCHES)
    assert results[0]["mesh"] == {"data": 2, "pipeline": 1, "fsdp": 2, "context": 1, "tensor": 1}
    assert results[0]["batches_per_epoch"] == N // G == 4
    return results


@pytest.mark.timeout(300)
def test_two_processes_cover_one_epoch_exactly_once(uninterrupted):
    batches = _global_batches(uninterrupted)
    for ids in batches:
        assert len(set(ids)) == G, f"an id appears twice in one global batch: {ids}"
    epoch = [i for ids in batches[: N // G] for i in ids]
    assert len(epoch) == len(set(epoch)) == (N // G) * G
    # The documented drop-remainder rule: the last N mod G positions of each epoch's shuffle are skipped, and
    # the next epoch starts at its own position 0 (Grain folds the epoch into the shuffle seed).
    order = grain.MapDataset.range(N).shuffle(seed=SEED).repeat()
    assert set(range(N)) - set(epoch) == {order[p] for p in range((N // G) * G, N)}
    assert batches[N // G] == [order[N + r] for r in range(G)]
    # The state is the global sample index, identical on every process.
    assert uninterrupted[0]["states"] == uninterrupted[1]["states"]


@pytest.mark.timeout(300)
def test_two_processes_evaluate_every_sequence_once_with_the_same_padding(uninterrupted):
    """One `EvalLoader` pass over the N = 37 sequences on 2 processes: ceil(N / G) = 5 global batches, each
    row held by exactly one process, sequences 0..N-1 in order, the last 3 rows padding with no valid token."""
    batches = []
    for b in range(len(uninterrupted[0]["eval_batches"])):
        rows: dict[int, list[int]] = {}
        for r in uninterrupted:
            held = {row: [sample_id, valid] for row, sample_id, valid in r["eval_batches"][b]}
            assert len(held) == G // 2 and not rows.keys() & held.keys()
            rows.update(held)
        assert sorted(rows) == list(range(G))
        batches.append([rows[i] for i in range(G)])
    seq_len = 2  # tests/data_worker.py SEQ_LEN
    flat = [row for batch in batches for row in batch]
    assert len(batches) == -(-N // G) == 5
    assert flat == [[i, seq_len] for i in range(N)] + [[-1, 0]] * (5 * G - N)


@pytest.mark.timeout(300)
def test_resume_on_one_process_serves_the_next_global_batch(uninterrupted, tmp_path):
    """A 2-process run stops after 4 batches; 1 process x 2 devices (another process count and data-parallel
    size) resumes from its saved state and serves exactly the batches the uninterrupted run served next."""
    want = _global_batches(uninterrupted)
    stopped = _run(tmp_path / "stopped", processes=2, devices=2, batches=4)  # stops at the epoch boundary
    assert _global_batches(stopped) == want[:4]
    assert stopped[0]["states"] == stopped[1]["states"] == uninterrupted[0]["states"][:4]
    state = stopped[0]["states"][-1]
    assert state == {"next_sample": 4 * G}  # inside the skipped remainder: the resumed run must skip it too

    one = _run(tmp_path / "one", processes=1, devices=2, batches=3, resume_state=state)
    assert one[0]["mesh"]["data"] * one[0]["mesh"]["fsdp"] == 2
    assert _global_batches(one) == want[4:7]
    assert one[0]["states"] == uninterrupted[0]["states"][4:7]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_on_four_processes_serves_the_next_global_batch(uninterrupted, tmp_path):
    """4 processes x 1 device (data=4) resume mid-epoch from the state the 2-process run had after 3 batches
    (what a run stopped there saves, see the test above) and serve its batches 3..6, across the epoch boundary."""
    want = _global_batches(uninterrupted)
    four = _run(tmp_path / "four", processes=4, devices=1, batches=4, resume_state=uninterrupted[0]["states"][2])
    assert four[0]["mesh"]["data"] == 4
    assert _global_batches(four) == want[3:7]
    assert four[0]["states"] == uninterrupted[0]["states"][3:7]


def test_sequences_split_over_processes_serve_each_process_its_positions(tmp_path):
    """mesh.context = 4 over 2 processes x 2 devices: each process reads only the positions its devices hold (the
    first or the second half of every sequence, `jaxpar.data.loader`), every device gets its quarter, and together
    they hold each row's 8 tokens once."""
    results = _run(tmp_path, processes=2, devices=2, batches=1, context=4)
    assert results[0]["mesh"]["context"] == 4
    held: dict = {}
    for r in results:
        half = {p // 4 for _, p, _ in r["shards"]}
        assert half == {r["process_index"]}, "a process holds positions of the other's half"
        for row0, pos0, tokens in r["shards"]:
            assert len(tokens) == G and len(tokens[0]) == 2  # all rows, 8 / 4 positions
            for i, row in enumerate(tokens):
                ids = {t // 1000 for t in row}
                assert len(ids) == 1 and [t % 1000 for t in row] == [pos0, pos0 + 1]
                held[(row0 + i, pos0)] = ids.pop()
    assert sorted({p for _, p in held}) == [0, 2, 4, 6] and len({r for r, _ in held}) == G
    assert all(len({held[(row, p)] for p in (0, 2, 4, 6)}) == 1 for row in range(G))  # one sequence per row
