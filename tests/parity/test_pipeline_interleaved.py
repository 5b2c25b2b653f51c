"""Interleaved 1F1B (`pipeline.virtual_stages` = v > 1): the pipelined step equals the single-device step.

Each device holds v non-adjacent chunks of L/(pv) layers (chunk c on device c mod p; Narayanan et al. 2021,
section 2.2.2). The parameters stay in model order (device s holds layers s*L/p .. (s+1)*L/p - 1, as without
interleaving, so checkpoints do not depend on v); the step permutes them into chunk order over `pipeline` and the
gradients back (`jaxpar.parallel.pipeline.to_chunk_order`).

* The permute itself, on p in {2, 4} and v in {2, 3}: device s's slot j holds model chunk j*p + s, and the
  inverse gives the model order back exactly.
* One train step for (p, v, M, L) in {2, 4} x {2, 3}, with M = p (one group), M > 2pv - 1 (the stash ring
  wraps) and M = 3p (three groups), with residuals kept and with the chunk forward recomputed: loss, grad norm,
  Adam's moments and the updated parameters equal the single-device step at 1e-5 (fp32, as
  tests/parity/test_pipeline.py; step_helpers.FP32_RTOL says why). One reference per L (L = p*v: one layer
  per chunk, or 2p*v). Each case also asserts the schedule that ran is interleaved: the three tick loops of
  the gradient function have v*p - 1, m*v + p - v*p and v*p - 1 ticks (`jaxpar.parallel.schedule`), not
  plain 1F1B's p - 1, m and p - 1.
* Composed with data, fsdp, tensor (+ sequence parallelism) and ZeRO 0-3 (`make_grad_fn` gradients and loss at
  1e-5), and evaluation (run through the plain pipeline forward: the parameters are in model order).
* M not a multiple of p, v with GPipe, v without a pipeline, layers not divisible by p*v: ConfigError before any
  device work.

Shape letters: G global batch, T sequence length, L layers, M microbatches, p stages, v virtual stages.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
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
    to_host,
)

from jaxpar.config import ConfigError, load_config
from jaxpar.parallel import pipeline, schedule
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.state import init_state
from jaxpar.training.step import make_eval_step, make_grad_fn, make_train_step

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

RTOL = FP32_RTOL
SEED = 5
T = 8
B1 = 0.9  # optimizer.b1 (schema default)
VALID = (8, 3, 8, 0, 5, 8, 1, 8, 8, 7, 2, 8, 8, 4, 8, 6, 8, 2, 7, 8, 3, 0, 0, 0)  # the last rows fully masked
G = len(VALID)


def _overrides(layers: int, *extra: str) -> list[str]:
    # Clipping off: Adam's first moment is then (1 - b1) * gradient (tests/parity/test_pipeline.py).
    return [
        *FP32,
        *FIRST_STEP_AT_PEAK,
        "optimizer.grad_clip_norm=0",
        f"model.n_layers={layers}",
        f"train.global_batch_size={G}",
        "mesh.data=1",
        "mesh.fsdp=1",
        *extra,
    ]


# --- the permute into chunk order -----------------------------------------------------------------------------


@pytest.mark.parametrize("p,v", [(2, 2), (2, 3), (4, 2), (4, 3)])
def test_chunk_order_permute(p, v, need_devices):
    need_devices(p)
    lc = 2  # layers per chunk
    n_layers = p * v * lc
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:p]), (pipeline.AXIS,))
    # layer l's rows hold l (and a trailing dimension, as a weight has)
    stack = jnp.repeat(jnp.arange(n_layers, dtype=jnp.float32)[:, None], 3, axis=1)

    def body(x):
        chunked = pipeline.to_chunk_order({"w": x}, p, v)["w"]
        return chunked, pipeline.from_chunk_order({"w": chunked}, p, v)["w"]

    chunked, back = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P(pipeline.AXIS), out_specs=P(pipeline.AXIS), check_vma=False)
    )(stack)
    chunked, back = np.asarray(chunked)[:, 0], np.asarray(back)
    per_device = chunked.reshape(p, v, lc)  # [device s, slot j, layer within the chunk]
    for s in range(p):
        for j in range(v):
            c = j * p + s
            np.testing.assert_array_equal(per_device[s, j], np.arange(c * lc, (c + 1) * lc))
    np.testing.assert_array_equal(back, np.asarray(stack))
    assert not np.array_equal(chunked, np.arange(n_layers))  # the orders differ


# --- one train step against one device --------------------------------------------------------------------------

_REFERENCES: dict[int, dict] = {}


def _reference(layers: int) -> dict:
    """Single device, no pipeline: the initial state, gradients, loss, eval and one train step (cached per L)."""
    if layers in _REFERENCES:
        return _REFERENCES[layers]
    plan = make_plan(_overrides(layers), jax.devices()[:1])
    state = init_state(plan, SEED)
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    host_state = to_host(state)
    grads, loss, n_tokens = compile_fast(jax.jit(make_grad_fn(plan)), state["params"], batch)(state["params"], batch)
    eval_sum, eval_count = make_eval_step(plan)(state["params"], batch)
    new, metrics = compile_fast(make_train_step(plan), state, batch)(state, batch)
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
    assert_tree_close(jax.tree.map(lambda m: m / (1 - B1), ref["mu"]), ref["grads"], RTOL)
    _REFERENCES[layers] = ref
    return ref


def _tick_loops(plan, params, batch) -> list[int]:
    """Lengths of the scans in the gradient function's jaxpr other than the layer and accumulation scans: the
    pipeline's tick loops, in program order."""
    text = str(jax.make_jaxpr(make_grad_fn(plan))(params, batch))
    layers_per_chunk = plan.cfg.model.n_layers // (plan.mesh.shape["pipeline"] * plan.cfg.pipeline.virtual_stages)
    return [int(n) for n in re.findall(r"length=(\d+)", text) if int(n) not in (1, layers_per_chunk)]


def _assert_interleaved(plan, params, batch, p: int, v: int, m: int) -> None:
    """Blocks split over `pipeline` in model order (L/p layers per device), and the tick loops are interleaved
    1F1B's, not plain 1F1B's."""
    n_layers = plan.cfg.model.n_layers
    for leaf in jax.tree.leaves(params["blocks"]):
        assert leaf.sharding.spec[0] == "pipeline" and shard_shape(leaf)[0] == n_layers // p
    warm = schedule.warmup_ticks(p, v)
    expected = [warm, m * v + p - 1 - warm, warm]
    assert [n for n in _tick_loops(plan, params, batch) if n in expected] == expected
    assert expected != [p - 1, m, p - 1]


# (p, v, M, L, recompute): p and v in {2, 4} x {2, 3}; M = p, M = 3p, and M > 2pv - 1; both stash modes.
STEP_GRID = [
    (2, 2, 2, 4, False),
    pytest.param(2, 3, 4, 6, False, marks=pytest.mark.slow),
    (4, 2, 4, 8, True),
    pytest.param(2, 2, 6, 4, True, marks=pytest.mark.slow),
    pytest.param(2, 3, 6, 6, True, marks=pytest.mark.slow),
    pytest.param(4, 2, 12, 8, False, marks=pytest.mark.slow),
    pytest.param(4, 3, 4, 12, False, marks=pytest.mark.slow),
    pytest.param(4, 3, 8, 24, True, marks=pytest.mark.slow),
]


def _step_id(case) -> str:
    p, v, m, layers, recompute = case.values if hasattr(case, "values") else case
    return f"p{p}_v{v}_m{m}_L{layers}" + ("_recompute" if recompute else "")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("p,v,m,layers,recompute", STEP_GRID, ids=[_step_id(c) for c in STEP_GRID])
def test_one_step_equals_single_device(p, v, m, layers, recompute, need_devices):
    need_devices(p)
    ref = _reference(layers)
    plan = make_plan(
        _overrides(
            layers,
            f"mesh.pipeline={p}",
            f"pipeline.microbatches={m}",
            f"pipeline.virtual_stages={v}",
            f"pipeline.recompute={str(recompute).lower()}",
        ),
        jax.devices()[:p],
    )
    assert plan.cfg.pipeline.virtual_stages == v and plan.cfg.pipeline.recompute == recompute
    state = jax.device_put(ref["host_state"], plan.state_shardings)
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    _assert_interleaved(plan, state["params"], batch, p, v, m)

    new, metrics = compile_fast(make_train_step(plan), state, batch)(state, batch)
    metrics = to_host(metrics)
    assert metrics["tokens"] == ref["metrics"]["tokens"] == sum(VALID)
    assert_scalar_close(metrics["loss"], ref["metrics"]["loss"], RTOL, "loss")
    assert_scalar_close(metrics["grad_norm"], ref["metrics"]["grad_norm"], RTOL, "grad_norm")
    got = {
        "params": to_host(new["params"]),
        "mu": to_host(otu.tree_get(new["opt_state"], "mu")),
        "nu": to_host(otu.tree_get(new["opt_state"], "nu")),
    }
    assert_adam_step_close(got, ref, ref["host_state"]["params"], RTOL, **adam_step_args(plan, metrics))


# --- composed with data, fsdp, tensor and ZeRO -----------------------------------------------------------------

COMPOSED = [
    pytest.param(("mesh.data=2", "mesh.fsdp=2", "optimizer.zero_stage=3"), False, id="data2_fsdp2_zero3"),
    pytest.param(("mesh.fsdp=2", "mesh.tensor=2"), False, id="fsdp2_tensor2_sp"),
    pytest.param(
        ("mesh.data=2", "mesh.tensor=2", "optimizer.zero_stage=1"),
        True,
        id="data2_tensor2_sp_zero1_recompute",
        marks=pytest.mark.slow,
    ),
    pytest.param(("mesh.data=4", "optimizer.zero_stage=0"), False, id="data4_zero0", marks=pytest.mark.slow),
    pytest.param(
        ("mesh.data=2", "mesh.fsdp=2", "optimizer.zero_stage=2"), True, id="data2_fsdp2_zero2", marks=pytest.mark.slow
    ),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mesh,recompute", COMPOSED)
def test_grads_composed_and_eval(mesh, recompute, need_devices):
    """p = 2, v = 2, M = 2, L = 4 on 8 devices with the other axes: gradients and loss equal one device's, and
    the evaluation (plain pipeline forward over the model-order layers) equals the single-device evaluation."""
    need_devices(8)
    p, v, m, layers = 2, 2, 2, 4
    ref = _reference(layers)
    plan = make_plan(
        _overrides(
            layers,
            f"mesh.pipeline={p}",
            f"pipeline.microbatches={m}",
            f"pipeline.virtual_stages={v}",
            f"pipeline.recompute={str(recompute).lower()}",
            *mesh,
        ),
        jax.devices()[:8],
    )
    assert plan.mesh.size == 8 and plan.mesh.shape["pipeline"] == p
    if "mesh.tensor=2" in mesh:
        assert plan.tensor_parallel.size == 2 and plan.tensor_parallel.sequence_parallel
    params = jax.device_put(ref["host_state"]["params"], plan.state_shardings["params"])
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    _assert_interleaved(plan, params, batch, p, v, m)
    grads, loss, n_tokens = compile_fast(jax.jit(make_grad_fn(plan)), params, batch)(params, batch)
    assert float(n_tokens) == ref["tokens"]
    assert_scalar_close(loss, ref["loss"], RTOL, "loss")
    assert_tree_close(to_host(grads), ref["grads"], RTOL)

    total, count = make_eval_step(plan)(params, batch)
    assert float(count) == ref["eval"][1]
    assert_scalar_close(total, ref["eval"][0], RTOL, "eval loss sum")


# --- config errors ------------------------------------------------------------------------------------------------


def _load(*overrides: str, num_devices: int):
    return load_config(CONFIG, [*TINY, *_overrides(4, *overrides)], num_devices=num_devices)


def test_config_errors_before_device_work():
    cases = [
        (
            ("mesh.pipeline=2", "pipeline.microbatches=3", "pipeline.virtual_stages=2"),
            2,
            r"microbatches=3 must be a "
            r"multiple of mesh\.pipeline=2 with pipeline\.virtual_stages=2 .*use 2 or 4",
        ),
        (  # fewer microbatches than stages: one suggestion, not "use 2 or 2"
            ("mesh.pipeline=2", "pipeline.microbatches=1", "pipeline.virtual_stages=2"),
            2,
            r"microbatches=1 must be a multiple of mesh\.pipeline=2 .*; use 2 \(",  # then where each key was set
        ),
        (
            ("mesh.pipeline=2", "pipeline.schedule=gpipe", "pipeline.virtual_stages=2", "pipeline.microbatches=2"),
            2,
            r"interleaves the 1f1b, zb-h1 and zb-v schedules, not gpipe",
        ),
        (("pipeline.virtual_stages=2",), 1, r"needs a pipeline \(mesh\.pipeline > 1\)"),
        (
            ("mesh.pipeline=2", "pipeline.virtual_stages=3", "pipeline.microbatches=2"),
            2,
            r"model\.n_layers=4 must be divisible by mesh\.pipeline \* pipeline\.virtual_stages = 2 \* 3 = 6",
        ),
        (("mesh.pipeline=2", "pipeline.virtual_stages=0"), 2, r"pipeline\.virtual_stages=0 must be > 0"),
    ]
    for overrides, devices, message in cases:
        with pytest.raises(ConfigError, match=message):
            _load(*overrides, num_devices=devices)
    cfg = _load("mesh.pipeline=2", "pipeline.virtual_stages=2", "pipeline.microbatches=4", num_devices=2)
    assert cfg.pipeline.virtual_stages == 2
    build_mesh(cfg, jax.devices()[:2])  # a valid config builds


@pytest.mark.timeout(240)
def test_the_check_can_fail_without_the_chunk_order(monkeypatch, need_devices):
    """With the permute into chunk order removed (each device's model-order layers taken as its chunks), the
    interleaved step runs the model's chunks in the wrong order: the loss leaves the tolerance and the layer
    gradients move by more than 100 times it, so the parity tests above can fail."""
    need_devices(2)
    ref = _reference(4)
    monkeypatch.setattr(pipeline, "to_chunk_order", lambda layers, *_: layers)
    monkeypatch.setattr(pipeline, "from_chunk_order", lambda grads, *_: grads)
    plan = make_plan(
        _overrides(4, "mesh.pipeline=2", "pipeline.microbatches=2", "pipeline.virtual_stages=2"), jax.devices()[:2]
    )
    params = jax.device_put(ref["host_state"]["params"], plan.state_shardings["params"])
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    grads, loss, _ = compile_fast(jax.jit(make_grad_fn(plan)), params, batch)(params, batch)
    assert float(loss) != pytest.approx(ref["loss"], rel=RTOL), (float(loss), ref["loss"])
    got, want = to_host(grads)["blocks"]["mlp"]["w_up"], ref["grads"]["blocks"]["mlp"]["w_up"]
    assert np.max(np.abs(got - want)) > 100 * RTOL * np.max(np.abs(want))
