"""Document masking: a packed batch computes what its documents compute one by one.

Twelve documents (BOS, random byte ids, EOS; 3 to 11 tokens) are packed by `jaxpar.data.pack` with document
masking (`bos_id`) into rows of T = 16 tokens, chosen to fill each row exactly so that no document is cut by a
row boundary (a cut document loses its context by construction). The reference runs the same documents one per
row (inputs the document without its last token, targets without its first, padded with masked positions, no
segment ids). The (context, target) pairs are then the same: inside a document every target sees exactly its
own document's earlier tokens at positions counted from the document's start, and the packed target that would
predict the next document's BOS from this one's EOS is masked.

* Loss and gradients of `make_grad_fn` on the packed batch equal the one-by-one batch within 1e-5 relative
  (fp32, sums in another order: step_helpers.FP32_RTOL), on one device, with data x fsdp x tensor (sequence
  parallel), with the 1F1B pipeline (p = 2) and with zb-h1 on pipeline 2 x tensor 2 (sequence parallel).
* The check can fail: the packed batch without its segment ids (attention across documents) differs by far
  more than the tolerance.

Shape letters: G rows, T sequence length.
"""

import jax
import numpy as np
import pytest
from step_helpers import FP32, FP32_RTOL, assert_scalar_close, assert_tree_close, compile_fast, make_plan, to_host

from jaxpar.data.packing import pack
from jaxpar.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from jaxpar.training.state import init_state
from jaxpar.training.step import make_grad_fn

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

T = 16
# Document lengths (with BOS and EOS), each row's summing to T: 4 packed rows, 12 documents.
ROWS = ((5, 11), (9, 3, 4), (16,), (4, 4, 3, 5))
RTOL = FP32_RTOL


def _documents(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        np.concatenate([[BOS_ID], rng.integers(0, 256, n - 2), [EOS_ID]]).astype(np.int32) for row in ROWS for n in row
    ]


def _packed(docs) -> dict:
    out = pack(np.concatenate(docs), T, bos_id=BOS_ID)
    assert out["inputs"].shape == (len(ROWS), T)
    return out


def _one_by_one(docs) -> dict:
    g = len(docs)
    out = {
        "inputs": np.full((g, T), PAD_ID, np.int32),
        "targets": np.full((g, T), PAD_ID, np.int32),
        "loss_mask": np.zeros((g, T), np.float32),
    }
    for r, d in enumerate(docs):
        out["inputs"][r, : len(d) - 1] = d[:-1]
        out["targets"][r, : len(d) - 1] = d[1:]
        out["loss_mask"][r, : len(d) - 1] = 1.0
    return out


def test_pack_numbers_documents_and_masks_their_boundaries():
    docs = _documents()
    packed = _packed(docs)
    np.testing.assert_array_equal(packed["segment_ids"][1], [1] * 9 + [2] * 3 + [3] * 4)
    # row 0: documents of 5 and 11 tokens; the EOS of the first predicts the second's BOS: masked
    assert packed["loss_mask"][0, 4] == 0 and packed["targets"][0, 4] == BOS_ID
    assert packed["loss_mask"].sum() == _one_by_one(docs)["loss_mask"].sum() == sum(len(d) - 1 for d in docs)
    # without document masking: no segment ids and every real target scored
    plain = pack(np.concatenate(docs), T)
    assert "segment_ids" not in plain and plain["loss_mask"].sum() == sum(map(len, docs)) - 1
    # a document cut by a row boundary continues as a new segment; padding is segment 0
    cut = pack(np.concatenate(docs[:2]), 6, bos_id=BOS_ID)  # 5 + 11 tokens in rows of 6: padded at the end
    np.testing.assert_array_equal(cut["segment_ids"], [[1, 1, 1, 1, 1, 2], [1] * 6, [1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(cut["loss_mask"][2], [1, 1, 1, 0, 0, 0])


MESHES = {
    "one_device": ((), 1),
    "data2_fsdp2_tensor2_sp": (("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"), 8),
    "pipeline2_1f1b_fsdp2": (("mesh.pipeline=2", "mesh.fsdp=2", "pipeline.microbatches=2"), 4),
    "pipeline2_zbh1_tensor2_sp": (
        ("mesh.pipeline=2", "mesh.tensor=2", "pipeline.schedule=zb-h1", "pipeline.microbatches=2"),
        4,
    ),
}


def _grads(batch: dict, overrides, devices, params_host=None):
    g = batch["inputs"].shape[0]
    plan = make_plan(
        [*FP32, "model.n_layers=2", f"data.seq_len={T}", f"train.global_batch_size={g}", "mesh.data=1", "mesh.fsdp=1"]
        + list(overrides),
        jax.devices()[:devices],
    )
    if params_host is None:
        params_host = to_host(init_state(plan, 7)["params"])
    params = jax.device_put(params_host, plan.state_shardings["params"])
    on_mesh = {k: jax.device_put(v, plan.batch_sharding) for k, v in batch.items()}
    grads, loss, n_tokens = compile_fast(jax.jit(make_grad_fn(plan)), params, on_mesh)(params, on_mesh)
    return plan, params_host, to_host(grads), float(loss), float(n_tokens)


@pytest.fixture(scope="module")
def reference() -> dict:
    docs = _documents()
    _, params, grads, loss, n_tokens = _grads(_one_by_one(docs), (), 1)
    return {"docs": docs, "params": params, "grads": grads, "loss": loss, "tokens": n_tokens}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", MESHES)
def test_packed_batch_equals_documents_one_by_one(reference, name, need_devices):
    overrides, devices = MESHES[name]
    need_devices(devices)
    packed = _packed(reference["docs"])
    assert packed["inputs"].shape[0] < len(reference["docs"])  # the layouts differ: 4 packed rows, 12 documents
    plan, _, grads, loss, n_tokens = _grads(packed, overrides, devices, reference["params"])
    assert plan.mesh.size == devices
    assert n_tokens == reference["tokens"]
    assert_scalar_close(loss, reference["loss"], RTOL, "loss")
    assert_tree_close(grads, reference["grads"], RTOL)


def _far(grads, loss, reference) -> bool:
    w, w_ref = grads["blocks"]["attn"]["wq"], reference["grads"]["blocks"]["attn"]["wq"]
    return abs(loss - reference["loss"]) > 100 * RTOL * abs(reference["loss"]) or np.max(
        np.abs(w - w_ref)
    ) > 100 * RTOL * np.max(np.abs(w_ref))


@pytest.mark.timeout(240)
def test_the_check_can_fail(reference):
    """Attention across documents (the packed batch without its segment ids) is far off. (Rotary positions that
    do not restart would not be: RoPE scores depend on position differences only, which the mask keeps within
    a document; restarting matters for absolute position embeddings and position ranges, and
    tests/unit/test_attention.py checks the positions themselves.)"""
    packed = _packed(reference["docs"])
    crossing = {k: v for k, v in packed.items() if k != "segment_ids"}
    _, _, grads, loss, _ = _grads(crossing, (), 1, reference["params"])
    assert _far(grads, loss, reference)
