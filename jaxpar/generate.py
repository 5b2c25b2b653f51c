"""Sampling text from a trained model (for the end-of-run sample; not an inference server).

Runs the full forward over a fixed window of `seq_len` tokens for every new token (no KV cache): one compiled
function, and causal attention makes the padding after the current position irrelevant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxpar.data.tokenizer import BOS_ID, ByteTokenizer


def sample_text(
    plan, params: dict, *, prompt: str, num_tokens: int, seed: int, temperature: float = 0.8, top_k: int = 40
) -> str:
    """Continues `prompt` by `num_tokens` byte tokens sampled with temperature and top-k; returns the text.

    Args:
      plan: the run's `StepPlan` (model structure, compute dtype, sequence length).
      params: parameters (any sharding, on any number of processes; gathered to every host here).
      temperature: softmax temperature (> 0).
      top_k: sample among the k most likely tokens.
    """
    tok = ByteTokenizer()
    window = plan.cfg.data.seq_len
    if jax.process_count() > 1:  # shards live on other processes: all-gather them to every host
        params = multihost_utils.process_allgather(params, tiled=True)
    host = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(params))
    forward = jax.jit(lambda p, ids: plan.mdef.bind(p)(ids, plan.compute_dtype))
    ids = [BOS_ID] + [int(i) for i in tok.encode(prompt)]
    key = jax.random.key(seed)
    for _ in range(num_tokens):
        context = ids[-window:]
        buf = np.zeros((1, window), np.int32)
        buf[0, : len(context)] = context
        logits = forward(host, jnp.asarray(buf))[0, len(context) - 1].astype(jnp.float32)
        logits = logits.at[tok.vocab_size :].set(-jnp.inf)  # rows past the tokenizer's vocabulary are unused
        top_vals, top_idx = jax.lax.top_k(logits / temperature, top_k)
        key, sub = jax.random.split(key)
        ids.append(int(top_idx[jax.random.categorical(sub, top_vals)]))
    return tok.decode(ids[1:])
