"""What a restore checks first. Each step records its format version and the jaxpar that wrote it; a step of a
newer format is refused by every reader, naming the version, before its config or arrays are read and without
being set aside; a step written before versions were recorded reads as version 1. Seeding a run
(`--restore-from`), resuming one and `jaxpar.restore` refuse the same model changes (one check), and a step that
is not there is answered with the steps there are. Reads tests/fixtures/checkpoint_v1; nothing here compiles."""

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import pytest

import jaxpar
from jaxpar.checkpoint.format import FORMAT_ITEM, FORMAT_VERSION, CheckpointFormatError
from jaxpar.checkpoint.info import checkpoint_info
from jaxpar.checkpoint.params import restore_params
from jaxpar.checkpoint.store import Checkpointer, read_json_item, restore_from_path
from jaxpar.cli.checkpoints import main as checkpoints_main
from jaxpar.config import ConfigError, load_config
from jaxpar.config.resume import check_resume_config
from jaxpar.training.init_from import check_init_from
from jaxpar.training.start_state import check_restore_from

FIXTURE_RUN = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "checkpoint_v1", "run"
)


def _cfg(*overrides: str):
    """The fixture run's saved config with `overrides`."""
    return load_config(os.path.join(FIXTURE_RUN, "config.yaml"), list(overrides))


def test_each_step_records_its_format_and_one_without_the_record_reads_as_version_1(tmp_path):
    state = {"params": {"w": jnp.arange(4.0)}, "step": jnp.array(3, jnp.int32)}
    ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=1, async_save=False)
    ckpt.save(3, state, data_state={"next_sample": 3}, config={})
    record = read_json_item(str(tmp_path / "3"), FORMAT_ITEM)
    assert record == {"format_version": FORMAT_VERSION, "jaxpar_version": jaxpar.__version__}
    shutil.rmtree(tmp_path / "3" / FORMAT_ITEM)  # as a step written before versions were recorded
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)
    restored, data, _ = ckpt.restore(None, target)
    assert data == {"next_sample": 3} and restored["params"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    ckpt.close()
    info = checkpoint_info(str(tmp_path))
    assert info["format"] == {"format_version": 1, "jaxpar_version": None, "recorded": False, "readable": True}


NEWER = FORMAT_VERSION + 1
REFUSAL = (
    rf"checkpoint .*/run/checkpoints/4 has format version {NEWER} \(written by jaxpar 99\.0\); this jaxpar "
    rf"\({re.escape(jaxpar.__version__)}\) reads format version 1; restore it with a jaxpar that reads "
    rf"version {NEWER} \(jaxpar 99\.0 or later\)"
)


@pytest.fixture(scope="module")
def newer_run(tmp_path_factory):
    """A copy of the fixture run whose step 4 says a newer jaxpar (99.0) wrote it in format version NEWER."""
    run = tmp_path_factory.mktemp("newer") / "run"
    shutil.copytree(FIXTURE_RUN, run)
    record = run / "checkpoints" / "4" / FORMAT_ITEM / "metadata"  # Orbax's file of a JSON item
    assert json.loads(record.read_text())["format_version"] == FORMAT_VERSION
    record.write_text(json.dumps({"format_version": NEWER, "jaxpar_version": "99.0"}))
    return run


READERS = {
    "resume or seed (Checkpointer)": lambda run, tmp: restore_from_path(str(run), {}),
    "jaxpar.restore": lambda run, tmp: jaxpar.restore(str(run)),
    "export-hf": lambda run, tmp: restore_params(str(run)),
    "model.init_from": lambda run, tmp: check_init_from(_cfg(f"model.init_from={run}").model),
    "--restore-from before device work": lambda run, tmp: check_restore_from(
        _cfg(f"checkpoint.restore_from={run}", f"train.run_dir={tmp / 'new'}")
    ),
}


@pytest.mark.parametrize("reader", READERS)
def test_a_newer_format_is_refused_by_every_reader_naming_the_version(newer_run, reader, tmp_path):
    with pytest.raises(CheckpointFormatError, match=REFUSAL):
        READERS[reader](newer_run, tmp_path)
    assert os.listdir(newer_run / "checkpoints") == ["4"]  # not set aside as damaged


def test_the_commands_show_the_format_and_refuse_a_newer_one(newer_run, tmp_path, capsys):
    assert checkpoints_main([FIXTURE_RUN]) == 0
    assert f"  format version {FORMAT_VERSION}, written by jaxpar {jaxpar.__version__}\n" in capsys.readouterr().out
    assert checkpoints_main(["export-hf", str(newer_run), "--out", str(tmp_path / "hf")]) == 2
    assert re.search(REFUSAL, capsys.readouterr().err) and not (tmp_path / "hf").exists()
    assert checkpoints_main([str(newer_run), "--json"]) == 0  # inspecting it still works, saying it cannot restore
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == {"format_version": NEWER, "jaxpar_version": "99.0", "recorded": True, "readable": False}
    assert checkpoints_main([str(newer_run)]) == 0
    assert (
        f"  format version {NEWER}, written by jaxpar 99.0: this jaxpar ({jaxpar.__version__}) reads 1 and cannot "
        f"restore it\n" in capsys.readouterr().out
    )


@pytest.mark.parametrize(
    "override, refused",
    [
        ("model.moe.top_k=1", r"model\.moe\.top_k: 2 -> 1"),  # the same shapes: array checks alone miss it
        ("model.d_model=32", r"model\.d_model: 16 -> 32"),
        ("model.remat=full", None),  # how the model is computed, not what: every restore may change it
    ],
)
def test_seeding_resuming_and_restore_refuse_the_same_model_changes(override, refused, tmp_path):
    seed = _cfg(override, f"checkpoint.restore_from={FIXTURE_RUN}", f"train.run_dir={tmp_path / 'new'}")
    checks = {
        "--restore-from": lambda: check_restore_from(seed),
        "resume": lambda: check_resume_config(FIXTURE_RUN, _cfg(override)),
        "jaxpar.restore": lambda: jaxpar.restore(FIXTURE_RUN, [override]),
    }
    if refused is None:
        assert checks["--restore-from"]() is None
        assert check_resume_config(FIXTURE_RUN, _cfg(override)) == {"model.remat": ("none", "full")}
        assert checks["jaxpar.restore"]().cfg.model.remat == "full"
        return
    for check in checks.values():
        with pytest.raises(ConfigError, match=rf"cannot change the model the checkpoint .* holds \({refused}\)"):
            check()


def test_a_step_that_is_not_there_is_answered_with_the_steps_there_are(tmp_path):
    root = os.path.join(FIXTURE_RUN, "checkpoints")
    steps = (
        rf"no complete checkpoint for step 7 in {re.escape(root)}; its complete steps are 4: give one step's "
        rf"directory \(e\.g\. {re.escape(os.path.join(root, '4'))}\) or {re.escape(root)} itself for the latest"
    )
    new = f"train.run_dir={tmp_path / 'new'}"
    with pytest.raises(ConfigError, match=rf"checkpoint.restore_from=.*/checkpoints/7' \(--restore-from\): {steps}"):
        check_restore_from(_cfg(f"checkpoint.restore_from={os.path.join(root, '7')}", new))
    with pytest.raises(FileNotFoundError, match=steps):
        jaxpar.restore(FIXTURE_RUN, step=7)
    with pytest.raises(ConfigError, match=r"missing does not exist; pass a run directory"):
        check_restore_from(_cfg(f"checkpoint.restore_from={tmp_path / 'missing'}", new))
