"""The public API: `import jaxpar` exposes the documented names lazily (no jax at import), `jaxpar.train` is the
function, the script of docs/api.md runs as written, and `jaxpar.restore` puts a saved run onto another mesh exactly.

Shape letters: G global batch, T sequence length.
"""

import os
import re
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from step_helpers import CONFIG, FP32_RTOL, assert_scalar_close, to_host

import jaxpar
from jaxpar.checkpoint.mismatch import CheckpointMismatchError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = [
    "train.steps=2",
    "checkpoint.every_steps=2",
    "checkpoint.async_save=false",
    "train.eval_batches=1",
    "train.sample_tokens=0",
    "train.progress_bar=false",
    "data.max_bytes=300000",
    "model.n_layers=2",
    "data.seq_len=32",
    "precision.compute_dtype=float32",
]
ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipeline=1"]


def test_import_is_lazy_and_every_public_name_resolves():
    code = (
        "import sys, jaxpar; assert 'jax' not in sys.modules, 'import jaxpar imported jax'; "
        "[getattr(jaxpar, n) for n in jaxpar.__all__]; import jaxpar.training.loop; "
        "assert callable(jaxpar.train) and jaxpar.train.__module__ == 'jaxpar.training.loop'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    assert {"train", "load_config", "build_plan", "restore", "register_model", "Hook", "default_hooks"} <= set(
        jaxpar.__all__
    )
    with pytest.raises(AttributeError, match="has no attribute 'trian'"):
        jaxpar.trian  # noqa: B018


def _docs_example() -> str:
    """The ```python block of docs/api.md's "Use jaxpar from your own script"."""
    text = open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8").read()
    section = text[text.index("## Use jaxpar from your own script") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow  # the docs' script as a subprocess training run (about 25 s on 2 cores)
def test_docs_script_runs_as_written(tmp_path):
    """docs/api.md's example, unchanged, in a directory holding the repository's configs/ and README.md (which it
    reads)."""
    for name in ("configs", "README.md"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    (tmp_path / "script.py").write_text(_docs_example())
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}  # the script sets it
    env["PYTHONPATH"] = ROOT
    out = subprocess.run(
        [sys.executable, "script.py"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    # Between the hook's lines, the run's own log line of step 10 (train.progress_bar=false: ProgressLogHook).
    assert re.search(r"step 5: training loss \d+\.\d+\n(step 10/10: loss .*\n)?step 10: training loss", out.stdout), (
        out.stdout[-2000:]
    )
    assert re.search(r"step 10: \d+\.\d+ nats/token on README.md's first 256 bytes", out.stdout)
    assert re.search(r"after one AdamW step from the restored parameters: loss \d+\.\d+", out.stdout)
    assert os.path.isdir(tmp_path / "runs" / "my_script" / "checkpoints" / "10")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A 2-step run of the tiny config on 8 devices (data=2 x fsdp=2 x tensor=2), checkpointed at step 2."""
    run_dir = str(tmp_path_factory.mktemp("run"))
    result = jaxpar.train(jaxpar.load_config(CONFIG, [*QUICK, f"train.run_dir={run_dir}"]))
    return run_dir, to_host(result.state)


def _batch(g: int, t: int) -> dict:
    rng = np.random.default_rng(0)
    return {
        "inputs": rng.integers(0, 259, (g, t), dtype=np.int32),
        "targets": rng.integers(0, 259, (g, t), dtype=np.int32),
        "loss_mask": np.ones((g, t), np.float32),
    }


def test_restore_onto_one_device_and_onto_data_parallel_is_exact(saved_run):
    """Parameters come back bitwise on one device, on data=8 and on data=2 x context=4 (each sequence split over 4
    devices); all evaluate a batch alike (fp32 sums reordered: step_helpers.FP32_RTOL)."""
    run_dir, final = saved_run
    one = jaxpar.restore(run_dir, ONE_DEVICE, devices=jax.devices()[:1])
    data8 = jaxpar.restore(os.path.join(run_dir, "checkpoints", "2"), ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"])
    context4 = jaxpar.restore(run_dir, ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1", "mesh.context=4"])
    assert one.step == data8.step == context4.step == 2 and one.plan.mesh.size == 1
    assert data8.plan.mesh.shape["data"] == 8 and context4.plan.mesh.shape["context"] == 4
    assert one.cfg.model == data8.cfg.model and one.cfg.model.n_layers == 2  # the saved config, not tiny.yaml's
    for restored in (one, data8, context4):
        for a, b in zip(jax.tree.leaves(to_host(restored.params)), jax.tree.leaves(final["params"])):
            np.testing.assert_array_equal(a, b)
    batch = _batch(8, 32)
    l1, n1 = jaxpar.make_eval_step(one.plan)(one.params, batch)
    for name, restored in (("data=8", data8), ("context=4", context4)):
        loss, n = jaxpar.make_eval_step(restored.plan)(restored.params, batch)
        assert float(n1) == float(n) == 8 * 32
        assert_scalar_close(loss, l1, FP32_RTOL, f"eval loss on {name} vs one device")


def test_continue_with_another_optimizer(saved_run):
    """init_state(plan, params=...) starts Lion at step 0 from the restored parameters; its first step's loss is
    the restored model's loss on that batch."""
    run_dir, _ = saved_run
    restored = jaxpar.restore(run_dir, ONE_DEVICE, devices=jax.devices()[:1])
    plan = jaxpar.build_plan(restored.cfg, restored.plan.mesh, optimizer=optax.lion(1e-4))
    state = jaxpar.init_state(plan, params=restored.params)
    assert int(state["step"]) == 0 and "ScaleByLionState" in str(jax.tree.structure(state["opt_state"]))
    batch = _batch(plan.cfg.train.global_batch_size, 32)
    loss_sum, tokens = jaxpar.make_eval_step(plan)(restored.params, batch)
    state, metrics = jaxpar.make_train_step(plan)(state, batch)
    assert_scalar_close(metrics["loss"], float(loss_sum) / float(tokens), FP32_RTOL, "first Lion step's loss")
    with pytest.raises(ValueError, match=r"params do not fit model 'llama': blocks/attn/wk is missing"):
        jaxpar.init_state(plan, params={"embed": restored.params["embed"]})
    as_int = jax.tree.map(lambda x: np.asarray(x).astype(np.int32), restored.params)
    with pytest.raises(ValueError, match=r"blocks/attn/wk is int32 \(2, 128, 2, 32\), the model's is floating-point"):
        jaxpar.init_state(plan, params=as_int)


def test_restore_errors_name_the_problem(saved_run, tmp_path):
    run_dir, _ = saved_run
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        jaxpar.restore(str(tmp_path), ONE_DEVICE, devices=jax.devices()[:1])
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint for step 7 .*complete steps are 2: give one"):
        jaxpar.restore(run_dir, ONE_DEVICE, devices=jax.devices()[:1], step=7)
    with pytest.raises(jaxpar.ConfigError, match="mesh"):
        jaxpar.restore(run_dir, devices=jax.devices()[:1])  # the saved mesh needs 8 devices
    with pytest.raises(
        jaxpar.ConfigError,
        match=r"does not fit \(.*opt_state.*\); a run trained with an optimizer of "
        r"its own restores with optimizer= that optimizer",
    ) as e:
        jaxpar.restore(run_dir, ONE_DEVICE, devices=jax.devices()[:1], optimizer=optax.lion(1e-4))
    assert isinstance(e.value.__cause__, CheckpointMismatchError)
    with pytest.raises(jaxpar.ConfigError, match=r"cannot change the model .*model.d_model: 128 -> 64"):
        jaxpar.restore(run_dir, [*ONE_DEVICE, "model.d_model=64"], devices=jax.devices()[:1])


def test_jaxpar_train_import_flag_errors_and_builtin_names_are_taken_in_a_fresh_process(tmp_path):
    """A missing --import file is named with exit status 2; a script cannot replace the built-in llama by
    registering first (the built-ins register before any name is taken)."""
    out = subprocess.run(
        [sys.executable, "-m", "jaxpar.cli.train", "configs/tiny.yaml", "--import", "no_such_model.py"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 2 and "--import no_such_model.py: FileNotFoundError: no such file" in out.stderr
    code = "import jaxpar; jaxpar.register_model('llama', lambda cfg, rngs: None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 1 and "model 'llama' is already registered" in out.stderr


def test_a_mesh_other_than_the_configs_is_refused():
    cfg = jaxpar.load_config(CONFIG, num_devices=8)  # data=2 x fsdp=2 x tensor=2
    one = jaxpar.build_mesh(jaxpar.load_config(CONFIG, ONE_DEVICE, num_devices=1), jax.devices()[:1])
    with pytest.raises(
        jaxpar.ConfigError, match=r"the mesh \(data=1, .*\) is not the config's: mesh.fsdp=-1 cannot fill 1 device:"
    ):
        jaxpar.build_plan(cfg, one)
    data8 = jaxpar.build_mesh(jaxpar.load_config(CONFIG, ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"]))
    with pytest.raises(
        jaxpar.ConfigError,
        match=r"is not the config's \(mesh.data=2, mesh.pipeline=1, mesh.fsdp=2, mesh.context=1, mesh.tensor=2",
    ):
        jaxpar.build_plan(cfg, data8)


@pytest.mark.slow
def test_expert_parallel_run_restores_onto_other_expert_axes(tmp_path):
    """A run with its experts over data x fsdp restores bitwise onto one device and onto experts over fsdp only
    (model.moe.expert_axes places the experts like the mesh places everything: it may change), and both evaluate
    a batch alike (fp32 sums reordered: step_helpers.FP32_RTOL); other model.* changes stay refused."""
    moe = ["model.moe.num_experts=4", "model.moe.every=2", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
    run_dir = str(tmp_path / "moe")
    cfg = jaxpar.load_config(CONFIG, [*QUICK, *moe, "model.moe.expert_axes=[data,fsdp]", f"train.run_dir={run_dir}"])
    final = to_host(jaxpar.train(cfg).state)
    one = jaxpar.restore(run_dir, ONE_DEVICE, devices=jax.devices()[:1])
    fsdp = jaxpar.restore(run_dir, ["mesh.data=2", "mesh.fsdp=4", "mesh.tensor=1", "model.moe.expert_axes=[fsdp]"])
    assert one.plan.expert_axes == () and fsdp.plan.expert_axes == ("fsdp",)
    for restored in (one, fsdp):
        for a, b in zip(jax.tree.leaves(to_host(restored.params)), jax.tree.leaves(final["params"])):
            np.testing.assert_array_equal(a, b)
    batch = _batch(8, 32)
    l1, n1 = jaxpar.make_eval_step(one.plan)(one.params, batch)
    l4, n4 = jaxpar.make_eval_step(fsdp.plan)(fsdp.params, batch)
    assert float(n1) == float(n4) == 8 * 32
    assert_scalar_close(l4, l1, FP32_RTOL, "eval loss with experts over fsdp vs one device")
    with pytest.raises(jaxpar.ConfigError, match=r"cannot change the model .*model.moe.top_k: 2 -> 1"):
        jaxpar.restore(run_dir, [*ONE_DEVICE, "model.moe.top_k=1"], devices=jax.devices()[:1])
