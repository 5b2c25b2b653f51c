"""Validation through `train`: every validation sequence is scored exactly once, a split whose size does not
divide by the global batch included, and `train.eval_batches` never cycles it; the metrics say how many tokens
each figure covers. Checked against a direct single-device computation of the token-mean loss.

Shape letters: N validation sequences, T sequence length, V vocabulary.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import load_config
from jaxpar.data import pack, unigram_entropy
from jaxpar.model import init_params, model_def
from jaxpar.training.loop import train

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T, G = 16, 8
VAL_TOKENS = 17 * T - 9  # 16 full sequences and a 17th with 6 valid targets: N = 17 does not divide by G
TRAIN_TOKENS = 40 * T
# A small model on the default 8-device mesh (data=2, fsdp=2, tensor=2, sequence parallel).
SMALL = [
    "model.n_layers=1",
    "model.d_model=64",
    "model.d_ff=128",
    f"data.seq_len={T}",
    "data.source=tokens",
    f"train.global_batch_size={G}",
    "train.progress_bar=false",
    "train.sample_tokens=0",
    "train.log_every=1",
    "train.eval_every=0",
    "checkpoint.every_steps=0",
    "precision.compute_dtype=float32",
    "model.init_std=1.0",
]  # large logits: per-token losses spread widely, so which tokens are scored shows


def _token_file(path) -> np.ndarray:
    """TRAIN_TOKENS + VAL_TOKENS random byte ids; data.validation_fraction below puts exactly the last
    VAL_TOKENS of them in the validation split."""
    ids = np.random.default_rng(0).integers(0, 256, TRAIN_TOKENS + VAL_TOKENS).astype(np.uint16)
    ids.tofile(path)
    return ids[TRAIN_TOKENS:]


def _direct_token_mean(cfg, params, val_tokens: np.ndarray) -> tuple[float, int]:
    """Token-mean cross-entropy (nats) over every valid target of the packed validation split, from one
    unsharded forward on one device and a float64 log-softmax in numpy; and the number of tokens."""
    packed = pack(val_tokens, T)
    host = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(params))
    logits_NTV = np.asarray(
        jax.jit(lambda p, x: model_def(cfg.model).bind(p)(x, jnp.float32))(host, jnp.asarray(packed["inputs"])),
        np.float64,
    )
    shifted = logits_NTV - logits_NTV.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    nll_NT = -np.take_along_axis(log_probs, packed["targets"][..., None], axis=-1)[..., 0]
    mask = packed["loss_mask"].astype(np.float64)
    return float((nll_NT * mask).sum() / mask.sum()), int(mask.sum())


@pytest.mark.slow  # evaluates a whole validation split (about 10 s on 2 cores)
def test_validation_scores_the_whole_split_once_and_says_how_many_tokens(tmp_path):
    path = tmp_path / "tokens.bin"
    val_tokens = _token_file(path)
    fraction = (VAL_TOKENS + 0.2) / (TRAIN_TOKENS + VAL_TOKENS)  # rounds to VAL_TOKENS tokens exactly
    # eval_batches = 5 asks for 40 sequences of a split of 17: the 17, each once (3 batches, the last padded).
    cfg = load_config(
        os.path.join(ROOT, "configs", "tiny.yaml"),
        [
            *SMALL,
            f"data.path={path}",
            f"data.validation_fraction={fraction}",
            "train.eval_batches=5",
            "train.steps=1",
            "train.eval_every=1",  # at step 0 too (eval_every=0 evaluates only at the end)
            f"train.run_dir={tmp_path / 'run'}",
        ],
    )

    result = train(cfg)

    assert len(pack(val_tokens, T)["inputs"]) == 17
    want_initial, n = _direct_token_mean(cfg, init_params(cfg.model, cfg.train.seed), val_tokens)
    want_final, _ = _direct_token_mean(cfg, result.state["params"], val_tokens)
    # The mesh computes the same fp32 forward as the single device, sharded over tensor ranks and summed in
    # another order: each logit carries a few dozen fp32 roundings (6e-8 relative each) and the cross-entropy
    # moves by at most 2 max|d logit|, so 1e-5 relative bounds the difference (measured: 3e-8). Dropping the
    # 17th sequence, as evaluation did before, moves the mean by 5e-3 relative on this data (asserted > 1e-4).
    np.testing.assert_allclose(result.initial_val_loss, want_initial, rtol=1e-5)
    np.testing.assert_allclose(result.val_loss, want_final, rtol=1e-5)
    assert n == VAL_TOKENS - 1 == result.val_tokens
    first_16, _ = _direct_token_mean(cfg, result.state["params"], val_tokens[: 16 * T + 1])
    assert abs(first_16 - want_final) > 10 * 1e-5 * want_final, (first_16, want_final)  # the data can tell

    packed = pack(val_tokens, T)
    assert result.val_unigram_entropy == unigram_entropy(packed["targets"], packed["loss_mask"])  # same tokens
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["val_loss"] == result.val_loss and rows[-1]["val_tokens"] == n
