"""Hugging Face weights through jaxpar runs: `jaxpar-checkpoints import-hf` writes a step-0 checkpoint that
restores onto one device and onto data=2 x fsdp=2 x tensor=2 (data=2 x fsdp=4 for the one-key/value-head
fixture) with ZeRO-3 (8 simulated devices) with the same
parameters and the loss transformers' logits give; `export-hf` gives the fixture's tensors back bit for bit;
`model.init_from` starts a training run from the weights, and a model that does not fit is refused before any
device work. Fixtures: tests/fixtures/hf_llama_*, and for a family with experts hf_mixtral (the experts split over
data on the sharded mesh) and for one whose stack rows are layer pairs hf_gemma2 (transformers 5.24.0; see
tests/unit/test_hf.py)."""

import dataclasses
import os
import shutil

import jax
import numpy as np
import optax
import pytest
from hf_helpers import GEMMA2, MIXTRAL, TIED, UNTIED, assert_same_tensors
from step_helpers import to_host

import jaxpar
from jaxpar.checkpoint.params import restore_params
from jaxpar.cli.checkpoints import main as checkpoints_main
from jaxpar.config import ConfigError, load_config
from jaxpar.model.hf import load_hf
from jaxpar.training.init_from import check_init_from, load_init_params, place_init_params
from jaxpar.training.loop import train
from jaxpar.training.plan import build_plan
from jaxpar.training.state import abstract_params

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipeline=1"]
# the tied fixture has one key/value head: no tensor parallelism (it needs a head per tensor rank)
SHARDED = {
    UNTIED: ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "mesh.pipeline=1", "optimizer.zero_stage=3"],
    TIED: ["mesh.data=2", "mesh.fsdp=4", "mesh.tensor=1", "mesh.pipeline=1", "optimizer.zero_stage=3"],
    MIXTRAL: [
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "mesh.pipeline=1",
        "optimizer.zero_stage=3",
        "model.moe.expert_axes=[data]",
    ],
    GEMMA2: ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "mesh.pipeline=1", "optimizer.zero_stage=3"],
}


def _reference_loss(fixture: str) -> tuple[dict, float]:
    """A batch of the fixture's tokens (rows repeated to 8) predicting each row's next token (cyclically), and
    its summed cross-entropy from transformers' logits (float64)."""
    tokens = np.load(os.path.join(fixture, "tokens.npy"))
    logits = np.load(os.path.join(fixture, "logits.npy")).astype(np.float64)
    targets = np.roll(tokens, -1, axis=1)
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    loss = -np.take_along_axis(logp, targets[..., None], -1).sum()
    batch = {
        "inputs": np.tile(tokens, (4, 1)),
        "targets": np.tile(targets, (4, 1)),
        "loss_mask": np.ones((8, tokens.shape[1]), np.float32),
    }
    return batch, 4 * float(loss)


@pytest.mark.parametrize("fixture", [UNTIED, TIED, MIXTRAL, GEMMA2], ids=os.path.basename)
def test_import_restore_on_any_mesh_and_export(fixture, tmp_path, capsys):
    run_dir, out = str(tmp_path / "run"), str(tmp_path / "hf")
    assert checkpoints_main(["import-hf", fixture, "--out", run_dir, "train.steps=7"]) == 0
    assert "as step 0 of" in capsys.readouterr().out
    assert sorted(os.listdir(run_dir)) == ["checkpoints", "config.yaml", "hf_config.json"]
    assert load_config(os.path.join(run_dir, "config.yaml"), validate=False).train.steps == 7
    hf = load_hf(fixture)
    batch, want = _reference_loss(fixture)
    for overrides, devices in ((ONE_DEVICE, jax.devices()[:1]), (SHARDED[fixture], jax.devices())):
        restored = jaxpar.restore(run_dir, overrides, devices=devices)
        assert restored.step == 0 and restored.plan.mesh.size == len(devices)
        model = restored.cfg.model  # the model of config.json; attention and the expert axes are the run's
        moe = dataclasses.replace(model.moe, expert_axes=hf.cfg.moe.expert_axes)
        assert dataclasses.replace(model, attention="auto", moe=moe) == hf.cfg
        jax.tree.map(np.testing.assert_array_equal, to_host(restored.params), hf.params)
        loss_sum, tokens = jaxpar.make_eval_step(restored.plan)(restored.params, batch)
        assert int(tokens) == batch["inputs"].size
        np.testing.assert_allclose(float(loss_sum), want, rtol=1e-5)
    dtype = "bfloat16" if fixture == TIED else "float32"
    args = ["export-hf", run_dir, "--out", out, "--dtype", dtype, "--max-shard-bytes", "20000"]
    assert checkpoints_main(args) == 0
    written = load_hf(out)
    assert written.dtype == dtype and written.hf_config["eos_token_id"] == hf.hf_config["eos_token_id"]
    assert_same_tensors(out, fixture)
    assert checkpoints_main(args) == 2  # the directory now holds a model
    assert "already holds config.json" in capsys.readouterr().err


def test_parameters_alone_of_a_checkpoint(tmp_path):
    """model.init_from and export-hf read a checkpoint's parameters alone: the float32 master copy of a 16p run
    (whose working parameters are bf16), the imported weights exactly, whole on the host or placed on a mesh; a
    jaxpar checkpoint of another model is refused naming the keys."""
    run_dir = str(tmp_path / "run")
    assert checkpoints_main(["import-hf", UNTIED, "--out", run_dir, "precision.layout=16p"]) == 0
    params, cfg, step = restore_params(run_dir)
    assert step == 0 and cfg.precision.layout == "16p"
    hf = load_hf(UNTIED)
    jax.tree.map(np.testing.assert_array_equal, params, hf.params)
    model = dataclasses.replace(hf.cfg, init_from=run_dir)
    jax.tree.map(np.testing.assert_array_equal, load_init_params(model), hf.params)
    # As a run takes them: straight onto its mesh, each process reading only its shards.
    cfg = load_config({"model": dataclasses.asdict(model)}, SHARDED[UNTIED])
    target = abstract_params(build_plan(cfg, jaxpar.build_mesh(cfg)))
    placed = place_init_params(model, target)
    assert jax.tree.map(lambda x: x.sharding, placed) == jax.tree.map(lambda t: t.sharding, target)
    jax.tree.map(np.testing.assert_array_equal, to_host(placed), hf.params)
    with pytest.raises(ConfigError, match=r"holds another model: model.d_model: config 64, checkpoint 32"):
        check_init_from(dataclasses.replace(model, d_model=64))


def test_import_refusals(tmp_path, capsys):
    assert checkpoints_main(["import-hf", str(tmp_path), "--out", str(tmp_path / "run")]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert checkpoints_main(["import-hf", UNTIED, "--out", str(tmp_path / "r"), "model.d_model=64"]) == 2
    assert "overrides change the model of" in (err := capsys.readouterr().err) and "model.d_model: config 64" in err
    assert not os.path.exists(tmp_path / "r")
    truncated = tmp_path / "truncated"  # a download cut short
    shutil.copytree(UNTIED, truncated)
    os.truncate(truncated / "model.safetensors", 5000)
    assert checkpoints_main(["import-hf", str(truncated), "--out", str(tmp_path / "t")]) == 2
    assert "model.safetensors is not a readable safetensors file" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "t")


SMALL = [
    "data.seq_len=32",
    "data.max_bytes=200000",
    "data.validation_fraction=0.3",
    "train.global_batch_size=8",
    "train.eval_batches=1",
    "train.progress_bar=false",
    "train.sample_tokens=0",
    "train.steps=1",
    "checkpoint.every_steps=1",
    "checkpoint.async_save=false",
]


@pytest.mark.slow
def test_init_from_starts_training_from_the_weights(tmp_path):
    """Slow (about 20 s on 2 CPU cores: compiling a train and an eval step on 8 devices). configs/tiny_hf.yaml
    (data=2 x fsdp=2 x tensor=2) starts from the fixture; the saved step-1 parameters are the imported ones
    exactly (an optimizer whose updates are zero); resuming ignores model.init_from."""
    cfg = load_config(
        os.path.join(ROOT, "configs", "tiny_hf.yaml"),
        [*SMALL, f"train.run_dir={tmp_path / 'run'}", f"model.init_from={UNTIED}"],
    )
    result = train(cfg, optimizer=optax.set_to_zero())
    assert result.start_step == 0 and sorted(result.losses) == [1]
    restored = jaxpar.restore(
        str(tmp_path / "run"), ONE_DEVICE, devices=jax.devices()[:1], optimizer=optax.set_to_zero()
    )
    assert restored.step == 1
    jax.tree.map(np.testing.assert_array_equal, to_host(restored.params), load_hf(UNTIED).params)
    # Resuming reads the run's own checkpoint: model.init_from is no longer read (here: a directory that is gone).
    again = load_config(
        os.path.join(ROOT, "configs", "tiny_hf.yaml"),
        [*SMALL, f"train.run_dir={tmp_path / 'run'}", f"model.init_from={tmp_path / 'gone'}", "train.steps=2"],
    )
    assert train(again, optimizer=optax.set_to_zero()).start_step == 1


def test_init_from_that_does_not_fit_is_refused_before_device_work(tmp_path):
    run_dir = tmp_path / "run"
    base = [*SMALL, f"train.run_dir={run_dir}"]
    cases = [
        (["model.d_model=64", f"model.init_from={UNTIED}"], r"model.d_model: config 64, Hugging Face directory 32"),
        ([f"model.init_from={TIED}"], r"model.n_kv_heads: config 2, Hugging Face directory 1; .*model.tie_embeddings"),
        ([f"model.init_from={tmp_path}"], r"holds neither config.json .* nor a complete jaxpar checkpoint"),
        (
            ["model.init_from=/no/such/dir"],
            r"model.init_from='/no/such/dir' does not exist; give a Hugging Face model directory",
        ),
    ]
    for overrides, message in cases:
        cfg = load_config(os.path.join(ROOT, "configs", "tiny_hf.yaml"), [*base, *overrides])
        with pytest.raises(ConfigError, match=message):
            train(cfg)
        assert not run_dir.exists()
