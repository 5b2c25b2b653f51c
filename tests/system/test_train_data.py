"""`train(cfg, data=iterator)`: a script's own Grain iterator trains, checkpoints its state and resumes with the
same losses as an uninterrupted run; a checkpoint of the built-in loader is refused by it, with the fix."""

from __future__ import annotations

import os

import grain
import numpy as np
import pytest

from jaxpar.config import load_config
from jaxpar.training.loop import train

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "configs", "tiny.yaml")
G, T = 8, 32


def _iterator():
    """Grain: 64 synthetic sequences of T + 1 byte-vocabulary tokens, shuffled, batched G at a time."""
    rng = np.random.default_rng(0)
    rows = list(rng.integers(0, 256, size=(64, T + 1)))
    ds = (
        grain.MapDataset.source(rows)
        .shuffle(seed=1)
        .repeat()
        .map(lambda r: {"inputs": r[:-1], "targets": r[1:], "loss_mask": np.ones(T, np.float32)})
    )
    return iter(ds.to_iter_dataset().batch(G))


def _cfg(run_dir, steps: int):
    # A constant learning rate, so the schedule does not depend on train.steps and the runs are comparable.
    return load_config(
        CONFIG,
        [
            "model.n_layers=1",
            f"data.seq_len={T}",
            "data.max_bytes=200000",
            "data.validation_fraction=0.3",
            f"train.global_batch_size={G}",
            "train.eval_batches=1",
            "train.progress_bar=false",
            "train.sample_tokens=0",
            "train.log_every=1",
            "train.eval_every=0",
            f"train.steps={steps}",
            "optimizer.decay=constant",
            "optimizer.warmup_steps=0",
            "checkpoint.every_steps=2",
            "checkpoint.async_save=false",
            f"train.run_dir={run_dir}",
        ],
    )


@pytest.mark.slow  # three training runs (about 20 s on 2 cores)
def test_own_iterator_trains_and_resumes_exactly(tmp_path):
    whole = train(_cfg(tmp_path / "whole", 4), data=_iterator())
    first = train(_cfg(tmp_path / "split", 2), data=_iterator())
    rest = train(_cfg(tmp_path / "split", 4), data=_iterator())  # a fresh iterator: its state comes from the checkpoint
    assert sorted(whole.losses) == [1, 2, 3, 4] and rest.start_step == 2 and sorted(rest.losses) == [3, 4]
    assert [first.losses[s] for s in (1, 2)] == [whole.losses[s] for s in (1, 2)]
    # bitwise: the same program on the same batches (a resumed iterator that restarted would feed batch 1 again)
    assert [rest.losses[s] for s in (3, 4)] == [whole.losses[s] for s in (3, 4)]


@pytest.mark.slow  # a training run, then the refused resume (about 9 s on 2 cores)
def test_checkpoint_of_the_built_in_loader_is_refused_by_an_iterator(tmp_path):
    train(_cfg(tmp_path, 2))
    with pytest.raises(
        ValueError,
        match="the checkpoint's data position does not fit this run's data.*resume "
        "with the data the run was saved with",
    ):
        train(_cfg(tmp_path, 4), data=_iterator())


@pytest.mark.slow
def test_example_script_resumes_its_own_data_exactly():
    """examples/own_data.py (a Grain pipeline over the stdlib's text, stopped at half and resumed)."""
    import importlib.util

    path = os.path.join(os.path.dirname(CONFIG), os.pardir, "examples", "own_data.py")
    spec = importlib.util.spec_from_file_location("own_data", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.main(["--steps", "4"])
    assert out["start"] == 2 and sorted(out["resumed"]) == [3, 4] and out["same"]
    assert out["whole"][4] < out["whole"][1]  # it learns
