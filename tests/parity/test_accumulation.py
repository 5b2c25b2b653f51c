"""Gradient accumulation with masked tokens equals one big batch; an all-masked microbatch is harmless;
mixed precision accumulates in fp32.

A global batch of 4 sequences of length 8 with 2, 8, 8 and 1 valid tokens: the token-mean loss over the
batch differs clearly from the mean of per-microbatch means, so a wrong normalisation fails. Split as
4 microbatches on one device, and as 2 microbatches on each of 2 data-parallel devices, it must give the
loss and gradients of the unsplit batch (grad_accum_steps=1, one device) to 1e-6.

Shape letters: A microbatches, b rows per microbatch and device, T sequence length.
"""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optax import tree_utils as otu
from step_helpers import (
    FIRST_STEP_AT_PEAK,
    FP32,
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

from jaxpar.training.state import init_state
from jaxpar.training.step import make_grad_fn, make_train_step

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

# Accumulation regroups only the sums over rows (4 microbatches of one row): measured at most 2.3e-7 (wk's
# gradient, norm-wise) under default, AVX2 and SSE4_2 code generation; 1e-6 keeps a factor of 4, stricter than
# step_helpers.FP32_RTOL for a whole layout.
RTOL = 1e-6
SEED = 5
T = 8
VALID = (2, 8, 8, 1)
G = len(VALID)
# (data, grad_accum_steps) of the accumulating layouts; the reference is (1, 1).
LAYOUTS = {"accum4": (1, 4), "data2_accum2": (2, 2)}


def _overrides(data: int, accum: int) -> list[str]:
    return [
        *FP32,
        f"mesh.data={data}",
        "mesh.fsdp=1",
        f"train.global_batch_size={G}",
        f"train.grad_accum_steps={accum}",
    ]


@pytest.fixture(scope="module")
def grad_fns(need_devices):
    """name -> (plan, compiled grad_fn, params on the plan's mesh), all from the same initial parameters."""
    need_devices(2)
    fns = {}
    host_params = None
    for name, (data, accum) in {"full": (1, 1), **LAYOUTS}.items():
        plan = make_plan(_overrides(data, accum), jax.devices()[:data])
        if host_params is None:
            host_params = to_host(init_state(plan, SEED)["params"])
        params = jax.device_put(host_params, plan.state_shardings["params"])
        batch = device_batch(plan, host_batch(VALID, T, SEED))
        fns[name] = (plan, compile_fast(jax.jit(make_grad_fn(plan)), params, batch), params)
    return fns


def _grads(fns, name, valid):
    plan, fn, params = fns[name]
    grads, loss, n_tokens = fn(params, device_batch(plan, host_batch(valid, T, SEED)))
    return to_host(grads), float(loss), float(n_tokens)


_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]\w*)>")


def while_carries(hlo_text: str) -> list[list[tuple[tuple[int, ...], str]]]:
    """(shape, element type) of every loop-carried value, one list per `stablehlo.while` in StableHLO text."""
    loops = []
    for line in hlo_text.splitlines():
        if "stablehlo.while(" in line:
            signature = line.rsplit(") : ", 1)[1]
            loops.append(
                [(tuple(int(d) for d in dims.split("x") if d), dtype) for dims, dtype in _TENSOR.findall(signature)]
            )
    return loops


def accumulation_loop(hlo_text: str, accum: int, rows: int) -> list[tuple[tuple[int, ...], str]]:
    """The carry of the one loop over microbatches: the loop that carries the [A, b, T] int32 token ids."""
    loops = [c for c in while_carries(hlo_text) if ((accum, rows, T), "i32") in c]
    assert len(loops) == 1, f"expected one loop over {accum} microbatches of {rows} rows, found {len(loops)}"
    return loops[0]


@pytest.mark.parametrize(
    "valid", [VALID, (2, 0, 8, 1), (0, 0, 8, 1)], ids=["uneven", "one_empty_microbatch", "one_empty_device"]
)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_accumulation_equals_full_batch(grad_fns, layout, valid):
    data, accum = LAYOUTS[layout]
    plan, _, params = grad_fns[layout]
    # The layout really splits: `accum` microbatches of G / (data * accum) rows on `data` devices.
    assert plan.cfg.train.grad_accum_steps == accum > 1 and plan.mesh.shape["data"] == data
    batch = device_batch(plan, host_batch(valid, T, SEED))
    rows = G // (data * accum)
    assert shard_shape(batch["inputs"]) == (G // data, T)
    accumulation_loop(jax.jit(make_grad_fn(plan)).lower(params, batch).as_text(), accum, rows)

    grads, loss, n_tokens = _grads(grad_fns, layout, valid)
    ref_grads, ref_loss, ref_tokens = _grads(grad_fns, "full", valid)
    assert n_tokens == ref_tokens == sum(valid)
    assert_scalar_close(loss, ref_loss, RTOL, "loss")
    assert_tree_close(grads, ref_grads, RTOL)  # also asserts every entry is finite (no NaN from 0 / 0)


def test_token_mean_differs_from_mean_of_microbatch_means(grad_fns):
    """The test batch can tell the two normalisations apart, so the equality above means something."""
    per_row = [
        _grads(grad_fns, "full", tuple(v if i == j else 0 for j, v in enumerate(VALID)))[1] for i in range(G)
    ]  # one row's tokens at a time: that row's token-mean loss
    _, token_mean, _ = _grads(grad_fns, "full", VALID)
    assert_scalar_close(token_mean, np.dot(per_row, VALID) / sum(VALID), RTOL, "token mean")
    assert abs(np.mean(per_row) - token_mean) > 1e3 * RTOL * token_mean


def test_fully_masked_batch_gives_zero_loss_and_gradients(grad_fns):
    for name in grad_fns:
        grads, loss, n_tokens = _grads(grad_fns, name, (0, 0, 0, 0))
        assert n_tokens == 0 and loss == 0, name
        for g in jax.tree.leaves(grads):
            assert np.all(g == 0), name


def test_bf16_accumulation_is_fp32_and_matches_fp32_big_batch():
    mixed = [
        f"train.global_batch_size={G}",
        "train.grad_accum_steps=4",
        "mesh.data=1",
        "mesh.fsdp=1",
        *FIRST_STEP_AT_PEAK,
    ]
    plan = make_plan([*mixed, "precision.compute_dtype=bfloat16", "precision.layout=16p"], jax.devices()[:1])
    ref_plan = make_plan([*mixed, *FP32, "train.grad_accum_steps=1"], jax.devices()[:1])
    state, ref_state = init_state(plan, SEED), init_state(ref_plan, SEED)

    # The ZeRO mixed-precision layout: bf16 working parameters, fp32 master copy and Adam moments.
    for leaf in jax.tree.leaves(state["params"]):
        assert leaf.dtype == jnp.bfloat16
    for tree in (state["master"], otu.tree_get(state["opt_state"], "mu"), otu.tree_get(state["opt_state"], "nu")):
        for leaf in jax.tree.leaves(tree):
            assert leaf.dtype == jnp.float32
    master0 = to_host(state["master"])
    jax.tree.map(np.testing.assert_array_equal, master0, to_host(ref_state["params"]))

    # The gradient accumulator is fp32: the microbatch loop carries an fp32 array shaped like every parameter.
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    hlo = jax.jit(make_grad_fn(plan)).lower(state["params"], batch).as_text()
    carry = Counter(accumulation_loop(hlo, accum=4, rows=1))
    param_shapes = Counter((tuple(p.shape), "f32") for p in jax.tree.leaves(state["params"]))
    assert not param_shapes - carry, f"no fp32 accumulator for {param_shapes - carry}"

    step = compile_fast(make_train_step(plan), state, batch)
    new, metrics = step(state, batch)
    ref_batch = device_batch(ref_plan, host_batch(VALID, T, SEED))
    ref_new, ref_metrics = compile_fast(make_train_step(ref_plan), ref_state, ref_batch)(ref_state, ref_batch)

    bf16_rtol = 2e-2  # bf16 has an 8-bit significand: 2^-8 = 4e-3 per rounding, compounded over the model
    assert_scalar_close(metrics["loss"], ref_metrics["loss"], bf16_rtol, "loss")
    assert_scalar_close(metrics["grad_norm"], ref_metrics["grad_norm"], bf16_rtol, "grad_norm")
    master = to_host(new["master"])
    for leaf in jax.tree.leaves(master):
        assert leaf.dtype == np.float32
    got = {
        "params": master,
        "mu": to_host(otu.tree_get(new["opt_state"], "mu")),
        "nu": to_host(otu.tree_get(new["opt_state"], "nu")),
    }
    want = {
        "params": to_host(ref_new["params"]),
        "mu": to_host(otu.tree_get(ref_new["opt_state"], "mu")),
        "nu": to_host(otu.tree_get(ref_new["opt_state"], "nu")),
    }
    assert_adam_step_close(got, want, master0, bf16_rtol, elementwise=False, **adam_step_args(plan, metrics))
    jax.tree.map(
        np.testing.assert_array_equal,
        to_host(new["params"]),
        jax.tree.map(lambda m: np.asarray(jnp.asarray(m).astype(jnp.bfloat16)), master),
    )
