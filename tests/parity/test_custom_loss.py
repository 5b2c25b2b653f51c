"""A caller's own training loss (`jaxpar.training.loss`, `build_plan(..., loss_fn=...)`): cross-entropy + z-loss
equals its formula on one device and the single-device step on every kind of layout; a plain full-logits loss
is exact under tensor parallelism; bad losses are refused before any device work.

The z-loss runs with weight 1e-2 instead of PaLM's 1e-4, so that its term is a sizeable part of the loss and
of the gradients (checked below): a layout that dropped or mis-normalised it would fail. Layouts compared with
one device (gradients and loss of `make_grad_fn`, at `step_helpers.FP32_RTOL`, the fp32 whole-model parity
tolerance): data=2 x fsdp=4 with 2 accumulation steps (ZeRO-1), data=2 x fsdp=2 x tensor=2 with sequence
parallelism (ZeRO-3), pipeline=2 x data=2 x fsdp=2 with 1F1B and with GPipe (2 microbatches). Each test asserts
its layout really differs from the reference's. The optimizer step after the gradients does not depend on the
loss (tests/parity/test_step_parity.py and the others cover it).

Shape letters: G global batch, T sequence length, V vocabulary, L layers, D model width.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from step_helpers import (
    FP32,
    FP32_RTOL,
    VOCAB,
    assert_scalar_close,
    assert_tree_close,
    compile_fast,
    device_batch,
    host_batch,
    planner,
    shard_shape,
    spec_axes,
    to_host,
)

from jaxpar.training.loss import VocabParallelLoss, cross_entropy_with_z_loss
from jaxpar.training.state import init_state
from jaxpar.training.step import make_eval_step, make_grad_fn

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

RTOL = FP32_RTOL  # fp32 whole-model parity: reordered sums (step_helpers.FP32_RTOL says why)
SEED = 7
T = 8
VALID = (8, 3, 8, 0, 5, 8, 1, 8, 8, 7, 2, 8, 8, 4, 8, 6)  # uneven valid tokens per row, one row fully masked
G = len(VALID)
Z_WEIGHT = 1e-2
Z_LOSS = cross_entropy_with_z_loss(Z_WEIGHT)


_plan = planner(*FP32, f"train.global_batch_size={G}", "mesh.data=1", "mesh.fsdp=1", loss_fn=Z_LOSS)


def _grads(plan, host_params):
    params = jax.device_put(host_params, plan.state_shardings["params"])
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    grads, loss, n_tokens = compile_fast(jax.jit(make_grad_fn(plan)), params, batch)(params, batch)
    return params, batch, to_host(grads), float(loss), float(n_tokens)


def _z_loss_full_logits(logits_BTV, batch):
    """The same loss as a plain function of the full logits (jax.nn.logsumexp, no vocabulary sharding)."""
    logits = logits_BTV.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.sum((log_z - target + Z_WEIGHT * jnp.square(log_z)) * batch["loss_mask"])


@pytest.fixture(scope="module")
def reference() -> dict:
    """One device: z-loss gradients and loss, the default cross-entropy's, and the eval step of the z-loss plan."""
    plan = _plan([], 1)
    host_params = to_host(init_state(plan, SEED)["params"])
    params, batch, grads, loss, n_tokens = _grads(plan, host_params)
    ce_plan = _plan([], 1, loss_fn=None)
    _, _, ce_grads, ce_loss, _ = _grads(ce_plan, host_params)
    eval_sum, eval_count = make_eval_step(plan)(params, batch)
    logits = np.asarray(plan.mdef.bind(params)(batch["inputs"]), np.float64)  # [G, T, V], no tensor parallelism
    return {
        "plan": plan,
        "params": host_params,
        "grads": grads,
        "loss": loss,
        "tokens": n_tokens,
        "ce_grads": ce_grads,
        "ce_loss": ce_loss,
        "eval": (float(eval_sum), float(eval_count)),
        "logits": logits,
        "batch": to_host(batch),
    }


def test_z_loss_is_its_formula_and_changes_the_gradients(reference):
    """Loss = sum over valid tokens of (log Z - target logit + w * (log Z)^2) / valid tokens (PaLM section 5),
    recomputed here in float64 from the model's logits; the z-term moves loss and gradients far beyond the
    tolerance; evaluation stays the plain cross-entropy."""
    ref = reference
    logits, b = ref["logits"], ref["batch"]
    shift = logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits - shift).sum(-1)) + shift[..., 0]
    target = np.take_along_axis(logits, b["targets"][..., None], axis=-1)[..., 0]
    mask = b["loss_mask"].astype(np.float64)
    ce = float(((log_z - target) * mask).sum() / mask.sum())
    z = float((np.square(log_z) * mask).sum() / mask.sum())
    assert ref["tokens"] == mask.sum() == sum(VALID)
    assert_scalar_close(ref["ce_loss"], ce, RTOL, "cross-entropy")
    assert_scalar_close(ref["loss"], ce + Z_WEIGHT * z, RTOL, "cross-entropy + z-loss")
    assert Z_WEIGHT * z > 100 * RTOL * ce  # the z-term is far above the tolerance
    diff = [
        np.linalg.norm(a - c) / np.linalg.norm(c)
        for a, c in zip(jax.tree.leaves(ref["grads"]), jax.tree.leaves(ref["ce_grads"]))
    ]
    assert max(diff) > 100 * RTOL  # and so is its gradient
    eval_sum, eval_count = ref["eval"]
    assert eval_count == mask.sum()
    assert_scalar_close(eval_sum / eval_count, ce, RTOL, "eval loss (cross-entropy)")


def _assert_matches(ref: dict, grads, loss: float, n_tokens: float) -> None:
    assert n_tokens == ref["tokens"] == sum(VALID)
    assert_scalar_close(loss, ref["loss"], RTOL, "loss")
    assert_tree_close(grads, ref["grads"], RTOL)


def test_z_loss_data_fsdp_accumulation_equals_one_device(reference, need_devices):
    need_devices(8)
    plan = _plan(["mesh.data=2", "mesh.fsdp=4", "optimizer.zero_stage=1", "train.grad_accum_steps=2"], 8)
    params, batch, grads, loss, n_tokens = _grads(plan, reference["params"])
    w = params["blocks"]["mlp"]["w_up"]
    L, D, F = w.shape
    assert shard_shape(batch["inputs"]) == (G // 8, T) and plan.cfg.train.grad_accum_steps == 2
    assert shard_shape(w) == (L, D // 4, F) and "fsdp" in spec_axes(w.sharding)
    _assert_matches(reference, grads, loss, n_tokens)


def test_z_loss_tensor_sequence_parallel_equals_one_device(reference, need_devices):
    need_devices(8)
    plan = _plan(
        ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "tensor.sequence_parallel=true", "optimizer.zero_stage=3"], 8
    )
    params, batch, grads, loss, n_tokens = _grads(plan, reference["params"])
    assert plan.tensor_parallel.size == 2 and plan.tensor_parallel.sequence_parallel
    table = params["embed"]["table"]
    assert table.sharding.spec[0] == "tensor" and shard_shape(table)[0] == VOCAB // 2  # vocabulary split
    assert shard_shape(batch["inputs"]) == (G // 4, T)
    _assert_matches(reference, grads, loss, n_tokens)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_z_loss_pipeline_equals_one_device(schedule, reference, need_devices):
    """The last stage computes the loss; pipeline=2 x data=2 x fsdp=2, 2 microbatches."""
    need_devices(8)
    plan = _plan(
        ["mesh.pipeline=2", "mesh.data=2", "mesh.fsdp=2", "pipeline.microbatches=2", f"pipeline.schedule={schedule}"], 8
    )
    params, batch, grads, loss, n_tokens = _grads(plan, reference["params"])
    w = params["blocks"]["mlp"]["w_up"]
    assert plan.mesh.shape["pipeline"] == 2 and plan.cfg.pipeline.schedule == schedule
    assert shard_shape(batch["inputs"]) == (G // 4, T)  # rows over data x fsdp, whole on each stage
    assert w.sharding.spec[0] == "pipeline" and shard_shape(w)[0] == w.shape[0] // 2  # one layer per stage
    _assert_matches(reference, grads, loss, n_tokens)


def test_plain_loss_sees_full_logits_under_tensor_parallelism(reference, need_devices):
    """A plain function of the full logits (here the z-loss through jax.nn.logsumexp) on tensor=2 with sequence
    parallelism: the step gathers the vocabulary shards, and the result equals the one-device z-loss."""
    need_devices(4)
    seen = []

    def loss_fn(logits_BTV, batch):
        seen.append(logits_BTV.shape)
        return _z_loss_full_logits(logits_BTV, batch)

    plan = _plan(["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"], 4, loss_fn=loss_fn)
    params, _, grads, loss, n_tokens = _grads(plan, reference["params"])
    assert plan.tensor_parallel.size == 2 and shard_shape(params["embed"]["table"])[0] == VOCAB // 2
    assert seen and all(shape[-1] == VOCAB for shape in seen)  # full vocabulary, not V/t
    _assert_matches(reference, grads, loss, n_tokens)


def test_vocab_parallel_loss_sees_its_shard(need_devices):
    """A VocabParallelLoss gets [b, T, V/t] logits and the tensor context (checked while tracing)."""
    need_devices(2)
    seen = []

    def fn(logits, batch, tp):
        seen.append((logits.shape[-1], tp.size))
        return tp.cross_entropy_sum(logits, batch["targets"], batch["loss_mask"])

    plan = _plan(["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=2", "model.n_layers=1"], 2, loss_fn=VocabParallelLoss(fn))
    params = init_state(plan, SEED)["params"]
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    jax.jit(make_grad_fn(plan)).lower(params, batch)
    assert (VOCAB // 2, 2) in seen


@pytest.mark.parametrize(
    "loss_fn,match",
    [
        (lambda logits, batch: logits.sum(-1), r"real scalar, got shape \(1, 8\)"),
        (lambda logits, batch: jnp.sum(batch["targets"]), r"real scalar, got shape \(\) int32"),  # no gradient
        (lambda logits, batch: batch["weights"].sum(), r"loss_fn failed on logits float32 \[1, 8, 264\].*KeyError"),
        ("cross_entropy", r"loss_fn must be callable"),
    ],
)
def test_bad_loss_is_refused_at_plan_time(loss_fn, match):
    with pytest.raises(TypeError, match=match):
        _plan([], 1, loss_fn=loss_fn)


def test_z_loss_weight_must_be_finite_and_non_negative():
    for bad in (-1e-4, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="z-loss weight must be finite and >= 0"):
            cross_entropy_with_z_loss(bad)
