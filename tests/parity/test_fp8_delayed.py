"""FP8 delayed scaling (`precision.fp8.scaling=delayed`, `jaxpar.training.fp8_history`): one train step on each
layout equals the step on one device, the amaxes it appends to the history included; and a step that summed the
microbatches' amaxes instead of taking their max would not.

Model: tiny (2 layers, d_model 64, 4 heads, 2 kv heads), fp32 compute, T = 16, G = 8 rows with uneven valid-token
counts, a window of 4 steps. The compared step is Adam's first from the initial parameters, with the history one
step of the reference left, so every scale comes from a history (an empty history scales each operand from its
current amax per microbatch, current scaling's step, tested in test_fp8_parity.py).

Why the fp32 tolerance holds: the scales come from the history, the same numbers on every layout, so the FP8
operands are the reference's bit for bit wherever the values entering the quantiser are; a layout changes those
only by reordered fp32 sums (`step_helpers.FP32_RTOL`). With a history, quantising does not depend on how the rows
are cut into microbatches either, and the amax appended is the max over the step's microbatches, so a layout may
run other microbatches than the reference (gradient accumulation, pipeline microbatches). A reordered value that
lies within its reordering of a rounding boundary of the FP8 grid rounds to the other neighbour: a rare "flip"
that moves one element by one FP8 step (`step_helpers.FP8_FLIPS`: its rate, and the rows or columns allowed).
Measured: loss within 1.4e-7, gradients 2.8e-7 norm-wise, the appended amaxes 2.1e-7 elementwise, no flip (a
model of 4 layers and 16 rows flipped about one element per step).

Cases, one per way the amaxes travel: data 2 x fsdp 2 x tensor 2 with 2 accumulation steps, ZeRO-1 (the
accumulation loop's microbatches); 1F1B pipeline 2 x tensor 2 x data 2 with 2 microbatches (the stash of the
blocks' residuals); ZB-H1 pipeline 2 x data 4 (the zero-bubble split backward); and in the slow suite, each with
its own reference: MoE with dropless experts over data 2 x tensor 2 x fsdp 2 (the experts' GEMM sites), and on 4
layers ZB-V (its chunk order) and the uneven stage layout [3, 1] (its padding rows). Each asserts that its layout
splits more than one mesh axis and, but for MoE, that it runs more microbatches than the reference's one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from step_helpers import (
    FIRST_STEP_AT_PEAK,
    FP8_FLIPS,
    FP32,
    FP32_RTOL,
    assert_step_equals,
    compile_fast,
    host_batch,
    make_plan,
    mesh_devices,
    stepped,
    to_host,
)

import jaxpar.training.fp8_history as fp8_history
from jaxpar.parallel.fp8 import cpu_fp8_error
from jaxpar.training.state import init_state
from jaxpar.training.step import make_train_step

pytestmark = pytest.mark.skipif(
    cpu_fp8_error() is not None, reason=f"XLA:CPU cannot compile FP8 here: {cpu_fp8_error()}"
)

RTOL = FP32_RTOL
SEED = 3
T = 16
VALID = (16, 16, 3, 0, 12, 16, 1, 9)
WINDOW = 4
MOE = (
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.d_expert=64",
    "model.moe.every=2",
    "model.moe.shared_experts=1",
)
CASES = {
    "data2_fsdp2_tensor2_accum2_zero1": (
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "tensor.sequence_parallel=false",
        "optimizer.zero_stage=1",
        "train.grad_accum_steps=2",
    ),
    "pipeline2_1f1b_tensor2_data2": ("mesh.pipeline=2", "mesh.tensor=2", "mesh.data=2", "pipeline.microbatches=2"),
    "pipeline2_zbh1_data4": ("mesh.pipeline=2", "mesh.data=4", "pipeline.microbatches=2", "pipeline.schedule=zb-h1"),
    "moe_dropless_experts_data2_tensor2_fsdp2": (
        "mesh.data=2",
        "mesh.tensor=2",
        "mesh.fsdp=2",
        "model.moe.expert_axes=[data]",
    ),
}
# Cases on a 4-layer model (2 virtual stages of 2 stages need 4): its own reference
FOUR_LAYERS = ("model.n_layers=4",)
CASES4 = {
    "pipeline2_zbv_data4": (
        "mesh.pipeline=2",
        "mesh.data=4",
        "pipeline.microbatches=2",
        "pipeline.schedule=zb-v",
        "pipeline.virtual_stages=2",
    ),
    "pipeline2_uneven_3_1_data4": (
        "mesh.pipeline=2",
        "mesh.data=4",
        "pipeline.microbatches=2",
        "pipeline.stage_layers=[3,1]",
    ),
}
CASES.update(CASES4)
# Their own reference compiles, about 20 s each of the default suite: the slow suite runs them
SLOW = {"moe_dropless_experts_data2_tensor2_fsdp2", *CASES4}


def _overrides(*extra: str) -> list[str]:
    return [
        *FP32,
        *FIRST_STEP_AT_PEAK,
        "precision.fp8.enabled=true",
        "precision.fp8.scaling=delayed",
        f"precision.fp8.amax_history={WINDOW}",
        "optimizer.grad_clip_norm=0",
        f"data.seq_len={T}",
        f"train.global_batch_size={len(VALID)}",
        "mesh.data=1",
        "mesh.fsdp=1",
        *extra,
    ]


def _run(plan, host_state) -> dict:
    """One step of `plan` from `host_state`: host copies of the metrics, parameters, Adam moments and history."""
    batch = {k: jax.device_put(v, plan.batch_sharding) for k, v in host_batch(VALID, T, SEED).items()}
    state = jax.device_put(host_state, plan.state_shardings)
    new, metrics = compile_fast(make_train_step(plan), state, batch)(state, batch)
    history = to_host(new["fp8"][fp8_history.HISTORY])
    return {**stepped(lambda s, b: (new, metrics), None, None), "history": history}


_REFERENCES: dict = {}


@pytest.fixture(scope="module")
def reference():
    """The one-device reference of a model (dense or MoE): the initial state with the history one step
    leaves, and the step from there."""

    def get(model: tuple[str, ...]) -> dict:
        if model not in _REFERENCES:
            plan = make_plan(_overrides(*model), jax.devices()[:1])
            batch = {k: jax.device_put(v, plan.batch_sharding) for k, v in host_batch(VALID, T, SEED).items()}
            state = init_state(plan, SEED)
            host_state = to_host(state)
            stepped_state, _ = compile_fast(make_train_step(plan), state, batch)(state, batch)
            # the initial parameters (Adam's first step: `assert_adam_step_close`) with one step's history
            host_state["fp8"] = to_host(stepped_state["fp8"])
            history = host_state["fp8"][fp8_history.HISTORY]
            assert history.shape == fp8_history.history_shape(plan.cfg)
            assert np.all(history[..., 0] > 0) and np.all(history[..., 1:] == 0)  # one step of amaxes
            _REFERENCES[model] = {"plan": plan, "host_state": host_state, **_run(plan, host_state)}
        return _REFERENCES[model]

    return get


def _model(case: str) -> tuple[str, ...]:
    """The model overrides of a case (and of its reference)."""
    return MOE if case.startswith("moe") else FOUR_LAYERS if case in CASES4 else ()


def _layout(case: str):
    plan = make_plan(_overrides(*_model(case), *CASES[case]), jax.devices()[: mesh_devices(CASES[case])])
    split = {a: s for a, s in plan.mesh_shape.items() if s > 1}
    assert len(split) >= 2 and plan.fp8.delayed
    return plan


def _assert_history_close(got: np.ndarray, want: np.ndarray, rtol: float) -> None:
    """The appended amaxes (entry 0) within `rtol` elementwise (amaxes are positive); the older entries bitwise."""
    np.testing.assert_array_equal(got[..., 1:], want[..., 1:])
    assert np.all(want[..., 0] > 0)
    worst = float(np.max(np.abs(got[..., 0] - want[..., 0]) / want[..., 0]))
    assert worst <= rtol, f"amaxes appended: relative error {worst:.3g} > {rtol:g}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_delayed_step_equals_one_device(case, reference, need_devices):
    need_devices(mesh_devices(CASES[case]))
    plan = _layout(case)
    ref = reference(_model(case))
    cfg = plan.cfg
    # microbatches other than the reference's one (the MoE case: data split by expert parallelism instead)
    assert cfg.train.grad_accum_steps * cfg.pipeline.microbatches > 1 or cfg.model.moe.enabled
    got = _run(plan, ref["host_state"])
    assert_step_equals(plan, got, ref, RTOL, flips=FP8_FLIPS)
    _assert_history_close(got["history"], ref["history"], RTOL)


@pytest.mark.timeout(300)
def test_summed_amaxes_break_the_parity(reference, need_devices, monkeypatch):
    """The deliberately broken variant: the step's amax is the sum of its microbatches' (as plain gradient
    accumulation of the cotangents would give), not their max."""
    case = "data2_fsdp2_tensor2_accum2_zero1"
    need_devices(mesh_devices(CASES[case]))
    ref = reference(())
    plan = _layout(case)
    monkeypatch.setattr(fp8_history, "seen_amax", lambda probes: jnp.sum(probes, axis=1))
    got = _run(plan, ref["host_state"])
    with pytest.raises(AssertionError, match="amaxes appended"):
        _assert_history_close(got["history"], ref["history"], RTOL)
    assert np.max(got["history"][..., 0] / ref["history"][..., 0]) > 1.1  # far outside, not at the edge


def test_a_non_finite_step_leaves_the_history(reference):
    """An inf in one weight makes the step non-finite: the non-finite skip leaves the parameters and the whole
    amax history as they were (the inf amax is not written either), and counts the step."""
    ref = reference(())
    plan = ref["plan"]
    host = jax.tree.map(np.array, ref["host_state"])
    host["params"]["blocks"]["attn"]["wq"][0, 0, 0, 0] = np.inf
    got = _run(plan, host)
    assert not np.isfinite(got["metrics"]["grad_norm"]) and got["metrics"]["skipped_steps"] == 1
    np.testing.assert_array_equal(got["history"], host["fp8"][fp8_history.HISTORY])
    for new, old in zip(jax.tree.leaves(got["params"]), jax.tree.leaves(host["params"])):
        np.testing.assert_array_equal(new, old)
