"""A caller's own optax optimizer (`build_plan(..., optimizer=...)`): Lion, Adafactor and a multi_transform
(Lion on the layer stack, SGD elsewhere) take one step on data=2 x fsdp=4 under ZeRO-1 and ZeRO-3 that equals the
single-device step; their state is partitioned by the parameters' specs (measured per device for Lion), with
Adafactor's factored statistics replicated; the non-finite skip is an explicit wrapper whose counters the step
reports only when present; bad arguments are refused before any device work.

The bound (`_enclosure`). A layout changes the gradients only by reordered fp32 sums: every entry stays within
tol = FP32_RTOL * (|g| + max|g|) of the reference gradient g (the elementwise tolerance of
`step_helpers.assert_tree_close`, which tests/parity/test_step_parity.py establishes for these meshes). Adam's
`assert_adam_step_close` does not apply to these optimizers, and no single slope does: Lion's first update is
-lr * (sign(g) + wd * p), a step function of g, and Adafactor's first update g / sqrt(g^2 + 1e-30) on unfactored
leaves is one too. So the test computes, per entry, the interval of first updates over *all* gradients in the
box [g - tol, g + tol] by interval arithmetic in float64 (each optimizer's first step written out below as
optax defines it: Lion; Adafactor's factored second moments, block-RMS clipping, learning rate and parameter-RMS
scale; SGD), widened by the fp32 roundings of the step (for each mean over n values n * 2^-24 relative, Higham
2002 section 4.2; one ulp for the final parameter add). Both the reference's and the layout's updated parameters
must lie in it, as must their optimizer states (Lion's first moment, Adafactor's v_row / v_col / v): an entry
whose gradient is within tol of zero may flip Lion's sign (the interval is then 2 * lr wide), every other entry is
pinned. The state checks catch what Lion's and Adafactor's scale-free updates cannot: a gradient off by a
factor (a doubled or lost microbatch) moves the moments by far more than their interval.

Shape letters: G global batch, T sequence length, L layers, D model width, F mlp hidden width.
"""

import json

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from optax import tree_utils as otu
from step_helpers import (
    CONFIG,
    FP32,
    FP32_RTOL,
    U32,
    compile_fast,
    device_batch,
    host_batch,
    planner,
    spec_axes,
    to_host,
)

from jaxpar.analysis.planner.memory import persistent_state_bytes
from jaxpar.config import load_config
from jaxpar.model.flops import param_count
from jaxpar.parallel.sharding import opt_state_specs
from jaxpar.training.optimizer import skip_nonfinite
from jaxpar.training.state import init_state
from jaxpar.training.step import make_grad_fn, make_train_step

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

RTOL = FP32_RTOL
SEED = 11
T = 8
VALID = (8, 3, 8, 0, 5, 8, 1, 8, 8, 7, 2, 8, 8, 4, 8, 6)  # uneven valid tokens per row, one row fully masked
G = len(VALID)
LR = 1e-2
FACTOR_MIN = 32  # Adafactor factors a leaf whose two largest dims are >= this: the embedding table and w_up
LION_B2, LION_WD = 0.99, 1e-3  # optax.lion's defaults
ADAFACTOR_EPS, PARAM_SCALE_MIN = 1e-30, 1e-3  # optax.adafactor's eps and scale_by_param_block_rms's min_scale


def _labels(params):
    return {k: jax.tree.map(lambda _, k=k: "lion" if k == "blocks" else "sgd", v) for k, v in params.items()}


OPTIMIZERS = {
    "lion": lambda: optax.lion(LR),
    "adafactor": lambda: optax.adafactor(LR, min_dim_size_to_factor=FACTOR_MIN),
    "multi_transform": lambda: optax.multi_transform({"lion": optax.lion(LR), "sgd": optax.sgd(LR)}, _labels),
}


_plan = planner(*FP32, f"train.global_batch_size={G}", "mesh.data=1", "mesh.fsdp=1", "optimizer.warmup_steps=0")


@pytest.fixture(scope="module")
def gradients() -> dict:
    """The single-device initial parameters and their gradients (the same for every optimizer)."""
    plan = _plan([], 1)
    state = init_state(plan, SEED)
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    grads, _, _ = compile_fast(jax.jit(make_grad_fn(plan)), state["params"], batch)(state["params"], batch)
    return {"state": to_host(state), "params": to_host(state["params"]), "grads": to_host(grads)}


@pytest.fixture(scope="module")
def reference(gradients):
    """Per optimizer, one single-device step from the shared initial parameters, computed once each."""
    cache = {}

    def get(name: str) -> dict:
        if name not in cache:
            plan = _plan([], 1, optimizer=OPTIMIZERS[name]())
            cache[name] = _step(plan, gradients["params"])
        return cache[name]

    return get


def _step(plan, host_params) -> dict:
    state = init_state(plan, SEED)  # the optimizer's initial state: zeros and counts, layout-independent
    state["params"] = jax.device_put(host_params, plan.state_shardings["params"])
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    compiled = compile_fast(make_train_step(plan), state, batch)
    shardings = jax.tree.map(lambda x: x.sharding, state["opt_state"])
    measured = persistent_state_bytes(plan, compiled, state, batch)
    new, metrics = compiled(state, batch)
    return {
        "params": to_host(new["params"]),
        "opt_state": to_host(new["opt_state"]),
        "metrics": to_host(metrics),
        "opt_shardings": shardings,
        "measured": measured,
    }


# ---- the enclosure: first updates over the gradient box, interval arithmetic in float64 ------------------------


def _mul(a, b):
    """Interval product [a_lo, a_hi] * [b_lo, b_hi]."""
    c = np.stack([a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1]])
    return c.min(0), c.max(0)


def _square(a):
    lo, hi = a
    big = np.maximum(lo * lo, hi * hi)
    small = np.where((lo <= 0) & (hi >= 0), 0.0, np.minimum(lo * lo, hi * hi))
    return small, big


def _mean(a, axis, keepdims=False):
    """Interval of a mean of n values, widened by its fp32 summation error n * U32 (relative, positive values)."""
    n = a[0].size if axis is None else a[0].shape[axis]
    return (
        np.mean(a[0], axis, keepdims=keepdims) * (1 - n * U32),
        np.mean(a[1], axis, keepdims=keepdims) * (1 + n * U32),
    )


def _factored_dims(shape):
    """The dims Adafactor factors, as optax picks them: the two largest (d1 second, d0 largest) if d1 is big enough."""
    if len(shape) < 2:
        return None
    order = np.argsort(shape)
    return None if shape[order[-2]] < FACTOR_MIN else (int(order[-2]), int(order[-1]))


def _lion(g, p):
    """Lion's first step: update -lr * (sign((1 - b1) g) + wd p); state mu = (1 - b2) g."""
    u = (np.sign(g[0]), np.sign(g[1]))
    step = (-LR * (u[1] + LION_WD * p), -LR * (u[0] + LION_WD * p))
    return step, {"mu": ((1 - LION_B2) * g[0], (1 - LION_B2) * g[1])}


def _sgd(g, p):
    return (-LR * g[1], -LR * g[0]), {}


def _adafactor(g, p):
    """Adafactor's first step (decay 1 - 1^-0.8 = 0, so v = g^2 + eps): factored u = g * sqrt(rcm / v_row) /
    sqrt(v_col) with rcm the mean of v_row over the second-largest dim, else u = g / sqrt(g^2 + eps); then
    u / max(1, rms(u)); then * lr * max(rms(p), 1e-3); negated."""
    sq = _square(g)
    sq = (sq[0] + ADAFACTOR_EPS, sq[1] + ADAFACTOR_EPS)
    dims = _factored_dims(p.shape)
    if dims is None:
        u = (g[0] / np.sqrt(g[0] ** 2 + ADAFACTOR_EPS), g[1] / np.sqrt(g[1] ** 2 + ADAFACTOR_EPS))  # increasing
        state = {"v": sq}
    else:
        d1, d0 = dims
        v_row, v_col = _mean(sq, d0), _mean(sq, d1)
        rcm = _mean(v_row, d1 - 1 if d1 > d0 else d1, keepdims=True)
        row = (np.sqrt(rcm[0] / v_row[1]), np.sqrt(rcm[1] / v_row[0]))
        scale = _mul(
            (np.expand_dims(row[0], d0), np.expand_dims(row[1], d0)),
            (1 / np.sqrt(np.expand_dims(v_col[1], d1)), 1 / np.sqrt(np.expand_dims(v_col[0], d1))),
        )
        u = _mul(g, scale)
        state = {"v_row": v_row, "v_col": v_col}
    rms = np.sqrt(_mean(_square(u), None))
    denom = (np.maximum(1.0, rms[0]), np.maximum(1.0, rms[1]))
    u = _mul(u, (1 / denom[1], 1 / denom[0]))
    s = LR * max(float(np.sqrt(np.mean(p * p))), PARAM_SCALE_MIN)
    return (-s * u[1], -s * u[0]), state


def _first_step(name: str, path) -> callable:
    if name == "multi_transform":
        return _lion if jax.tree_util.keystr(path[:1]) == "['blocks']" else _sgd
    return {"lion": _lion, "adafactor": _adafactor}[name]


def _within(name: str, got, lo, hi, pad) -> None:
    got = np.asarray(got, np.float64)
    assert got.shape == lo.shape, f"{name}: shape {got.shape} != {lo.shape}"
    bad = (got < lo - pad) | (got > hi + pad)
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} of {got.size} entries outside the enclosure, e.g. "
        f"{got[bad][:3]} not in [{(lo - pad)[bad][:3]}, {(hi + pad)[bad][:3]}]"
    )


def _opt_leaves(opt_state, field: str) -> dict:
    """{parameter path: array} of one per-parameter field ("mu", "v_row", ...) of an optimizer state."""
    found = {}
    for tree in otu.tree_get_all_with_path(opt_state, field):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree[1])[0]:
            found[jax.tree_util.keystr(path)] = leaf
    return found


def _enclosure(name: str, old_params, grads, new_params, opt_state) -> int:
    """Asserts that `new_params` and the optimizer state lie in the enclosure (module docstring); returns the
    number of entries whose update the enclosure pins (its interval narrower than 1% of the step size)."""
    pinned = 0
    states = {f: _opt_leaves(opt_state, f) for f in ("mu", "v_row", "v_col", "v")}
    for (path, g), p, new in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(old_params), jax.tree.leaves(new_params)
    ):
        key = jax.tree_util.keystr(path)
        g, p = np.asarray(g, np.float64), np.asarray(p, np.float64)
        tol = RTOL * (np.abs(g) + np.max(np.abs(g)))
        (lo, hi), state = _first_step(name, path)(g=(g - tol, g + tol), p=p)
        # fp32 roundings of the update chain (a few operations on |update|) and one ulp of the stored parameter.
        pad = 16 * U32 * np.maximum(np.abs(lo), np.abs(hi)) + np.spacing(np.abs(np.asarray(new, np.float32)))
        _within(f"{key} update", np.asarray(new, np.float64) - p, lo, hi, pad)
        pinned += int(np.sum(hi - lo < 0.01 * LR))
        for field, (s_lo, s_hi) in state.items():
            got = np.asarray(states[field][key], np.float64)
            _within(f"{key} {field}", got, s_lo, s_hi, 4 * U32 * np.abs(s_hi))
    return pinned


# Every optimizer on ZeRO-3 (state sharded over data and fsdp), Adafactor's factored statistics on ZeRO-1 too;
# Lion and multi_transform on ZeRO-1 under -m slow (default-suite budget).
SLOW_CASES = {(1, "lion"), (1, "multi_transform")}


@pytest.mark.parametrize(
    "zero,name",
    [
        pytest.param(z, n, id=f"{z}-{n}", marks=[pytest.mark.slow] * ((z, n) in SLOW_CASES))
        for z in (1, 3)
        for n in OPTIMIZERS
    ],
)
def test_one_step_data_fsdp_equals_single_device(name, zero, gradients, reference, need_devices):
    need_devices(8)
    ref = reference(name)
    n_entries = sum(x.size for x in jax.tree.leaves(gradients["params"]))
    # The enclosure holds the single-device step itself (it models the optimizer right) and pins most entries (the
    # others: mostly embedding rows of tokens absent from the batch, whose gradient is exactly 0, about 10%).
    pinned = _enclosure(name, gradients["params"], gradients["grads"], ref["params"], ref["opt_state"])
    assert pinned > 0.8 * n_entries

    plan = _plan(["mesh.data=2", "mesh.fsdp=4", f"optimizer.zero_stage={zero}"], 8, optimizer=OPTIMIZERS[name]())
    out = _step(plan, gradients["params"])
    assert plan.mesh.shape["data"] == 2 and plan.mesh.shape["fsdp"] == 4
    w = plan.state_shardings["params"]["blocks"]["mlp"]["w_up"]
    L, D, F = gradients["params"]["blocks"]["mlp"]["w_up"].shape
    assert tuple(w.shard_shape((L, D, F))) == (L, D // (8 if zero == 3 else 4), F)
    _enclosure(name, gradients["params"], gradients["grads"], out["params"], out["opt_state"])

    # ZeRO: parameter-shaped state split over data x fsdp; Adafactor's factored statistics replicated.
    for field, leaves in ((f, _opt_leaves(out["opt_shardings"], f)) for f in ("mu", "v", "v_row", "v_col")):
        for key, sharding in leaves.items():
            shape = np.shape(_opt_leaves(out["opt_state"], field)[key])
            if field in ("mu", "v") and shape != (1,):
                assert "data" in spec_axes(sharding) and "fsdp" in spec_axes(sharding), (field, key)
                assert np.prod(sharding.shard_shape(shape)) * 8 == np.prod(shape), (field, key)
            else:
                assert sharding.spec == P(), (field, key, sharding.spec)
    if name == "adafactor":
        assert "['blocks']['mlp']['w_up']" in _opt_leaves(out["opt_state"], "v_row")  # factored: exercised
        assert np.shape(_opt_leaves(out["opt_state"], "v")["['blocks']['attn']['wq']"]) != (1,)  # and not


def test_lion_state_bytes_per_device_are_the_zero_share(reference, gradients, need_devices):
    """ZeRO-1 on data=2 x fsdp=4: Lion's one fp32 moment is 4 bytes per parameter split 8 ways, measured from the
    compiled step's arguments (`jaxpar.analysis.planner.memory.persistent_state_bytes`), while the parameters split 4
    ways."""
    need_devices(8)
    plan = _plan(["mesh.data=2", "mesh.fsdp=4", "optimizer.zero_stage=1"], 8, optimizer=OPTIMIZERS["lion"]())
    out = _step(plan, gradients["params"])
    n = param_count(gradients["params"])
    assert out["measured"]["opt_state"] == 4 * n // 8
    assert out["measured"]["params"] == 4 * n // 4
    assert reference("lion")["measured"]["opt_state"] == 4 * n  # one device holds all of it


def test_default_optimizer_state_specs_are_unchanged():
    """`opt_state_specs` gives the default AdamW state the specs optax.tree_map_params gave it before."""
    plan = _plan(["optimizer.zero_stage=1"], 1)
    params = jax.eval_shape(lambda: init_state(plan, 0)["params"])
    opt = jax.eval_shape(plan.tx.init, params)
    specs = plan.specs["opt_state"]
    old = optax.tree_map_params(
        plan.tx,
        lambda _, spec: spec,
        opt,
        specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )
    new = opt_state_specs(opt, params, specs)
    assert jax.tree.structure(new, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(
        old, is_leaf=lambda x: isinstance(x, P)
    )
    assert jax.tree.leaves(new, is_leaf=lambda x: isinstance(x, P)) == jax.tree.leaves(
        old, is_leaf=lambda x: isinstance(x, P)
    )
    assert sum(spec != P() for spec in jax.tree.leaves(new, is_leaf=lambda x: isinstance(x, P))) > 0


def test_adafactor_factored_statistics_get_a_spec_that_fits():
    """optax.tree_map_params hands Adafactor's v_row (the parameter's shape less one dim) the parameter's spec,
    which does not fit its rank; `opt_state_specs` replicates it."""
    plan = _plan([], 1)
    params = jax.eval_shape(lambda: init_state(plan, 0)["params"])
    tx = OPTIMIZERS["adafactor"]()
    opt = jax.eval_shape(tx.init, params)
    specs = {"embed": {"table": P("tensor", "fsdp")}} | {
        k: v for k, v in plan.specs["opt_state"].items() if k != "embed"
    }
    old = optax.tree_map_params(
        tx, lambda _, spec: spec, opt, specs, transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P)
    )
    row = _opt_leaves(opt, "v_row")["['embed']['table']"]
    assert len(_opt_leaves(old, "v_row")["['embed']['table']"]) > len(row.shape)  # more dims than the array
    new = opt_state_specs(opt, params, specs)
    assert _opt_leaves(new, "v_row")["['embed']['table']"] == P()
    assert _opt_leaves(new, "v")["['blocks']['attn']['wq']"] == specs["blocks"]["attn"]["wq"]


def test_skip_nonfinite_is_an_explicit_wrapper(need_devices):
    """Lion without the wrapper applies a NaN update and reports no skip counters or learning rate; wrapped, with
    its schedule given, it skips and counts the bad step (rate 0), and the next good step uses the schedule's
    first rate; a constant `learning_rate` is reported as given."""
    need_devices(2)
    overrides = ["mesh.data=2"]
    good = host_batch(VALID, T, SEED)
    bad = dict(good, loss_mask=np.full((G, T), np.nan, np.float32))
    schedule = optax.linear_schedule(1e-3, 1e-4, 10)

    plan = _plan(overrides, 2, optimizer=optax.lion(1e-3))
    state = init_state(plan, SEED)
    step = compile_fast(make_train_step(plan), state, device_batch(plan, good))
    state, metrics = step(state, device_batch(plan, bad))
    assert set(metrics) == {"loss", "grad_norm", "tokens"}
    assert not np.isfinite(to_host(state["params"])["final_norm"]["scale"]).any()  # applied: NaN everywhere

    plan = _plan(overrides, 2, optimizer=skip_nonfinite(optax.lion(schedule)), learning_rate=schedule)
    state = init_state(plan, SEED)
    before = to_host(state["params"])
    step = compile_fast(make_train_step(plan), state, device_batch(plan, good))
    state, metrics = step(state, device_batch(plan, bad))
    assert (int(metrics["bad_steps_in_a_row"]), int(metrics["skipped_steps"]), float(metrics["learning_rate"])) == (
        1,
        1,
        0.0,
    )
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(to_host(state["params"]))):
        np.testing.assert_array_equal(a, b)
    state, metrics = step(state, device_batch(plan, good))
    assert (int(metrics["bad_steps_in_a_row"]), int(metrics["skipped_steps"])) == (0, 1)
    assert float(metrics["learning_rate"]) == pytest.approx(1e-3, rel=1e-6)  # count 0: the skip did not advance it

    plan = _plan(overrides, 2, optimizer=optax.lion(1e-3), learning_rate=1e-3)
    state = init_state(plan, SEED)
    _, metrics = compile_fast(make_train_step(plan), state, device_batch(plan, good))(state, device_batch(plan, good))
    assert float(metrics["learning_rate"]) == pytest.approx(1e-3, rel=1e-6) and "skipped_steps" not in metrics


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"optimizer": "lion"}, TypeError, r"optimizer must be an optax.GradientTransformation"),
        ({"learning_rate": 1e-3}, ValueError, r"learning_rate is only for a caller's own optimizer"),
        ({"optimizer": optax.lion(1e-3), "learning_rate": "fast"}, TypeError, r"learning_rate must be a schedule"),
        (
            {"optimizer": optax.lion(1e-3), "learning_rate": optax.constant_schedule(1e-3)},
            ValueError,
            r"expected one optax.ScaleByScheduleState .*found 0",
        ),
        (
            {"optimizer": skip_nonfinite(skip_nonfinite(optax.sgd(1e-3)))},
            ValueError,
            r"holds 2 optax.ApplyIfFiniteState",
        ),
    ],
)
def test_bad_optimizer_arguments_are_refused_at_plan_time(kwargs, error, match):
    with pytest.raises(error, match=match):
        _plan([], 1, **kwargs)


@pytest.mark.slow  # a training run (about 9 s on 2 cores)
def test_train_loop_with_an_optimizer_without_skip_or_schedule(tmp_path):
    """`train(cfg, optimizer=...)`: the run finishes with null learning_rate and skipped_steps in metrics.jsonl;
    it resumes from its checkpoint with the same optimizer, and another optimizer is refused, naming arrays."""
    from jaxpar.config import ConfigError
    from jaxpar.training.loop import train

    def cfg(steps: int):
        return load_config(
            CONFIG,
            [
                "model.n_layers=1",
                "data.seq_len=32",
                "data.max_bytes=200000",
                "data.validation_fraction=0.3",
                "train.global_batch_size=8",
                "train.eval_batches=1",
                "train.progress_bar=false",
                "train.sample_tokens=0",
                "train.log_every=1",
                "train.eval_every=0",
                f"train.steps={steps}",
                "checkpoint.every_steps=2",
                "checkpoint.async_save=false",
                f"train.run_dir={tmp_path}",
            ],
        )

    def adafactor():
        return optax.adafactor(1e-2, min_dim_size_to_factor=FACTOR_MIN)

    result = train(cfg(2), optimizer=adafactor())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and sorted(result.losses) == [1, 2]
    assert all(r["learning_rate"] is None and r["skipped_steps"] is None for r in rows)
    assert all(np.isfinite(r["loss"]) for r in rows) and np.isfinite(result.val_loss)
    assert int(result.state["step"]) == 2
    resumed = train(cfg(3), optimizer=adafactor())
    assert resumed.start_step == 2 and sorted(resumed.losses) == [3] and np.isfinite(resumed.losses[3])
    with pytest.raises(ConfigError, match=r"does not fit this config .*opt_state.*optimizer of your own"):
        train(cfg(4), optimizer=optax.lion(1e-3))


@pytest.mark.slow  # the example script as a training run (about 6 s on 2 cores)
def test_example_script_trains_with_its_own_loss_and_optimizer(capsys):
    """examples/custom_loss_optimizer.py (z-loss and Lion with a schedule through `train`) for 4 steps: the
    metrics carry the schedule's rates, nothing is skipped, validation improves, Lion's momentum is split over
    data x fsdp."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(CONFIG), os.pardir, "examples", "custom_loss_optimizer.py")
    spec = importlib.util.spec_from_file_location("custom_loss_optimizer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.main(["--steps", "4"])
    rows = out["rows"]
    schedule = optax.warmup_cosine_decay_schedule(3e-5, 3e-4, 1, 4)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["skipped_steps"] == 0 for r in rows)
    np.testing.assert_allclose([r["learning_rate"] for r in rows], [float(schedule(k)) for k in range(4)], rtol=1e-6)
    assert all(np.isfinite(r["loss"]) for r in rows) and out["val_loss"] < out["initial_val_loss"]
    assert {"data", "fsdp"} <= spec_axes(out["mu_sharding"]) and out["devices"] == 8
    assert "step  loss (CE + z-loss)" in capsys.readouterr().out
