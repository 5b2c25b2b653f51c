"""The vocabulary-parallel head (pipeline.vocab_parallel: every stage computes the logits and loss terms of its
1/p of the vocabulary for the last stage's output; `jaxpar.parallel.pipeline_1f1b`): one 1F1B train step equals the
single-device step.

Model and batch as tests/parity/test_pipeline_uneven.py (tiny, L = 8 layers, d_model 64, T 8, fp32, G = 48 rows
with uneven valid-token counts, vocabulary 1024), compared at step_helpers.FP32_RTOL: loss, grad norm, Adam's
moments and the update. The head's gradient is the sum over stages of each slice's: with the softmax
normaliser, the target logit and the head's input gradient all-reduced over `pipeline`, a slice counted twice or
missed shows in the head's and final norm's gradients and in every layer's through the input gradient.

Cases: p = 2 on data 2 (ZeRO-1); p = 2 on tensor 2 with sequence parallelism (the vocabulary split over tensor,
then over the stages), with tied embeddings (the embedding table's gradient adds its lookups' on the first stage to
the head slices'); under -m slow: p = 4 with an uneven split (pipeline.stage_layers, `jaxpar.parallel.layer_split`;
pipeline.balance_stages with the head spread over the stages gives the even split, nothing being left to balance).
Each asserts the layout differs from the reference's (the blocks over `pipeline`) and that the logits really are
split (a stage's vocabulary slice is 1/(t p) of it).
"""

import re

import jax
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
    shard_shape,
    stepped,
    to_host,
)

from jaxpar.config import ConfigError
from jaxpar.training.state import init_state
from jaxpar.training.step import make_train_step

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

RTOL = FP32_RTOL
SEED = 5
T = 8
L = 8
V = 1024
VALID = (8, 3, 8, 0, 5, 8, 1, 8, 8, 7, 2, 8, 8, 4, 8, 6) * 3
G = len(VALID)
VP = ("pipeline.vocab_parallel=true", "pipeline.microbatches=4")
CASES = {
    "p2_data2": ("mesh.pipeline=2", "mesh.data=2", *VP),
    "p2_tensor2_sp_tied": ("mesh.pipeline=2", "mesh.tensor=2", "tensor.sequence_parallel=true", *VP),
    "p4_uneven": ("mesh.pipeline=4", "pipeline.stage_layers=[3,2,2,1]", *VP),
}
SLOW = {"p4_uneven"}


def _overrides(*extra: str, tied: bool = False) -> list[str]:
    return [
        *FP32,
        *FIRST_STEP_AT_PEAK,
        "optimizer.grad_clip_norm=0",
        f"model.n_layers={L}",
        f"model.vocab_size={V}",
        f"model.tie_embeddings={str(tied).lower()}",
        f"train.global_batch_size={G}",
        "mesh.data=1",
        "mesh.fsdp=1",
        *extra,
    ]


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(tied: bool) -> dict:
        if tied not in cache:
            plan = make_plan(_overrides(tied=tied), jax.devices()[:1])
            state = init_state(plan, SEED)
            host_state = to_host(state)
            batch = device_batch(plan, host_batch(VALID, T, SEED))
            out = stepped(compile_fast(make_train_step(plan), state, batch), state, batch)
            assert out["metrics"]["tokens"] == sum(VALID)
            cache[tied] = {"host_state": host_state, **out}
        return cache[tied]

    return get


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] * (c in SLOW)) for c in CASES])
def test_one_step_equals_single_device(case, reference, need_devices):
    tied = case.endswith("tied")
    ref = reference(tied)
    n = mesh_devices(CASES[case])
    need_devices(n)
    plan = make_plan(_overrides(*CASES[case], tied=tied), jax.devices()[:n])
    p, t = plan.mesh.shape["pipeline"], plan.mesh.shape["tensor"]
    assert p > 1 and plan.cfg.pipeline.vocab_parallel
    state = jax.device_put(ref["host_state"], plan.state_shardings)
    for leaf in jax.tree.leaves(state["params"]["blocks"]):
        assert leaf.sharding.spec[0] == "pipeline" and shard_shape(leaf)[0] == L // p
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    step = compile_fast(make_train_step(plan), state, batch)
    # each stage's logits are 1/(t p) of the vocabulary: some matmul makes [.., V/(t p)], none [.., V/t]
    logits_dots = {int(n) for n in re.findall(r"f32\[[\d,]*,(\d+)\]\S* dot\(", step.as_text())}
    assert V // (t * p) in logits_dots and V // t not in logits_dots, sorted(logits_dots)
    assert_step_equals(plan, stepped(step, state, batch), ref, RTOL)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (("mesh.pipeline=2", "pipeline.schedule=zb-h1", *VP), r"runs with pipeline.schedule=1f1b .*got zb-h1"),
        (("mesh.pipeline=2", "model.vocab_size=1001", *VP), r"1001 must be divisible by .* 1 \* 2 .*1002"),
    ],
)
def test_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        make_plan(_overrides(*overrides), jax.devices()[: mesh_devices(overrides)])
