"""Context parallelism (`mesh.context`, `jaxpar.parallel.context`): one train step with each sequence split over
devices equals the single-device step, on both attention strategies and with every other axis.

Model: tiny (2 layers, d_model 64, 4 heads, 2 kv heads), fp32, T = 16 tokens, G = 8 rows with uneven valid-token
counts, compared as every parity test is (step_helpers.FP32_RTOL: loss, grad norm, Adam's moments and the
update). The batch packs documents (segment ids), laid out to cover what a split sequence can get wrong:
  * row 0: 3 documents (an odd number) of 3, 11 and 2 tokens: the 11-token one is longer than a whole chunk
    (T/(2c) = 4 tokens at c = 2, 2 at c = 4) and crosses chunk boundaries, so its rotary positions restart on one
    device and continue on others, and its keys reach a device's queries from both of its chunks;
  * row 1: one document (no masking within the row);
  * the other rows: random boundaries, documents of 1 to 16 tokens.

Cases (the context size, the strategy, the other axes):
  * all_gather, c = 2, tensor 2 (sequence parallel) x fsdp 2 under ZeRO-3 (8 devices);
  * ring, c = 4, data 2;
  * ring, c = 2, the 1F1B pipeline p = 2 x tensor 2;
  * all_gather, c = 2, MoE (dropless, 4 experts top-2, one MoE block of 2) with expert parallelism over data 2:
    the load-balancing loss is per sequence, its router statistics summed over context;
  * under -m slow: all_gather c = 4 with 2 accumulation steps; zb-v (all_gather) p = 2; gpipe (ring) p = 2;
    interleaved 1F1B (ring) p = 2, v = 2.

Each case asserts that its layout differs from the reference's: the batch's sequence is split over `context`
(each device holds T/c tokens of a row) and the step lays them out load-balanced (chunks i and 2c - 1 - i).
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
    host_batch,
    make_plan,
    mesh_devices,
    shard_shape,
    stepped,
    to_host,
)

from jaxpar.parallel.context import balanced_order
from jaxpar.training.state import init_state
from jaxpar.training.step import make_train_step

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

RTOL = FP32_RTOL
SEED = 3
T = 16
VALID = (16, 16, 3, 0, 12, 16, 1, 9)
G = len(VALID)
MOE = (
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.d_expert=64",
    "model.moe.every=2",
    "model.moe.routing=dropless",
)
CASES = {
    "all_gather_c2_tensor2_sp_fsdp2_zero3": (
        "mesh.context=2",
        "mesh.tensor=2",
        "mesh.fsdp=2",
        "tensor.sequence_parallel=true",
        "optimizer.zero_stage=3",
    ),
    "ring_c4_data2": ("mesh.context=4", "mesh.data=2", "context.strategy=ring"),
    "ring_c2_1f1b_p2_tensor2": (
        "mesh.context=2",
        "mesh.pipeline=2",
        "mesh.tensor=2",
        "pipeline.microbatches=4",
        "context.strategy=ring",
    ),
    "all_gather_c2_moe_experts_data2": ("mesh.context=2", "mesh.data=2", "model.moe.expert_axes=[data]"),
    "all_gather_c4_accumulation": ("mesh.context=4", "train.grad_accum_steps=2"),
    "all_gather_c2_zbv_p2": (
        "mesh.context=2",
        "mesh.pipeline=2",
        "pipeline.schedule=zb-v",
        "pipeline.virtual_stages=2",
        "pipeline.microbatches=4",
        "model.n_layers=4",
    ),
    "ring_c2_gpipe_p2": ("mesh.context=2", "mesh.pipeline=2", "pipeline.schedule=gpipe", "pipeline.microbatches=4"),
    "ring_c2_interleaved_p2_v2": (
        "mesh.context=2",
        "mesh.pipeline=2",
        "pipeline.virtual_stages=2",
        "pipeline.microbatches=4",
        "model.n_layers=4",
        "context.strategy=ring",
    ),
}
SLOW = {"all_gather_c4_accumulation", "all_gather_c2_zbv_p2", "ring_c2_gpipe_p2", "ring_c2_interleaved_p2_v2"}


def _segments() -> np.ndarray:
    rng = np.random.default_rng(SEED)
    ids = np.cumsum(rng.random((G, T)) < 0.25, axis=1).astype(np.int32)
    ids[0] = [0] * 3 + [1] * 11 + [2] * 2
    ids[1] = 0
    return ids


def _batch() -> dict:
    return {**host_batch(VALID, T, SEED), "segment_ids": _segments()}


def _overrides(*extra: str) -> list[str]:
    return [
        *FP32,
        *FIRST_STEP_AT_PEAK,
        "optimizer.grad_clip_norm=0",
        f"data.seq_len={T}",
        f"train.global_batch_size={G}",
        "mesh.data=1",
        "mesh.fsdp=1",
        *extra,
    ]


def _model(case: str) -> tuple[str, ...]:
    """The model overrides of a case: MoE for the MoE case (its own reference), else the dense tiny model (with the
    layers a case sets)."""
    return MOE if "moe" in case else tuple(o for o in CASES[case] if o.startswith("model.n_layers"))


def _device_batch(plan) -> dict:
    return {k: jax.device_put(v, plan.batch_sharding) for k, v in _batch().items()}


_REFERENCES: dict = {}


@pytest.fixture(scope="module")
def reference():
    """The single-device step of a model (`_model`), computed once per model."""

    def get(model: tuple[str, ...]) -> dict:
        if model not in _REFERENCES:
            plan = make_plan(_overrides(*model), jax.devices()[:1])
            state = init_state(plan, SEED)
            host_state = to_host(state)
            batch = _device_batch(plan)
            out = stepped(compile_fast(make_train_step(plan), state, batch), state, batch)
            assert out["metrics"]["tokens"] == sum(VALID)
            _REFERENCES[model] = {"host_state": host_state, **out}
        return _REFERENCES[model]

    return get


def test_the_batch_covers_the_document_cases():
    ids = _segments()[0]
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    lengths = np.diff(np.r_[starts, T])
    assert len(starts) % 2 == 1, "an odd number of documents in row 0"
    assert lengths.max() > T // 4, "a document longer than a whole chunk at c = 2"
    chunk = T // 4
    assert any(s // chunk != (s + n - 1) // chunk for s, n in zip(starts, lengths)), "a document crossing chunks"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] * (c in SLOW)) for c in CASES])
def test_one_step_equals_single_device(case, reference, need_devices):
    ref = reference(_model(case))
    overrides = tuple(o for o in CASES[case] if not o.startswith("model.n_layers"))
    n = mesh_devices(overrides)
    need_devices(n)
    plan = make_plan(_overrides(*_model(case), *overrides), jax.devices()[:n])
    c = plan.context.size
    assert c > 1 and plan.mesh_shape["context"] == c
    batch = _device_batch(plan)
    # the layout differs: each device holds T/c tokens of a row, and the step takes chunks i and 2c - 1 - i
    assert shard_shape(batch["inputs"])[1] == T // c
    assert not np.array_equal(balanced_order(T, c), np.arange(T))
    state = jax.device_put(ref["host_state"], plan.state_shardings)
    got = stepped(compile_fast(make_train_step(plan), state, batch), state, batch)
    assert_step_equals(plan, got, ref, RTOL)
