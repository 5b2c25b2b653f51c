"""A short training run on a mixture of two text sources (`data.sources`): every metrics row that evaluated holds
`val_loss/<name>` for each source, `val_loss` is their token-weighted mean, the run's result carries the last
per-source figures, and the log lines name them. Shape letters: G global batch size."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
from jax.sharding import NamedSharding
from tokenize_helpers import STDLIB_FILES, stdlib_path

from jaxpar.config import load_config
from jaxpar.data import build_loaders
from jaxpar.parallel.mesh import build_mesh
from jaxpar.parallel.sharding import activation_spec
from jaxpar.training.loop import train

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "configs", "tiny.yaml")


def _cfg(tmp_path):
    """Source a: a directory of three stdlib files, b: one of the other three."""
    run_dir, first, second = tmp_path / "run", tmp_path / "a", tmp_path / "b"
    for folder, names in ((first, STDLIB_FILES[:3]), (second, STDLIB_FILES[3:])):
        folder.mkdir()
        for n in names:
            shutil.copy(stdlib_path(n), folder / n)
    return load_config(
        CONFIG,
        [
            "model.n_layers=1",
            "model.d_model=64",
            "model.d_ff=128",
            "data.seq_len=32",
            "data.validation_fraction=0.3",
            f"data.sources=[{{name: a, weight: 3, source: text, path: '{first}'}}, "
            f"{{name: b, weight: 1, source: text, path: '{second}'}}]",
            "train.global_batch_size=8",
            "train.eval_batches=1",
            "train.eval_every=2",
            "train.log_every=1",
            "train.steps=4",
            "train.progress_bar=false",
            "train.sample_tokens=0",
            "checkpoint.every_steps=0",
            f"train.run_dir={run_dir}",
        ],
    )


def test_each_source_validation_is_in_the_metrics_and_the_log(tmp_path, caplog):
    """One 4-step run of a 1-layer model (a few seconds)."""
    cfg = _cfg(tmp_path)
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="jaxpar"):
        result = train(cfg)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in rows if r["val_loss"] is not None]
    assert [r["step"] for r in evaluated] == [0, 2, 4]  # step 0: the fresh run's evaluation before it trains
    assert rows[0]["val_loss"] == result.initial_val_loss and rows[0]["loss"] is None and rows[0]["tokens"] == 0
    assert all("val_loss/a" not in r for r in rows if r["val_loss"] is None)
    sharding = NamedSharding(build_mesh(cfg), activation_spec("batch", "seq"))
    info = build_loaders(cfg.data, 8, sharding, cfg.model.vocab_size, eval_batches=1)[2].sources
    tokens = {n: info[n].val_scored_tokens for n in ("a", "b")}
    for r in evaluated:
        mean = sum(r[f"val_loss/{n}"] * tokens[n] for n in tokens) / sum(tokens.values())
        assert r["val_loss"] == pytest.approx(mean, rel=1e-6) and r["val_tokens"] == sum(tokens.values())
    assert result.val_losses == {n: evaluated[-1][f"val_loss/{n}"] for n in ("a", "b")}
    text = caplog.text
    assert "data: source a: weight 0.7500" in text and "reported as val_loss/b" in text
    assert f"(a {result.val_losses['a']:.4f}, b {result.val_losses['b']:.4f})" in text
