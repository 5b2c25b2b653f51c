"""`jaxpar-checkpoints`: steps, saved config and mesh, data position and array metadata of a checkpoint on disk."""

import dataclasses
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.checkpoint.info import checkpoint_info
from jaxpar.checkpoint.store import Checkpointer
from jaxpar.cli.checkpoints import main
from jaxpar.config.schema import Config


def _state(mesh):
    """params w_DF [8, 16] fp32 sharded (data, fsdp), b_F [16] bf16 replicated; adam state; int32 step."""
    params = {
        "w_DF": jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("data", "fsdp"))),
        "b_F": jax.device_put(jnp.zeros((16,), jnp.bfloat16), NamedSharding(mesh, P())),
    }
    return {"params": params, "opt_state": optax.adam(1e-3).init(params), "step": jnp.array(4, jnp.int32)}


def _config():
    cfg = Config()
    cfg = cfg.replace(
        mesh=dataclasses.replace(cfg.mesh, data=2, fsdp=4, tensor=1, pipeline=1),
        optimizer=dataclasses.replace(cfg.optimizer, zero_stage=2),
        model=dataclasses.replace(cfg.model, d_model=16, n_layers=3, d_ff=48),
    )
    return cfg.to_dict()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run dir with complete steps 2 and 4, a crashed save of 6 (Orbax tmp dir), a hand-made step 9 and a
    step 3 set aside as unreadable."""
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    run = tmp_path_factory.mktemp("run")
    ckpt = Checkpointer(str(run / "checkpoints"), every_steps=1, keep=3, async_save=False)
    state = _state(mesh)
    for step in (2, 4):
        ckpt.save(step, state, data_state={"next_sample": 8 * step}, config=_config())
    ckpt.close()
    os.makedirs(run / "checkpoints" / "6.orbax-checkpoint-tmp" / "state")
    os.makedirs(run / "checkpoints" / "9" / "state")
    os.makedirs(run / "checkpoints" / "3.corrupt" / "state")  # set aside by a restore that could not read it
    return run, len(jax.tree.leaves(state))


def test_text_lists_steps_config_and_arrays(run_dir, capsys):
    run, n_leaves = run_dir
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "complete steps: 2, 4 (latest 4)" in out
    assert "incomplete: 6.orbax-checkpoint-tmp (step 6;" in out
    assert "incomplete: 9 (step 9; no commit_success.txt" in out
    assert "incomplete: 3.corrupt (step 3; set aside" in out
    assert "step 4: " in out  # the latest complete step, not the incomplete 6 or 9
    assert "mesh: data=2 fsdp=4 tensor=1 pipeline=1 context=1 (8 devices)" in out
    assert "zero_stage: 2" in out and "d_model=16 n_layers=3" in out
    assert 'data position: {"next_sample": 32}' in out
    assert "arrays saved from mesh: data=2 fsdp=4" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines()[-n_leaves:]}
    assert lines["params.w_DF"] == ["params.w_DF", "(8,", "16)", "float32", "P(data,", "fsdp)"]
    assert lines["params.b_F"][:3] == ["params.b_F", "(16,)", "bfloat16"]
    assert lines["opt_state.0.mu.w_DF"][1:4] == ["(8,", "16)", "float32"]
    assert lines["step"][1:3] == ["()", "int32"]


def test_json_step_dir_and_checkpoints_dir(run_dir, capsys):
    run, n_leaves = run_dir
    assert main([str(run / "checkpoints"), "--step", "2", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["steps"] == [2, 4] and info["step"] == 2 and info["data"] == {"next_sample": 16}
    assert [e["step"] for e in info["incomplete"]] == [3, 6, 9]
    assert info["summary"]["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1, "pipeline": 1, "context": 1}
    assert info["summary"]["zero_stage"] == 2 and info["config"]["model"]["d_ff"] == 48
    arrays = {a["name"]: a for a in info["arrays"]}
    assert len(arrays) == n_leaves  # every array of the state, no empty optax nodes
    assert arrays["params.w_DF"]["shape"] == [8, 16] and arrays["params.w_DF"]["bytes"] == 8 * 16 * 4
    assert arrays["opt_state.0.nu.b_F"]["dtype"] == "bfloat16"
    assert info["num_params"] == 8 * 16 + 16
    # A step dir names its step; the library call sees the same as the CLI.
    assert checkpoint_info(str(run / "checkpoints" / "2"))["step"] == 2
    assert checkpoint_info(str(run / "checkpoints"))["step"] == 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["{tmp}/missing"], "does not exist"),
        (["{tmp}"], "no complete checkpoint in"),
        (["{run}", "--step", "3"], "no complete checkpoint for step 3 .*complete steps: 2, 4"),
        (["{run}", "--step", "9"], "step 9 .*no commit_success.txt"),
        (["{run}/checkpoints/9"], "step 9"),
        (["{run}/checkpoints/6.orbax-checkpoint-tmp"], "unfinished save"),
        (["{run}/checkpoints/2", "--step", "4"], "contradicts"),
    ],
)
def test_errors_exit_2_without_traceback(run_dir, tmp_path, capsys, args, message):
    run, _ = run_dir
    argv = [a.format(tmp=tmp_path, run=run) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxpar-checkpoints: error: ") and "Traceback" not in err
    assert re.search(message, err), err


def test_damaged_metadata_names_the_step(run_dir, tmp_path, capsys):
    run, _ = run_dir
    shutil.copytree(run / "checkpoints" / "4", tmp_path / "4")
    (tmp_path / "4" / "state" / "_METADATA").write_text("{not json")
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cannot read the metadata of step 4" in err and "Traceback" not in err
