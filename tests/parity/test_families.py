"""The built-in families besides llama (`jaxpar.model.llama`: qwen2, qwen3, mistral, mixtral; `jaxpar.model.gemma`:
gemma2): one train step on
data 2 x fsdp 2 x tensor 2 (sequence parallel, ZeRO-3) and on a 1F1B pipeline 2 x fsdp 2 x tensor 2 (sequence
parallel, ZeRO-1, 2 microbatches) equals the step on one device, for each family.

What each family adds, and how its case exercises it:
  qwen2    q/k/v biases [H, K] / [G, K], split over `tensor` with their heads; tied embeddings.
  qwen3    qk-norm (scales [K], replicated) on a head width of 32, not d_model / n_heads = 16.
  mistral  a sliding window of 5 keys on T = 16, with packed documents (segment ids) in the batch, so the window
           and the document mask both cut.
  mixtral  every block a mixture of 4 experts, top-2, dropless, the experts split over `data` (expert
           parallelism) on the first layout.
  gemma2   4 layers as 2 (local, global) pairs, one pair per pipeline stage; window 5 on the local layers with
           packed documents, scores scaled by 24 ** -0.5 and soft-capped at 0.5, logits at 1 (this model's
           scores reach 0.098 and its logits 0.62 at the start: both caps bend them, by 1% and 10%), sandwich
           norms of the (1 + w) form, GeGLU, sqrt(D)-scaled tied embeddings.
The biases and the qk-norm scales start random, not at transformers' zeros and ones, so that a bias or scale on
the wrong head would change the loss.

Tolerance: fp32 whole-model parity, sums in another order (`step_helpers.FP32_RTOL` says why). Each case asserts
that its layout splits more than one mesh axis and the families' own parameters really are split or replicated as
their logical axes say.

Model: 2 layers (gemma2: 4), d_model 64, 4 heads, 2 kv heads, T = 16, G = 8 rows with uneven valid-token counts.
The references compile once per family (about 15 s each), so the cases are in the slow suite but one
(`DEFAULT_SUITE`).
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
    shard_shape,
    stepped,
    to_host,
)

from jaxpar.training.state import init_state
from jaxpar.training.step import make_train_step

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

RTOL = FP32_RTOL
SEED = 5
T = 16
VALID = (16, 16, 3, 0, 12, 16, 1, 9)
WINDOW = 5
FAMILIES = {
    "qwen2": ("model.name=qwen2", "model.tie_embeddings=true"),
    "qwen3": ("model.name=qwen3", "model.head_dim=32"),
    "mistral": ("model.name=mistral", f"model.sliding_window={WINDOW}"),
    "gemma2": (
        "model.name=gemma2",
        "model.n_layers=4",
        "model.tie_embeddings=true",
        f"model.sliding_window={WINDOW}",
        "model.attention_scale_width=24",
        "model.attention_softcap=0.5",
        "model.final_softcap=1.0",
    ),
    "mixtral": (
        "model.name=mixtral",
        "model.moe.num_experts=4",
        "model.moe.top_k=2",
        "model.moe.every=1",
        "model.moe.d_expert=64",
    ),
}
LAYOUTS = {
    "data2_fsdp2_tensor2_sp_zero3": ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "optimizer.zero_stage=3"),
    "pipeline2_1f1b_fsdp2_tensor2_sp_zero1": (
        "mesh.pipeline=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "pipeline.microbatches=2",
        "optimizer.zero_stage=1",
    ),
}
EXPERT_PARALLEL = {("mixtral", "data2_fsdp2_tensor2_sp_zero3"): ("model.moe.expert_axes=[data]",)}
# the default suite's case: gemma2 differs from llama the most (window with packed documents, capped scores,
# pairs as the stack's rows); its other layout and every other family's cases are in the slow suite
DEFAULT_SUITE = ("gemma2", "data2_fsdp2_tensor2_sp_zero3")


def _overrides(family: str, *extra: str) -> list[str]:
    return [
        *FP32,
        *FIRST_STEP_AT_PEAK,
        "optimizer.grad_clip_norm=0",
        f"data.seq_len={T}",
        f"train.global_batch_size={len(VALID)}",
        "mesh.data=1",
        "mesh.fsdp=1",
        *FAMILIES[family],
        *extra,
    ]


def _batch() -> dict:
    """`host_batch` with packed documents: each row cut into segments of 7, 4 and 5 tokens."""
    batch = host_batch(VALID, T, SEED)
    segments = np.repeat(np.arange(3, dtype=np.int32), (7, 4, 5))
    batch["segment_ids"] = np.broadcast_to(segments, (len(VALID), T)).copy()
    return batch


def _attention(tree: dict) -> dict:
    """The (first) attention of the stack's unit: blocks/attn, blocks/moe/attn or gemma2's blocks/local/attn."""
    blocks = tree["blocks"]
    return (
        blocks["moe"]["attn"] if "moe" in blocks else blocks["local"]["attn"] if "local" in blocks else blocks["attn"]
    )


def _randomised(params: dict) -> dict:
    """`params` with every q/k/v bias and qk-norm scale drawn at random (host copies, changed in place)."""
    rng = np.random.default_rng(SEED)
    attn = _attention(params)
    for key in ("bq", "bk", "bv"):
        if key in attn:
            attn[key] = 0.1 * rng.standard_normal(attn[key].shape).astype(np.float32)
    for key in ("q_norm", "k_norm"):
        if key in attn:
            attn[key]["scale"] = (1 + 0.1 * rng.standard_normal(attn[key]["scale"].shape)).astype(np.float32)
    return params


def _run(plan, host_state: dict) -> dict:
    batch = {k: jax.device_put(v, plan.batch_sharding) for k, v in _batch().items()}
    state = jax.device_put(host_state, plan.state_shardings)
    step = compile_fast(make_train_step(plan), state, batch)
    return stepped(step, state, batch)


_REFERENCES: dict = {}


def _reference(family: str) -> dict:
    if family not in _REFERENCES:
        plan = make_plan(_overrides(family), jax.devices()[:1])
        host_state = to_host(init_state(plan, SEED))
        host_state["params"] = _randomised(host_state["params"])
        _REFERENCES[family] = {"plan": plan, "host_state": host_state, **_run(plan, host_state)}
    return _REFERENCES[family]


CASES = [
    pytest.param(
        family, layout, marks=() if (family, layout) == DEFAULT_SUITE else pytest.mark.slow, id=f"{family}-{layout}"
    )
    for family in FAMILIES
    for layout in LAYOUTS
]


@pytest.mark.parametrize("family,layout", CASES)
def test_family_step_equals_one_device(family, layout):
    ref = _reference(family)
    extra = (*LAYOUTS[layout], *EXPERT_PARALLEL.get((family, layout), ()))
    plan = make_plan(_overrides(family, *extra), jax.devices())
    assert sum(size > 1 for size in plan.mesh.shape.values()) >= 3
    state = init_state(plan, SEED)
    # the family's own parameters are split as their logical axes say: biases with their heads over tensor
    attn = _attention(state["params"])
    if family == "qwen2":
        assert shard_shape(attn["bq"])[-2:] == (2, 16), "bq [L, H, K] keeps H / tensor heads per device"
    if family == "qwen3":
        assert shard_shape(attn["q_norm"]["scale"])[-1] == 32, "the qk-norm scale [K] is whole on every device"
    del state
    got = _run(plan, ref["host_state"])
    assert_step_equals(plan, got, ref, RTOL)
    # the family's own parameters moved: their gradients reached them
    ref_attn, got_attn = _attention(ref["host_state"]["params"]), _attention(got["params"])
    for key in ("bq", "bk", "bv"):
        if key in ref_attn:
            assert not np.array_equal(got_attn[key], ref_attn[key])
