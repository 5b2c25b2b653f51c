"""The real multi-host path on one machine: `jaxpar-launch` starts processes that join through
`jax.distributed.initialize` on 127.0.0.1 (gloo collectives on CPU)."""

import json
import os
import subprocess
import sys
import time

import pytest
from step_helpers import FP32_RTOL, child_env

from jaxpar.cli.launch import launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = [
    "model.n_layers=2",
    "data.seq_len=32",
    "data.max_bytes=1000000",
    "data.validation_fraction=0.2",
    "train.global_batch_size=8",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.eval_every=0",
    "train.progress_bar=false",
    "train.sample_tokens=0",
    "train.steps=3",
    "checkpoint.every_steps=2",
    "precision.compute_dtype=float32",
    "optimizer.warmup_steps=0",
]


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {row["step"]: row["loss"] for row in map(json.loads, f)}


MESHES = {
    "tiny": [],  # data 2 x fsdp 2 x tensor 2
    # each sequence over all 8 devices, so over both processes: the ring's permutes and the batch's all-gather
    # cross them
    "context8_ring": ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.context=8", "context.strategy=ring"],
}


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("mesh", MESHES)
def test_two_processes_train_like_one(tmp_path, mesh):
    """2 processes x 4 devices reproduce the 1 x 8 run's losses; both processes save the checkpoint."""
    train = [sys.executable, "-m", "jaxpar.cli.train", os.path.join(ROOT, "configs", "tiny.yaml")]
    env = child_env(compile_cache=True)  # no pipeline stages
    one = subprocess.run(
        [*train, "--cpu-devices", "8", f"train.run_dir={tmp_path / 'one'}", *RUN, *MESHES[mesh]],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxpar.cli.launch",
            "-n",
            "2",
            "--devices-per-process",
            "4",
            "--",
            *train,
            f"train.run_dir={tmp_path / 'two'}",
            *RUN,
            *MESHES[mesh],
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-2000:]
    for i in (0, 1):  # every process logs itself once, with its local devices
        assert f"[{i}] jaxpar: process {i}/2: local devices" in two.stdout
    assert "of 8 (cpu)" in two.stdout
    want, got = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(got) == [1, 2, 3]
    for step in want:
        # One process or two: the same fp32 sums in another order (gloo's all-reduce), see FP32_RTOL.
        assert got[step] == pytest.approx(want[step], rel=FP32_RTOL)
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["2", "3"]


def test_launcher_fails_fast_and_stops_the_others():
    code = (
        "import os, sys, time\n"
        "if os.environ['JAXPAR_PROCESS_ID'] == '1':\n"
        "    time.sleep(0.3); sys.exit(3)\n"
        "assert os.environ['JAXPAR_NUM_PROCESSES'] == '2' and os.environ['JAX_NUM_CPU_DEVICES'] == '2'\n"
        "assert os.environ['JAXPAR_COORDINATOR_ADDRESS'].startswith('127.0.0.1:')\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    status = launch([sys.executable, "-c", code], num_processes=2, devices_per_process=2, grace=2.0)
    assert status == 3
    assert time.monotonic() - start < 15  # the sleeping process was terminated, not waited for


def test_launcher_rejects_bad_arguments_with_a_message(capsys):
    from jaxpar.cli.launch import main

    assert main(["-n", "2"]) == 2
    assert "no COMMAND" in capsys.readouterr().err
    assert main(["-n", "0", "--", "true"]) == 2
    assert main(["-n", "2", "--devices-per-process", "0", "--", "true"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
    assert main(["-n", "1", "--", "/nonexistent/command"]) == 127
    assert "'/nonexistent/command' does not exist; give the path of an executable" in capsys.readouterr().err
    with pytest.raises(SystemExit) as help_exit:
        main(["--help"])
    assert help_exit.value.code == 0 and "--devices-per-process" in capsys.readouterr().out


def test_train_cli_rejects_a_bad_fault_spec_before_any_work(monkeypatch, capsys):
    from jaxpar.cli.train import main

    monkeypatch.setenv("JAXPAR_INJECT_FAULT", "stall@x")
    assert main([os.path.join(ROOT, "configs", "tiny.yaml")]) == 2
    assert "bad entry 'stall@x'" in capsys.readouterr().err
