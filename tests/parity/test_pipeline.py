"""Pipeline parallelism: the pipelined step equals the single-device step; resume; config errors.

A 4-layer model (d_model 64, T 8) and one global batch of G = 24 rows with uneven valid-token counts (the last
three rows fully masked, so at M = 8 with one replica a whole microbatch is masked). G = 24 divides by every
(data x fsdp x accumulation x M) used here, so one single-device reference, computed once, serves every case.

* One train step on 7 (p, M, schedule) cases (`GRID`) for p = 2 and p = 4 stages (2 and 1 layers per stage):
  every M in {1, 2, 3, 4, 8} at p = 4, both schedules at both p, M < p, and M past the 1F1B stash depth
  2p - 1: loss, grad norm, Adam's moments, the updated parameters and the update itself equal the reference
  at 1e-5 (fp32).
  Clipping is off, so Adam's first moment after one step is (1 - b1) * gradient exactly (to one rounding):
  comparing it compares the gradients the pipelined step computed (the reference fixture checks that
  identity against `make_grad_fn`). One compile per case: compile time dominates this file.
* `make_grad_fn` directly on composed meshes: pipeline=2 x data=2 x fsdp=2 (ZeRO-2), pipeline=2 x fsdp=2 x
  tensor=2 with sequence parallelism, and on 16 simulated devices (a subprocess, since the device count is
  fixed at jax import) pipeline=2 x data=2 x fsdp=2 x tensor=2 with GPipe and with 1F1B; gradients and loss
  at 1e-5. The 1F1B case runs the step 10 times: before the tick's collectives were ordered by data
  dependencies (`jaxpar.parallel.pipeline.ordered_after`), XLA:CPU deadlocked on this mesh in most runs.
* pipeline=2, M=4 inside train.grad_accum_steps=2 against the unsplit single-device batch.
* The eval step under pipeline=2 x data=2 x fsdp=2 and pipeline=2 x fsdp=2 x tensor=2 runs through the pipeline
  stages (a forward-only loop, `jaxpar.parallel.pipeline.forward_loss`) and equals the single-device eval.
* pipeline=1 with pipeline.microbatches=4 is plain gradient accumulation and equals the reference.
* A pipelined run (`jaxpar.training.loop.train`) resumed from its step-2 checkpoint reproduces steps 3 and 4
  bitwise.
* Config errors (layers not divisible by stages, batch not divisible by microbatches, unknown schedule) raise
  ConfigError before any device work.

Each equivalence test asserts its layout really differs from the reference's: the block parameters are split
over `pipeline` along the layers dimension (a device holds L / p layers), while the embedding, final norm and
head are replicated over `pipeline`.

Shape letters: G global batch, T sequence length, L layers, D model width, F mlp hidden width, M microbatches,
p stages.
"""

import os
import pickle
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from optax import tree_utils as otu
from step_helpers import (
    CONFIG,
    FIRST_STEP_AT_PEAK,
    FP32,
    FP32_RTOL,
    TINY,
    adam_step_args,
    assert_adam_step_close,
    assert_scalar_close,
    assert_tree_close,
    compile_fast,
    device_batch,
    host_batch,
    make_plan,
    shard_shape,
    spec_axes,
    to_host,
)

from jaxpar.config import ConfigError, load_config
from jaxpar.training.state import init_state
from jaxpar.training.step import make_eval_step, make_grad_fn, make_train_step

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

RTOL = FP32_RTOL  # fp32 whole-model parity: reordered sums (step_helpers.FP32_RTOL says why)
SEED = 3
T = 8
L = 4
B1 = 0.9  # optimizer.b1 (schema default)
VALID = (8, 3, 8, 0, 5, 8, 1, 8, 8, 7, 2, 8, 8, 4, 8, 6, 8, 2, 7, 8, 3, 0, 0, 0)
G = len(VALID)
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # step_helpers.py
# (stages, microbatches, schedule): every M at p=4; both schedules at both p; M < p three times; M > 2p - 1
# (the 1F1B stash ring wraps) at both p. Compile time limits the grid; p=2 with M=2 (GPipe), M=3 (1F1B) and
# M=4 (both) runs in the composed-mesh and accumulation tests below. The default suite runs five points (both
# schedules at both p, M < p, the ring wrapping at p=2); -m slow adds M=2 and M=8 at p=4.
# 1F1B runs with its default pipeline.recompute=false (residuals kept); RECOMPUTE_GRID has the same 1F1B
# points with recompute=true (stage forward rebuilt from the stashed input), two of them in the default suite.
GRID = [
    (2, 1, "gpipe"),
    (2, 8, "1f1b"),
    (4, 1, "1f1b"),
    (4, 2, "gpipe"),
    (4, 3, "1f1b"),
    (4, 4, "gpipe"),
    (4, 8, "1f1b"),
]
SLOW_GRID = {(4, 2, "gpipe"), (4, 8, "1f1b")}
RECOMPUTE_GRID = [
    pytest.param(p, m, marks=() if (p, m) in ((2, 8), (4, 3)) else pytest.mark.slow, id=f"p{p}_m{m}")
    for p, m, schedule in GRID
    if schedule == "1f1b"
]
REPLICATED_OVER_PIPELINE = (("embed", "table"), ("final_norm", "scale"), ("lm_head", "kernel"))


def _overrides(*extra: str) -> list[str]:
    # Clipping off: Adam's first moment is then (1 - b1) * gradient (see the module docstring).
    return [
        *FP32,
        *FIRST_STEP_AT_PEAK,
        "optimizer.grad_clip_norm=0",
        f"model.n_layers={L}",
        f"train.global_batch_size={G}",
        "mesh.data=1",
        "mesh.fsdp=1",
        *extra,
    ]


def _w_up(tree):
    return tree["blocks"]["mlp"]["w_up"]  # [L, D, F]: layers over pipeline, D over fsdp, F over tensor


def _assert_pipelined(plan, params, p: int) -> None:
    """The layout differs from the single-device reference's: blocks split into p stages along the layers
    dimension, everything else replicated over `pipeline`."""
    assert plan.mesh.shape["pipeline"] == p > 1
    for leaf in jax.tree.leaves(params["blocks"]):
        assert leaf.sharding.spec[0] == "pipeline", leaf.sharding.spec
        assert shard_shape(leaf)[0] == L // p < leaf.shape[0] == L
    for module, name in REPLICATED_OVER_PIPELINE:
        assert "pipeline" not in spec_axes(params[module][name].sharding), (module, name)
    assert len(_w_up(params).sharding.device_set) == plan.mesh.size


@pytest.fixture(scope="module")
def reference() -> dict:
    """Single device, no pipeline, no accumulation: gradients (make_grad_fn), eval, and one train step."""
    plan = make_plan(_overrides(), jax.devices()[:1])
    assert plan.mesh.size == 1 and plan.cfg.pipeline.microbatches == 1 and plan.cfg.train.grad_accum_steps == 1
    state = init_state(plan, SEED)
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    host_state = to_host(state)
    grads, loss, n_tokens = compile_fast(jax.jit(make_grad_fn(plan)), state["params"], batch)(state["params"], batch)
    eval_sum, eval_count = make_eval_step(plan)(state["params"], batch)
    step = compile_fast(make_train_step(plan), state, batch)
    new, metrics = step(state, batch)
    ref = {
        "host_state": host_state,
        "grads": to_host(grads),
        "loss": float(loss),
        "tokens": float(n_tokens),
        "eval": (float(eval_sum), float(eval_count)),
        "metrics": to_host(metrics),
        "params": to_host(new["params"]),
        "mu": to_host(otu.tree_get(new["opt_state"], "mu")),
        "nu": to_host(otu.tree_get(new["opt_state"], "nu")),
    }
    assert ref["tokens"] == sum(VALID)
    assert_scalar_close(ref["metrics"]["loss"], ref["loss"], RTOL, "train step loss vs grad_fn loss")
    # The identity the grid relies on: first moment = (1 - b1) * gradient.
    assert_tree_close(jax.tree.map(lambda m: m / (1 - B1), ref["mu"]), ref["grads"], RTOL)
    return ref


def _pipelined_grads(ref: dict, *overrides: str, devices) -> tuple:
    """(plan, params, grads, loss, n_tokens, eval_step) of `make_grad_fn` on the layout of `overrides`."""
    plan = make_plan(_overrides(*overrides), devices)
    params = jax.device_put(ref["host_state"]["params"], plan.state_shardings["params"])
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    grads, loss, n_tokens = compile_fast(jax.jit(make_grad_fn(plan)), params, batch)(params, batch)
    return plan, params, batch, grads, loss, n_tokens


def _assert_grads_match(ref: dict, grads, loss, n_tokens) -> None:
    assert float(n_tokens) == ref["tokens"]
    assert_scalar_close(loss, ref["loss"], RTOL, "loss")
    assert_tree_close(to_host(grads), ref["grads"], RTOL)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "p,m,schedule",
    [pytest.param(*g, marks=[pytest.mark.slow] * (g in SLOW_GRID), id="p{}_m{}_{}".format(*g)) for g in GRID],
)
def test_one_step_equals_single_device(p, m, schedule, reference, need_devices):
    need_devices(p)
    _one_step_equals_single_device(reference, p, m, schedule)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("p,m", RECOMPUTE_GRID)
def test_one_step_equals_single_device_1f1b_recompute(p, m, reference, need_devices):
    need_devices(p)
    _one_step_equals_single_device(reference, p, m, "1f1b", "pipeline.recompute=true")


def _one_step_equals_single_device(reference, p: int, m: int, schedule: str, *extra: str) -> None:
    ref = reference
    plan = make_plan(
        _overrides(f"mesh.pipeline={p}", f"pipeline.microbatches={m}", f"pipeline.schedule={schedule}", *extra),
        jax.devices()[:p],
    )
    assert plan.cfg.pipeline.schedule == schedule and plan.cfg.pipeline.microbatches == m
    assert plan.cfg.pipeline.recompute == ("pipeline.recompute=true" in extra)
    state = jax.device_put(ref["host_state"], plan.state_shardings)
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    _assert_pipelined(plan, state["params"], p)
    _assert_pipelined(plan, otu.tree_get(state["opt_state"], "mu"), p)
    w_sharding = _w_up(state["params"]).sharding

    new, metrics = compile_fast(make_train_step(plan), state, batch)(state, batch)
    assert _w_up(new["params"]).sharding == w_sharding  # no sharding drift across the step
    metrics = to_host(metrics)
    assert metrics["tokens"] == ref["metrics"]["tokens"] == sum(VALID)
    assert metrics["learning_rate"] == ref["metrics"]["learning_rate"] > 0
    assert_scalar_close(metrics["loss"], ref["metrics"]["loss"], RTOL, "loss")
    assert_scalar_close(metrics["grad_norm"], ref["metrics"]["grad_norm"], RTOL, "grad_norm")
    got = {
        "params": to_host(new["params"]),
        "mu": to_host(otu.tree_get(new["opt_state"], "mu")),
        "nu": to_host(otu.tree_get(new["opt_state"], "nu")),
    }
    assert_adam_step_close(got, ref, ref["host_state"]["params"], RTOL, **adam_step_args(plan, metrics))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("recompute", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_grads_pipeline_data_fsdp_zero2_and_eval(reference, recompute, need_devices):
    """pipeline=2 x data=2 x fsdp=2 (ZeRO-2: gradients reduce-scattered over data), 1F1B, M=3; with the
    residuals kept (fsdp-gathered weights rebuilt in the backward) and with the stage forward recomputed."""
    need_devices(8)
    plan, params, batch, grads, loss, n_tokens = _pipelined_grads(
        reference,
        "mesh.pipeline=2",
        "mesh.data=2",
        "mesh.fsdp=2",
        "optimizer.zero_stage=2",
        "pipeline.microbatches=3",
        "pipeline.schedule=1f1b",
        f"pipeline.recompute={str(recompute).lower()}",
        devices=jax.devices()[:8],
    )
    _assert_pipelined(plan, params, 2)
    w = _w_up(params)
    _, D, F = w.shape
    assert shard_shape(w) == (L // 2, D // 2, F) and "data" not in spec_axes(w.sharding)
    assert shard_shape(batch["inputs"]) == (G // 4, T)
    assert tuple(_w_up(grads).sharding.shard_shape(w.shape)) == (L // 2, D // 4, F)  # ZeRO-2: over data too
    _assert_grads_match(reference, grads, loss, n_tokens)

    _assert_pipelined_eval(plan, params, batch, reference)


def _assert_pipelined_eval(plan, params, batch, reference) -> None:
    """Evaluation runs through the pipeline stages (activations permuted between stages, each device holding
    its own stage's layers; before, every stage's layers were gathered onto every device) and equals the
    single-device evaluation."""
    compiled = make_eval_step(plan).lower(params, batch).compile()
    assert "collective-permute" in compiled.as_text()
    total, count = compiled(params, batch)
    assert float(count) == reference["eval"][1]
    assert_scalar_close(total, reference["eval"][0], RTOL, "eval loss sum")


@pytest.mark.timeout(180)
def test_grads_pipeline_fsdp_tensor_sequence_parallel(reference, need_devices):
    """pipeline=2 x fsdp=2 x tensor=2 with sequence parallelism, GPipe, M=4."""
    need_devices(8)
    plan, params, batch, grads, loss, n_tokens = _pipelined_grads(
        reference,
        "mesh.pipeline=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "pipeline.microbatches=4",
        "pipeline.schedule=gpipe",
        devices=jax.devices()[:8],
    )
    _assert_pipelined(plan, params, 2)
    assert plan.tensor_parallel.size == 2 and plan.tensor_parallel.sequence_parallel
    w = _w_up(params)
    _, D, F = w.shape
    assert shard_shape(w) == (L // 2, D // 2, F // 2)
    _assert_grads_match(reference, grads, loss, n_tokens)
    _assert_pipelined_eval(plan, params, batch, reference)


_CHILD = r"""
import os, pickle, sys
sys.path.insert(0, sys.argv[1])
import jax
from step_helpers import compile_fast, device_batch, host_batch, make_plan, quick_compile, shard_shape, to_host
from jaxpar.training.step import make_grad_fn

args = pickle.load(open(sys.argv[2], "rb"))
assert jax.device_count() == 16, jax.device_count()
with quick_compile():
    plan = make_plan(args["overrides"], jax.devices())
    params = jax.device_put(args["params"], plan.state_shardings["params"])
    batch = device_batch(plan, host_batch(args["valid"], args["T"], args["seed"]))
    grad_fn = compile_fast(jax.jit(make_grad_fn(plan)), params, batch)
    for _ in range(args["runs"]):
        grads, loss, n_tokens = jax.block_until_ready(grad_fn(params, batch))
    layout = {jax.tree_util.keystr(k): (tuple(v.sharding.spec), shard_shape(v), v.shape)
              for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    out = {"grads": to_host(grads), "loss": float(loss), "tokens": float(n_tokens), "mesh": dict(plan.mesh.shape),
           "sequence_parallel": plan.tensor_parallel.sequence_parallel, "layout": layout}
pickle.dump(out, open(sys.argv[3], "wb"))
"""
MESH_16 = ("mesh.pipeline=2", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "pipeline.microbatches=2")


def _grads_on_16_devices(
    reference: dict, tmp_path, schedule: str, runs: int, xla_flags: str = "", recompute: bool = False
) -> dict:
    """Runs `make_grad_fn` `runs` times on pipeline=2 x data=2 x fsdp=2 x tensor=2 (16 simulated devices) in a
    subprocess, since the device count is fixed when jax starts: the reference parameters go in, the gradients
    and the parameter layout come back. Asserts the layout."""
    inputs, outputs = tmp_path / f"{schedule}_in.pkl", tmp_path / f"{schedule}_out.pkl"
    with open(inputs, "wb") as f:
        pickle.dump(
            {
                "overrides": _overrides(
                    *MESH_16, f"pipeline.schedule={schedule}", f"pipeline.recompute={str(recompute).lower()}"
                ),
                "runs": runs,
                "params": reference["host_state"]["params"],
                "valid": VALID,
                "T": T,
                "seed": SEED,
            },
            f,
        )
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="16", JAX_PLATFORMS="cpu")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, *xla_flags.split()])
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, TESTS_DIR, str(inputs), str(outputs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    stuck = sorted(
        {
            line.split("waiting for `")[1].split(" RendezvousKey")[0]
            for line in done.stderr.splitlines()
            if "may be stuck" in line and "waiting for `" in line
        }
    )
    assert done.returncode == 0, f"exit {done.returncode}; collectives stuck: {stuck}\n" + done.stderr[-2000:]
    with open(outputs, "rb") as f:
        out = pickle.load(f)
    assert out["mesh"] == {"data": 2, "pipeline": 2, "fsdp": 2, "context": 1, "tensor": 2} and out["sequence_parallel"]
    spec, shard, shape = out["layout"]["['blocks']['mlp']['w_up']"]
    assert spec == ("pipeline", "fsdp", "tensor") and shard == (L // 2, shape[1] // 2, shape[2] // 2)
    for path, (spec, _shard, _shape) in out["layout"].items():
        axes = {a for dim in spec for a in ((dim,) if isinstance(dim, str) else tuple(dim or ()))}
        assert ("pipeline" in axes) == path.startswith("['blocks']"), path
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grads_16_devices_pipeline_data_fsdp_tensor(reference, tmp_path):
    """pipeline=2 x data=2 x fsdp=2 x tensor=2 (sequence parallel) on 16 simulated devices, GPipe, M=2."""
    out = _grads_on_16_devices(reference, tmp_path, "gpipe", runs=1)
    assert out["tokens"] == reference["tokens"]
    assert_scalar_close(out["loss"], reference["loss"], RTOL, "loss")
    assert_tree_close(out["grads"], reference["grads"], RTOL)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("recompute", [False, True])
def test_grads_16_devices_1f1b_no_deadlock(reference, tmp_path, recompute):
    """As above with 1F1B (residuals kept, and stage forward recomputed), run 10 times; the collective timeout
    is cut to 5 s so a deadlock fails fast. The embedding and head run in `lax.cond` branches on the stage
    index, with their tensor and fsdp collectives inside.

    Without the data dependencies that order a tick's collectives (forward, backward, then one permute after
    the other), 14 devices waited in the pipeline collective-permute and 2 in an fsdp/tensor all-gather in
    most runs: XLA:CPU let the permute start while the backward's loop of all-gathers ran, so devices issued
    them in different orders and the shared pool of blocking collective threads ran dry.
    """
    out = _grads_on_16_devices(
        reference,
        tmp_path,
        "1f1b",
        runs=10,
        recompute=recompute,
        xla_flags="--xla_cpu_collective_call_warn_stuck_timeout_seconds=2 "
        "--xla_cpu_collective_call_terminate_timeout_seconds=5",
    )
    assert out["tokens"] == reference["tokens"]
    assert_scalar_close(out["loss"], reference["loss"], RTOL, "loss")
    assert_tree_close(out["grads"], reference["grads"], RTOL)


@pytest.mark.timeout(180)
def test_pipeline_inside_grad_accumulation(reference, need_devices):
    """pipeline=2, M=4, inside train.grad_accum_steps=2 (8 microbatches of 3 rows) equals the unsplit batch."""
    need_devices(2)
    plan, params, _, grads, loss, n_tokens = _pipelined_grads(
        reference,
        "mesh.pipeline=2",
        "train.grad_accum_steps=2",
        "pipeline.microbatches=4",
        "pipeline.schedule=1f1b",
        devices=jax.devices()[:2],
    )
    assert plan.cfg.train.grad_accum_steps == 2
    _assert_pipelined(plan, params, 2)
    _assert_grads_match(reference, grads, loss, n_tokens)


@pytest.mark.timeout(180)
def test_one_stage_microbatches_are_accumulation(reference):
    """pipeline=1 with pipeline.microbatches=4: plain gradient accumulation over 4 microbatches, no ppermute."""
    plan = make_plan(_overrides("pipeline.microbatches=4"), jax.devices()[:1])
    params = jax.device_put(reference["host_state"]["params"], plan.state_shardings["params"])
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    jaxpr = str(jax.make_jaxpr(make_grad_fn(plan))(params, batch))
    # The program under test: the batch reshaped into 4 microbatches of G / 4 rows for an accumulation scan.
    assert f"i32[4,{G // 4},{T}]" in jaxpr and "ppermute" not in jaxpr
    grads, loss, n_tokens = compile_fast(jax.jit(make_grad_fn(plan)), params, batch)(params, batch)
    _assert_grads_match(reference, grads, loss, n_tokens)


def _load(*overrides: str, num_devices: int):
    return load_config(CONFIG, [*TINY, *_overrides(*overrides)], num_devices=num_devices)


def test_a_pipeline_on_cpu_with_the_persistent_compilation_cache_is_refused(tmp_path):
    """XLA:CPU deadlocks in a pipelined step it loads from jax's persistent compilation cache, so the plan refuses
    that combination before any device work, naming the setting; without pipeline stages the cache is fine."""
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.training.plan import build_plan

    piped = _load("mesh.pipeline=2", "mesh.data=1", "pipeline.microbatches=2", num_devices=2)
    plain = _load("mesh.data=2", num_devices=2)
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "cache"))
    try:  # nothing compiles in here, so the process's cache stays as it was
        with pytest.raises(ConfigError, match=r"mesh\.pipeline=2 on CPU with jax's persistent compilation cache on"):
            build_plan(piped, build_mesh(piped, jax.devices()[:2]))
        assert build_plan(plain, build_mesh(plain, jax.devices()[:2])).mesh_shape["data"] == 2
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    assert build_plan(piped, build_mesh(piped, jax.devices()[:2])).mesh_shape["pipeline"] == 2


def test_config_errors_before_device_work(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match=r"model\.n_layers=4 must be divisible by mesh\.pipeline=3"):
        _load("mesh.pipeline=3", num_devices=3)
    with pytest.raises(
        ConfigError,
        match=r"train\.global_batch_size=24 must be divisible by .*pipeline\."
        r"microbatches \(5\) = 10",
    ):
        _load("mesh.pipeline=2", "mesh.data=2", "pipeline.microbatches=5", num_devices=4)
    with pytest.raises(ConfigError, match=r"pipeline\.schedule='interleaved' is not one of 1f1b, gpipe"):
        _load("mesh.pipeline=2", "pipeline.schedule=interleaved", num_devices=2)
    with pytest.raises(ConfigError, match=r"pipeline\.microbatches=0 must be > 0"):
        _load("mesh.pipeline=2", "pipeline.microbatches=0", num_devices=2)
    assert _load("mesh.pipeline=4", "pipeline.microbatches=24", num_devices=4).pipeline.microbatches == 24

    # Through the trainer: the check runs before the mesh is built, the state initialised or run_dir written.
    import jaxpar.training.loop as loop
    import jaxpar.training.start_state as start_state

    def no_device_work(*args, **kwargs):
        raise AssertionError("device work before the config was checked")

    monkeypatch.setattr(loop, "build_mesh", no_device_work)
    monkeypatch.setattr(start_state, "init_state", no_device_work)
    cfg = load_config(
        CONFIG,
        [
            *TINY,
            *_overrides(
                "mesh.pipeline=4", "mesh.data=2", "pipeline.microbatches=16", f"train.run_dir={tmp_path / 'run'}"
            ),
        ],
        validate=False,
    )
    with pytest.raises(ConfigError, match=r"train\.global_batch_size=24 must be divisible"):
        loop.train(cfg)
    assert not (tmp_path / "run").exists()


RUN = [
    "model.n_layers=2",
    "model.d_model=64",
    "model.d_ff=128",
    "data.seq_len=32",
    "data.max_bytes=300000",
    "data.validation_fraction=0.3",
    "train.global_batch_size=8",
    "train.eval_batches=1",
    "train.eval_every=0",
    "train.progress_bar=false",
    "train.sample_tokens=0",
    "train.log_every=1",
    "train.steps=4",
    "checkpoint.every_steps=2",
    "checkpoint.async_save=false",
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.tensor=1",
    "mesh.pipeline=2",
    "pipeline.microbatches=2",
    "pipeline.schedule=1f1b",
]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_resume_with_pipeline_reproduces_losses(tmp_path, need_devices):
    """A 4-step pipelined run, then its step-4 checkpoint and metrics removed and the same config run again in
    the same directory: it resumes at step 2 and steps 3 and 4 reproduce the uninterrupted run bitwise."""
    need_devices(8, exactly=True)
    from jaxpar.training.loop import train

    cfg = load_config(CONFIG, [*RUN, f"train.run_dir={tmp_path}"])
    full = train(cfg)
    assert full.start_step == 0 and sorted(full.losses) == [1, 2, 3, 4]
    w = _w_up(full.state["params"])
    assert w.sharding.spec[0] == "pipeline" and shard_shape(w)[0] == 1 < w.shape[0] == 2
    final = to_host(full.state)
    ckpts = tmp_path / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["2", "4"]
    shutil.rmtree(ckpts / "4")
    os.remove(tmp_path / "metrics.jsonl")

    resumed = train(cfg)
    assert resumed.start_step == 2 and sorted(resumed.losses) == [3, 4]
    for step in (3, 4):
        assert resumed.losses[step] == full.losses[step], (step, resumed.losses[step], full.losses[step])
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(to_host(resumed.state))[0], jax.tree.leaves(final)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
