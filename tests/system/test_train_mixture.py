"""Training on a two-source mixture (`data.sources`) of shard sets: the loss falls, every evaluation reports each
source's validation loss (`val_loss/<name>` in metrics.jsonl) with `val_loss` their token-weighted mean, and a
run stopped at a checkpoint resumes with the losses of an uninterrupted one."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from tokenize_helpers import STDLIB_FILES, stdlib_path

from jaxpar.config import load_config
from jaxpar.data.tokenize_corpus import TokenizeOptions, tokenize_corpus
from jaxpar.training.loop import train

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "configs", "tiny.yaml")


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_mixture")
    out = {}
    for name, files in (("web", STDLIB_FILES[:3]), ("code", STDLIB_FILES[3:])):
        inputs = tuple(stdlib_path(n) for n in files)
        tokenize_corpus(TokenizeOptions(inputs, str(root / name), "byte", workers=1, progress=False))
        out[name] = str(root / name)
    return out


def _cfg(sets, run_dir, steps: int):
    sources = f"[{{name: web, weight: 0.7, path: {sets['web']}}}, {{name: code, weight: 0.3, path: {sets['code']}}}]"
    return load_config(
        CONFIG,
        [
            "model.n_layers=1",
            "data.source=shards",
            f"data.sources={sources}",
            "data.seq_len=32",
            "data.validation_fraction=0.2",
            "train.global_batch_size=8",
            "train.eval_batches=1",
            "train.progress_bar=false",
            "train.sample_tokens=0",
            "train.eval_every=4",
            "train.log_every=1",
            f"train.steps={steps}",
            "optimizer.decay=constant",
            "optimizer.warmup_steps=0",
            "checkpoint.every_steps=4",
            "checkpoint.async_save=false",
            f"train.run_dir={run_dir}",
        ],
    )


@pytest.mark.slow
def test_a_mixture_trains_reports_each_source_and_resumes_exactly(sets, tmp_path):
    """Slow: three training runs (about a minute on 2 cores); the loader, its resume and the per-source evaluation
    are tested quickly in tests/unit/test_mixture.py and tests/system/test_mixture_processes.py."""
    from jax.sharding import NamedSharding

    from jaxpar.data import build_loaders
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.parallel.sharding import activation_spec

    whole = train(_cfg(sets, tmp_path / "whole", 12))
    rows = [json.loads(line) for line in open(tmp_path / "whole" / "metrics.jsonl")]
    evaluated = [r for r in rows if r.get("val_loss") is not None]
    assert [r["step"] for r in evaluated] == [0, 4, 8, 12]  # step 0: before the first step
    cfg = _cfg(sets, tmp_path / "whole", 12)
    sharding = NamedSharding(build_mesh(cfg), activation_spec("batch", "seq"))
    info = build_loaders(cfg.data, 8, sharding, cfg.model.vocab_size, eval_batches=1)[2].sources
    for r in evaluated:
        tokens = {n: info[n].val_scored_tokens for n in ("web", "code")}
        mean = sum(r[f"val_loss/{n}"] * tokens[n] for n in tokens) / sum(tokens.values())
        assert r["val_loss"] == pytest.approx(mean, rel=1e-6) and r["val_tokens"] == sum(tokens.values())
    assert whole.val_losses == {n: evaluated[-1][f"val_loss/{n}"] for n in ("web", "code")}
    assert evaluated[0]["val_loss"] == whole.initial_val_loss and evaluated[0]["loss"] is None
    for n in ("web", "code"):
        assert evaluated[-1][f"val_loss/{n}"] < evaluated[1][f"val_loss/{n}"] < evaluated[0][f"val_loss/{n}"]
    losses = [whole.losses[s] for s in sorted(whole.losses)]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5

    first = train(_cfg(sets, tmp_path / "split", 4))
    rest = train(_cfg(sets, tmp_path / "split", 12))
    assert rest.start_step == 4 and [first.losses[s] for s in range(1, 5)] == [whole.losses[s] for s in range(1, 5)]
    assert [rest.losses[s] for s in range(5, 13)] == [whole.losses[s] for s in range(5, 13)]
