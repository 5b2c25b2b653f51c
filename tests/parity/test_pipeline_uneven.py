"""An uneven pipeline split (pipeline.stage_layers, pipeline.balance_stages; `jaxpar.parallel.layer_split`): one
train step under every schedule equals the single-device step.

Model and batch as tests/parity/test_pipeline_zero_bubble.py (tiny, L = 8 layers, d_model 64, T 8, fp32, G = 48
rows with uneven valid-token counts) but a vocabulary of 1024, compared the same way at step_helpers.FP32_RTOL:
loss, grad norm, Adam's moments and the update. The layers run in the stage layout (v slots of n_max rows per
device, padding rows skipped in a `lax.cond`) and their gradients return to storage order, so the comparison
covers the moves both ways, the skip in the forward and in the backward (split into B and W under the
zero-bubble schedules, `jaxpar.parallel.split_backward`), and the padding's gradients being dropped.

Cases (split per model chunk, the other axes):
  * 1f1b, p = 3, (3, 3, 2): 8 layers that 3 stages do not divide, stored as 9 rows (a zero row after the last
    layer, `jaxpar.parallel.layer_split.stored_rows`); its parameters and moments stay zero (under -m slow the
    same storage under zb-v, (2, 1, 1, 1, 1, 2));
  * 1f1b, p = 2, (5, 3), on data 2 with ZeRO-3 (the weights gathered inside the skip's cond);
  * zb-v, p = 2, (3, 1, 2, 2) (device 0 runs chunks 0 and 3: 5 layers, device 1 3), on fsdp 2 x tensor 2 with
    sequence parallelism;
  * under -m slow: gpipe (2, 6); interleaved 1f1b p = 2, v = 2, (3, 2, 2, 1); zb-h1 p = 4, (3, 2, 2, 1); and
    pipeline.balance_stages at p = 2 (the head is worth 1.6 layers: (5, 3)).

Each case asserts its layout differs from the reference's (the stage layout's padding rows) and that the split
is uneven.
"""

import jax
import numpy as np
import pytest
from step_helpers import (
    FIRST_STEP_AT_PEAK,
    FP32,
    FP32_RTOL,
    assert_step_equals,
    compile_fast,
    device_batch,
    host_batch,
    make_plan,
    mesh_devices,
    stepped,
    to_host,
)

from jaxpar.model.interface import STACK_ATTRIBUTE
from jaxpar.training.pipelined import stage_layout
from jaxpar.training.state import init_state
from jaxpar.training.step import make_train_step

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

RTOL = FP32_RTOL
SEED = 5
T = 8
L = 8
V = 1024  # the head 6*64*V FLOPs per token is then worth 1.6 layers: pipeline.balance_stages picks (5, 3)
VALID = (8, 3, 8, 0, 5, 8, 1, 8, 8, 7, 2, 8, 8, 4, 8, 6) * 3
G = len(VALID)
CASES = {
    "1f1b_p2_data2_zero3": (
        "mesh.pipeline=2",
        "mesh.data=2",
        "optimizer.zero_stage=3",
        "pipeline.microbatches=4",
        "pipeline.stage_layers=[5,3]",
    ),
    "zbv_p2_fsdp2_tensor2_sp": (
        "mesh.pipeline=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "tensor.sequence_parallel=true",
        "pipeline.schedule=zb-v",
        "pipeline.virtual_stages=2",
        "pipeline.microbatches=4",
        "pipeline.stage_layers=[3,1,2,2]",
    ),
    "gpipe_p2": (
        "mesh.pipeline=2",
        "pipeline.schedule=gpipe",
        "pipeline.microbatches=4",
        "pipeline.stage_layers=[2,6]",
    ),
    "interleaved_p2_v2": (
        "mesh.pipeline=2",
        "pipeline.virtual_stages=2",
        "pipeline.microbatches=4",
        "pipeline.stage_layers=[3,2,2,1]",
    ),
    "zbh1_p4": (
        "mesh.pipeline=4",
        "pipeline.schedule=zb-h1",
        "pipeline.microbatches=4",
        "pipeline.stage_layers=[3,2,2,1]",
    ),
    "balanced_p2": ("mesh.pipeline=2", "pipeline.microbatches=4", "pipeline.balance_stages=true"),
    # 8 layers over 3 stages: stored as 9 rows (3 per device), the last a zero row that no stage runs
    "1f1b_p3_stored9": ("mesh.pipeline=3", "pipeline.microbatches=3", "pipeline.stage_layers=[3,3,2]"),
    # zb-v's V over the same 9 stored rows: device 0 runs chunks 0 and 5, device 2 chunks 2 and 3
    "zbv_p3_stored9": (
        "mesh.pipeline=3",
        "pipeline.schedule=zb-v",
        "pipeline.virtual_stages=2",
        "pipeline.microbatches=3",
        "pipeline.stage_layers=[2,1,1,1,1,2]",
    ),
}
SLOW = {"gpipe_p2", "interleaved_p2_v2", "zbh1_p4", "balanced_p2", "zbv_p3_stored9"}


def _overrides(*extra: str) -> list[str]:
    return [
        *FP32,
        *FIRST_STEP_AT_PEAK,
        "optimizer.grad_clip_norm=0",
        f"model.n_layers={L}",
        f"model.vocab_size={V}",
        f"train.global_batch_size={G}",
        "mesh.data=1",
        "mesh.fsdp=1",
        *extra,
    ]


@pytest.fixture(scope="module")
def reference() -> dict:
    plan = make_plan(_overrides(), jax.devices()[:1])
    state = init_state(plan, SEED)
    host_state = to_host(state)
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    out = stepped(compile_fast(make_train_step(plan), state, batch), state, batch)
    assert out["metrics"]["tokens"] == sum(VALID)
    return {"host_state": host_state, **out}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] * (c in SLOW)) for c in CASES])
def test_one_step_equals_single_device(case, reference, need_devices):
    ref = reference
    n = mesh_devices(CASES[case])
    need_devices(n)
    plan = make_plan(_overrides(*CASES[case]), jax.devices()[:n])
    layout = stage_layout(plan)
    if case == "balanced_p2":
        assert layout is not None and layout.counts == (5, 3)
    assert layout is not None and len(set(layout.counts)) > 1, "the split must be uneven"
    assert np.min(layout.mask()) == 0.0, "some stage-layout rows must be padding"
    stored = plan.stack_rows
    if case.endswith("stored9"):
        assert stored == 9 and layout.stored == 9
    state = jax.device_put(_stack_rows(ref["host_state"], stored), plan.state_shardings)
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    got = stepped(compile_fast(make_train_step(plan), state, batch), state, batch)
    if stored > L:  # the storage padding rows stay zero: parameters and both moments
        for a in _stack_leaves({k: got[k] for k in ("params", "mu", "nu")}):
            assert a.shape[0] == stored and not np.any(a[L:])
        got = {**got, **{k: _stack_rows(got[k], L) for k in ("params", "mu", "nu")}}
    assert_step_equals(plan, got, ref, RTOL)


def _stack_leaves(tree) -> list:
    """The leaves of every layer stack (`blocks`) in `tree` (params, or an optimizer state that mirrors them)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [a for path, a in flat if any(getattr(k, "key", None) == STACK_ATTRIBUTE for k in path)]


def _stack_rows(tree, rows: int):
    """`tree` with every layer stack leaf cut or zero-padded to `rows` rows (as `jaxpar.model.params.fit_stack`)."""

    def fit(path, a):
        if not any(getattr(k, "key", None) == STACK_ATTRIBUTE for k in path) or np.ndim(a) == 0:
            return a
        return a[:rows] if a.shape[0] >= rows else np.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1))

    return jax.tree_util.tree_map_with_path(fit, tree)
