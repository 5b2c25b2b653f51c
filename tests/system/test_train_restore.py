"""In-process runs of `train`: restoring a checkpoint of another model or whose arrays do not fit, or from a path
that holds none, or resuming with other data settings, fails with a ConfigError before any step, leaves the run
directory's config.yaml as it was and creates nothing that was not there; the saved config is fully resolved; a
resume with other settings keeps the previous config.yaml as config.step<N>.yaml."""

import logging
import os

import optax
import pytest
import yaml

from jaxpar.config import ConfigError, load_config
from jaxpar.config.resume import config_changes
from jaxpar.training.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = [
    "model.n_layers=2",
    "data.seq_len=32",
    "data.max_bytes=300000",
    "data.validation_fraction=0.3",
    "train.global_batch_size=8",
    "train.eval_batches=1",
    "train.progress_bar=false",
    "train.sample_tokens=0",
    "train.steps=2",
    "checkpoint.every_steps=2",
    "checkpoint.async_save=false",
]


def _cfg(run_dir, *overrides):
    return load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [*SMALL, f"train.run_dir={run_dir}", *overrides])


@pytest.mark.slow  # a training run, then refusals that each build a plan (about 20 s on 2 cores)
def test_mismatched_checkpoint_is_refused_and_saved_config_kept(tmp_path, caplog):
    result = train(_cfg(tmp_path))
    assert result.start_step == 0 and sorted(result.losses) == [2]
    saved = (tmp_path / "config.yaml").read_text()
    resolved = yaml.safe_load(saved)
    assert resolved["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "pipeline": 1, "context": 1}  # -1 filled in
    assert resolved["model"]["head_dim"] == 32 and resolved["tensor"]["sequence_parallel"] is True
    assert resolved["precision"]["compute_dtype"] == "float32"

    # Another model is refused by its config before any array is compared (the check of every restore) ...
    other_model = r"cannot change the model .* \(model\.d_model: 128 -> 64; model\.head_dim: 32 -> 16\)"
    with pytest.raises(ConfigError, match=other_model):
        train(_cfg(tmp_path, "model.d_model=64", "train.steps=4"))
    # ... and arrays that do not fit (another optimizer's state) by the arrays, every difference counted.
    mismatch = r"does not fit this config \(\d+ arrays differ, e\.g\. opt_state\..*train\.run_dir"
    with pytest.raises(ConfigError, match=mismatch):
        train(_cfg(tmp_path, "train.steps=4"), optimizer=optax.sgd(1e-3))
    assert (tmp_path / "config.yaml").read_text() == saved

    resumed = train(_cfg(tmp_path, "mesh.data=1", "mesh.tensor=1", "optimizer.zero_stage=3", "train.steps=3"))
    assert resumed.start_step == 2 and sorted(resumed.losses) == [3]
    # Resumed with other settings: the previous config.yaml is kept as config.step2.yaml, the new one written.
    assert (tmp_path / "config.step2.yaml").read_text() == saved
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["optimizer"]["zero_stage"] == 3

    # The run's own checkpoints win over checkpoint.restore_from (which only seeds a fresh run), so the same
    # command run again resumes instead of going back to the seed.
    with caplog.at_level(logging.INFO, logger="jaxpar"):
        again = train(
            _cfg(
                tmp_path,
                "mesh.data=1",
                "mesh.tensor=1",
                "optimizer.zero_stage=3",
                "train.steps=3",
                f"checkpoint.restore_from={tmp_path / 'checkpoints' / '2'}",
            )
        )
    assert again.start_step == 3 and again.losses == {}
    assert "has reached train.steps=3: nothing to train" in caplog.text
    saved = (tmp_path / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"already at step 3, past train.steps=2; raise train.steps"):
        train(_cfg(tmp_path, "mesh.data=1", "mesh.tensor=1", "optimizer.zero_stage=3", "train.steps=2"))
    assert (tmp_path / "config.yaml").read_text() == saved
    # Other data would make the checkpoint's data position serve other batches: refused before any write.
    with pytest.raises(ConfigError, match=r"trained on other data \(data\.seed: \d+ -> 7\).*fresh train\.run_dir"):
        train(_cfg(tmp_path, "mesh.data=1", "mesh.tensor=1", "optimizer.zero_stage=3", "train.steps=4", "data.seed=7"))
    assert (tmp_path / "config.yaml").read_text() == saved and not (tmp_path / "config.step3.yaml").exists()

    # A fresh run seeded from a checkpoint that does not fit leaves nothing behind: no run directory, no
    # checkpoints/ inside it, whether or not the run directory existed before.
    fresh, existing = tmp_path / "fresh" / "run", tmp_path / "existing"
    existing.mkdir()
    for run_dir in (fresh, existing):
        with pytest.raises(ConfigError, match="cannot change the model"):
            train(_cfg(run_dir, "model.d_model=64", f"checkpoint.restore_from={tmp_path}"))
    assert not (tmp_path / "fresh").exists() and list(existing.iterdir()) == []


def test_config_changes_ignore_the_seed_checkpoint_and_process_settings():
    saved = {
        "optimizer": {"learning_rate": 3e-3},
        "checkpoint": {"restore_from": ""},
        "distributed": {"num_processes": 2},
        "data": {"seed": 0},
    }
    new = {
        "optimizer": {"learning_rate": 0.5},
        "checkpoint": {"restore_from": "/x"},
        "distributed": {"num_processes": 1},
        "data": {"seed": 0},
        "train": {"new_key": 1},
    }
    assert config_changes(saved, new) == {"optimizer.learning_rate": (3e-3, 0.5)}


def test_restore_from_bad_paths_fail_before_device_work(tmp_path):
    empty = tmp_path / "not_a_checkpoint"
    empty.mkdir()
    (empty / "notes.txt").write_text("hello")
    (tmp_path / "empty_dir").mkdir()
    for source, message in (
        (tmp_path / "missing", "does not exist; pass a run directory"),
        (empty, "no complete checkpoint"),
        (tmp_path / "empty_dir", "no complete checkpoint"),
    ):
        with pytest.raises(ConfigError, match=rf"checkpoint.restore_from=.* \(--restore-from\): .*{message}"):
            train(_cfg(tmp_path / "run", f"checkpoint.restore_from={source}"))
        assert not (tmp_path / "run").exists()  # no run directory, no empty checkpoints/ in it
