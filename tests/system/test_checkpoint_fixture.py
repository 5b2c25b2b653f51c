"""A checkpoint of format version 1 restores in this jaxpar: tests/fixtures/checkpoint_v1, written by
tests/fixtures/make_checkpoint_fixture.py (a tiny Llama on data=4 x fsdp=2 with ZeRO-1, a two-source mixture,
stopped after step 4's checkpoint), resumes with the losses the run had when it went on without stopping, and its
Hugging Face export imports with the checkpoint's parameters exactly. The fixture is never rewritten: a change
that cannot read it as it is bumps the format version and either still reads version 1 (this file keeps passing)
or refuses it by name, and then this file tests that refusal instead (docs/checkpoints.md).

Tolerance. The recorded losses of steps 5-8 came from XLA:CPU with full LLVM optimisation on an x86-64 machine
with AVX-512. The same resume gave them bit for bit under XLA_FLAGS=--xla_cpu_max_isa=AVX2 and =SSE4_2 (no FMA);
compiled without LLVM optimisation, as here (`fast_compile`), it gave values within 1.05e-7 relative of them
under the native instruction set, AVX2 and SSE4_2: one fp32 ulp of a loss near 4.8. LOSS_RTOL = 1e-5 is a hundred
times that spread, for CPUs and compilers that fuse and sum in other orders. A restore that gets something wrong
moves the losses by far more (measured): a data position one batch late by 3.3e-3 (step 5), Adam's moments lost
by 1.2e-2 (step 6).
"""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

from jaxpar.checkpoint.params import restore_params
from jaxpar.config import load_config
from jaxpar.training.hooks import EvalHook, default_hooks
from jaxpar.training.init_from import check_init_from, load_init_params
from jaxpar.training.loop import train

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "checkpoint_v1")
LOSS_RTOL = 1e-5  # the module docstring derives it
pytestmark = pytest.mark.usefixtures("fast_compile")


def _expected() -> dict:
    with open(os.path.join(FIXTURE, "expected.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.slow  # one train step compiled on 8 devices, four steps run (about 5 s on 2 cores)
def test_the_run_resumes_from_the_fixture_with_the_recorded_losses(tmp_path, monkeypatch):
    copy = tmp_path / "checkpoint_v1"
    shutil.copytree(FIXTURE, copy)
    monkeypatch.chdir(copy)  # the saved config's paths (data, run_dir) are relative to the fixture
    expected = _expected()
    cfg = load_config("run/config.yaml")  # the run's own config, as a rerun of its command reads it
    assert cfg.optimizer.zero_stage == 1 and [s.name for s in cfg.data.sources] == ["web", "notes"]
    result = train(cfg, hooks=[h for h in default_hooks(cfg) if not isinstance(h, EvalHook)])
    assert result.start_step == expected["step"] == 4
    steps = sorted(int(s) for s in expected["losses"])
    assert sorted(result.losses) == steps == [5, 6, 7, 8]
    np.testing.assert_allclose(
        [result.losses[s] for s in steps], [expected["losses"][str(s)] for s in steps], rtol=LOSS_RTOL, atol=0
    )


def test_the_hf_export_imports_with_the_checkpoints_parameters():
    """`model.init_from` of the recorded `export-hf` output (config.json + model.safetensors) checks its model
    against the run's and gives the checkpoint's float32 parameters bit for bit."""
    params, cfg, step = restore_params(os.path.join(FIXTURE, "run"))
    assert step == _expected()["step"]
    model = dataclasses.replace(cfg.model, init_from=os.path.join(FIXTURE, "hf_export"))
    check_init_from(model)
    imported = load_init_params(model)
    assert jax.tree.structure(imported) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(imported), jax.tree.leaves(params)):
        assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
