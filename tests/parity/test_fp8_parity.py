"""FP8 GEMMs (`precision.fp8`, `jaxpar.parallel.fp8`): one train step with FP8 on each layout equals FP8 on one
device, and a layout that took each shard's own amax would not.

Model: tiny (2 layers, d_model 64, 4 heads, 2 kv heads), fp32 compute, T = 16, G = 8 rows with uneven valid-token
counts; its 7 projections per block (q, k, v, o, gate, up, down) run in FP8, forward and backward.

Why the fp32 tolerance holds with FP8 on both sides: every device quantises with the scale one device computes
from the whole tensor, so the FP8 operands are the reference's bit for bit wherever the values entering the
quantiser are, and a layout changes those values only by the reordered fp32 sums of tensor parallelism's
all-reduce or context parallelism's attention (`step_helpers.FP32_RTOL`). Such a change moves a value across an
FP8 rounding boundary only if it lies within that reordering of one: a rare "flip" of one element by one FP8 step,
whose row or column of a gradient then misses the elementwise fp32 bound (`step_helpers.FP8_FLIPS` says how
rare, and how many are allowed). Measured: loss within 8.5e-8, gradients 2.2e-7 norm-wise; one flip, on an AMD
EPYC, in the capacity case's shared expert (2 entries of its w_down's gradient). A per-shard amax quantises each
shard with its own scale: the gradients then differ by about 1e-1 norm-wise, which the broken variant below shows.

A microbatch is the tensor whose scales are taken, so the pipeline case (M = 2 microbatches) compares with one
device accumulating the same 2 microbatches (the whole batch at once has other scales: 3e-5 on the loss).

Cases: data 2 x fsdp 2 x tensor 2 (no sequence parallelism), ZeRO-1; context 2 (all_gather) x tensor 2 with
sequence parallelism x fsdp 2, ZeRO-3; pipeline 2 (1F1B) x tensor 2, M = 2; and the first layout with the amax
reduction removed, which must fail. Each asserts its layout really differs: the axes it splits have more than one
device, and the activations' scales are reduced over them (`StepPlan.fp8.token_axes`).
"""

import jax
import numpy as np
import pytest
from step_helpers import (
    FIRST_STEP_AT_PEAK,
    FP8_FLIPS,
    FP32,
    FP32_RTOL,
    assert_step_equals,
    assert_tree_close,
    compile_fast,
    host_batch,
    make_plan,
    mesh_devices,
    stepped,
    to_host,
)

import jaxpar.parallel.fp8 as fp8_lib
from jaxpar.parallel.fp8 import cpu_fp8_error
from jaxpar.training.state import init_state
from jaxpar.training.step import make_grad_fn, make_train_step

pytestmark = [
    pytest.mark.usefixtures("fast_compile"),  # tests/conftest.py
    pytest.mark.skipif(cpu_fp8_error() is not None, reason=f"XLA:CPU cannot compile FP8 here: {cpu_fp8_error()}"),
]

RTOL = FP32_RTOL
SEED = 3
T = 16
VALID = (16, 16, 3, 0, 12, 16, 1, 9)
G = len(VALID)
CASES = {
    "data2_fsdp2_tensor2_zero1": (
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "tensor.sequence_parallel=false",
        "optimizer.zero_stage=1",
    ),
    "context2_tensor2_sp_fsdp2_zero3": (
        "mesh.context=2",
        "mesh.tensor=2",
        "mesh.fsdp=2",
        "tensor.sequence_parallel=true",
        "optimizer.zero_stage=3",
    ),
    "pipeline2_tensor2_m2": ("mesh.pipeline=2", "mesh.tensor=2", "pipeline.microbatches=2"),
    "moe_dropless_experts_data2_tensor2": ("mesh.data=2", "mesh.tensor=2", "model.moe.expert_axes=[data]"),
    "moe_capacity_experts_fsdp2_tensor2": (
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "model.moe.routing=capacity",
        "model.moe.expert_axes=[fsdp]",
    ),
}
# The MoE cases' model: 4 experts, top-2, every second block an MoE block with a shared expert (its own reference)
MOE = (
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.d_expert=64",
    "model.moe.every=2",
    "model.moe.shared_experts=1",
)


def _overrides(*extra: str) -> list[str]:
    return [
        *FP32,
        *FIRST_STEP_AT_PEAK,
        "precision.fp8.enabled=true",
        "optimizer.grad_clip_norm=0",
        f"data.seq_len={T}",
        f"train.global_batch_size={G}",
        "mesh.data=1",
        "mesh.fsdp=1",
        *extra,
    ]


def _device_batch(plan) -> dict:
    return {k: jax.device_put(v, plan.batch_sharding) for k, v in host_batch(VALID, T, SEED).items()}


def _reference_key(case: str) -> tuple[str, ...]:
    """The reference's overrides for a case: the MoE model for the MoE cases, and its microbatches (each
    microbatch has its own scales)."""
    model = MOE if case.startswith("moe") else ()
    routing = tuple(o for o in CASES[case] if o.startswith("model.moe.routing"))
    return model + routing + tuple(o for o in CASES[case] if o.startswith("pipeline.microbatches"))


_REFERENCES: dict = {}


@pytest.fixture(scope="module")
def reference():
    """The single-device FP8 step with the given overrides (`_reference_key`), computed once each."""

    def get(key: tuple[str, ...]) -> dict:
        if key not in _REFERENCES:
            plan = make_plan(_overrides(*key), jax.devices()[:1])
            state = init_state(plan, SEED)
            host_state = to_host(state)
            batch = _device_batch(plan)
            if not key:
                _assert_projections_run_in_fp8(plan, state, batch)
            if key == MOE:
                _assert_experts_run_in_fp8(plan, state, batch)
            step = compile_fast(make_train_step(plan), state, batch)
            out = stepped(step, state, batch)
            _REFERENCES[key] = {"host_state": host_state, "plan": plan, "step": step, **out}
        return _REFERENCES[key]

    return get


def _assert_projections_run_in_fp8(plan, state, batch) -> None:
    """The gradient's program multiplies FP8 operands in 7 GEMMs per block forward (E4M3 x E4M3) and 14 backward
    (E5M2 gradient x E4M3), the block body traced once in each direction; the head's GEMMs stay in fp32."""
    kinds = [
        tuple(v.aval.dtype.name for v in e.invars)
        for e in _equations(jax.make_jaxpr(make_grad_fn(plan))(state["params"], batch).jaxpr)
        if e.primitive.name == "dot_general"
    ]
    assert kinds.count(("float8_e4m3fn", "float8_e4m3fn")) == 7, kinds
    assert kinds.count(("float8_e5m2", "float8_e4m3fn")) + kinds.count(("float8_e4m3fn", "float8_e5m2")) == 14, kinds
    assert ("float32", "float32") in kinds  # the head (and attention's scores) are not FP8


def _assert_experts_run_in_fp8(plan, state, batch) -> None:
    """Dropless routing's grouped GEMMs (`ragged_dot`) all multiply FP8 operands: per MoE block 3 forward (run again
    where the remat policy recomputes the block) and 6 backward, those with the E5M2 output gradient."""
    jaxpr = jax.make_jaxpr(make_grad_fn(plan))(state["params"], batch).jaxpr
    ragged = [
        tuple(v.aval.dtype.name for v in e.invars[:2])
        for e in _equations(jaxpr)
        if e.primitive.name in ("ragged_dot", "ragged_dot_general")
    ]
    assert all(k[0].startswith("float8") and k[1].startswith("float8") for k in ragged), ragged
    assert sum("float8_e5m2" in k for k in ragged) == 6 and len(ragged) >= 9, ragged


def _equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs inside it (scans, custom VJPs, shard_map)."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def _layout(case: str):
    overrides = (MOE if case.startswith("moe") else ()) + CASES[case]
    n = mesh_devices(overrides)
    plan = make_plan(_overrides(*overrides), jax.devices()[:n])
    split = {a: s for a, s in plan.mesh_shape.items() if s > 1}
    assert len(split) >= 2 and plan.fp8.active
    # the activations' scales are reduced over exactly the token axes this layout splits
    assert plan.fp8.token_axes == tuple(a for a in ("data", "fsdp", "context") if a in split)
    return plan


def _run(plan, ref) -> dict:
    batch = _device_batch(plan)
    state = jax.device_put(ref["host_state"], plan.state_shardings)
    return stepped(compile_fast(make_train_step(plan), state, batch), state, batch)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_step_equals_fp8_on_one_device(case, reference, need_devices):
    need_devices(mesh_devices(CASES[case]))
    ref = reference(_reference_key(case))
    plan = _layout(case)
    assert_step_equals(plan, _run(plan, ref), ref, RTOL, flips=FP8_FLIPS)


@pytest.mark.timeout(300)
def test_a_per_shard_amax_breaks_the_parity(reference, need_devices, monkeypatch):
    """The deliberately broken variant: every device takes the amax of its own shard (no max-reduction)."""
    case = "data2_fsdp2_tensor2_zero1"
    need_devices(mesh_devices(CASES[case]))
    ref = reference(())
    plan = _layout(case)
    whole = fp8_lib.global_amax
    monkeypatch.setattr(fp8_lib, "global_amax", lambda x, axes: whole(x, ()))
    got = _run(plan, ref)
    with pytest.raises(AssertionError, match="norm-wise relative error"):
        assert_tree_close(got["mu"], ref["mu"], RTOL)
    mu = np.concatenate([np.ravel(v) for v in jax.tree.leaves(got["mu"])])
    want = np.concatenate([np.ravel(v) for v in jax.tree.leaves(ref["mu"])])
    assert np.linalg.norm(mu - want) / np.linalg.norm(want) > 1e3 * RTOL  # far outside, not at the edge


def test_a_non_finite_amax_skips_the_update(reference):
    """An inf in one weight makes that tensor's amax, scale and so the loss non-finite: the existing non-finite
    skip (`jaxpar.training.optimizer.skip_nonfinite`) leaves the parameters as they were and counts the step."""
    ref = reference(())
    plan = ref["plan"]
    params = jax.tree.map(np.array, ref["host_state"]["params"])
    params["blocks"]["attn"]["wq"][0, 0, 0, 0] = np.inf
    state = jax.device_put({**ref["host_state"], "params": params}, plan.state_shardings)
    got = stepped(ref["step"], state, _device_batch(plan))
    assert not np.isfinite(got["metrics"]["loss"])
    assert got["metrics"]["skipped_steps"] == 1
    for new, old in zip(jax.tree.leaves(got["params"]), jax.tree.leaves(params)):
        np.testing.assert_array_equal(new, old)
