"""Sampling text from a trained model (for the end-of-run sample; not an inference server).

Runs the full forward over a fixed window of `seq_len` tokens for every new token (no KV cache): one compiled
function, and causal attention makes the padding after the current position irrelevant. Text is encoded and
decoded with the tokenizer the run's data was made with (`run_tokenizer`). The parameters are gathered onto every
host in fp32, so a model above `MAX_SAMPLE_PARAMS` parameters is not sampled (`SamplingUnavailable`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxpar.config.data_sources import TEXT_SOURCES
from jaxpar.data.tokenizer import ByteTokenizer
from jaxpar.log import human_bytes

MAX_SAMPLE_PARAMS = 1 << 28  # 268M parameters (1.074 GB in fp32): above this the sample would gather too much per host


class SamplingUnavailable(ValueError):
    """The run cannot be sampled here: no usable tokenizer, or a model too large to gather onto one host."""


def run_tokenizer(data_cfg):
    """The tokenizer a run's data was made with, from its `DataConfig`: the built-in byte tokenizer for the
    `stdlib`, `text` and `jsonl` sources, and for `shards` the shard set's own copy of its tokenizer
    (`jaxpar.data.text_tokenizer.tokenizer_from_manifest`); for a mixture (`data.sources`, whose sources share
    one tokenizer) the first source's that records one.

    Raises:
      SamplingUnavailable: a `tokens` file (it records no tokenizer), `synthetic` ids (no text), or a shard set
        whose tokenizer cannot be rebuilt (naming why).
    """
    if data_cfg.sources:
        from jaxpar.config.data_sources import source_configs

        resolved = [sd for _, _, sd in source_configs(data_cfg)]
        data_cfg = next((sd for sd in resolved if sd.source in (*TEXT_SOURCES, "shards")), resolved[0])
    if data_cfg.source in TEXT_SOURCES:
        return ByteTokenizer()
    if data_cfg.source == "shards":
        import os

        from jaxpar.data.errors import DataError
        from jaxpar.data.text_tokenizer import tokenizer_from_manifest

        try:
            return tokenizer_from_manifest(os.path.expanduser(data_cfg.path))
        except (DataError, OSError, ImportError) as e:
            raise SamplingUnavailable(f"the tokenizer of data.path={data_cfg.path!r} cannot be rebuilt: {e}") from None
    if data_cfg.source == "synthetic":
        raise SamplingUnavailable("data.source=synthetic ids stand for no text, so a sample of them cannot be decoded")
    raise SamplingUnavailable(
        f"data.source={data_cfg.source} records no tokenizer, so sampled ids cannot be decoded; tokenize the corpus "
        f"with jaxpar-data tokenize (data.source=shards), or pass tokenizer= to sample_text / SampleHook"
    )


def sample_text(
    plan,
    params: dict,
    *,
    prompt: str,
    num_tokens: int,
    seed: int,
    temperature: float = 0.8,
    top_k: int = 40,
    tokenizer=None,
    max_params: int = MAX_SAMPLE_PARAMS,
) -> str:
    """Continues `prompt` by `num_tokens` tokens sampled with temperature and top-k; returns the text.

    Args:
      plan: the run's `StepPlan` (model structure, compute dtype, sequence length, and its config's data).
      params: parameters (any sharding, on any number of processes; gathered to every host here, fp32).
      temperature: softmax temperature (> 0).
      top_k: sample among the k most likely tokens.
      tokenizer: a `jaxpar.data.text_tokenizer.TextTokenizer` to encode the prompt and decode the sample; None:
        the run's own (`run_tokenizer(plan.cfg.data)`). The prompt follows the tokenizer's BOS when it has one.
      max_params: the largest parameter count gathered onto every host (4 bytes each).

    Raises:
      SamplingUnavailable: no usable tokenizer (`run_tokenizer`), a tokenizer with more ids than the model's
        vocabulary, a prompt of no tokens without a BOS, or more than `max_params` parameters (checked before
        anything is gathered).
    """
    tok = tokenizer if tokenizer is not None else run_tokenizer(plan.cfg.data)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    if n_params > max_params:
        raise SamplingUnavailable(
            f"the model has {n_params:,} parameters; sampling gathers them onto every host "
            f"({human_bytes(4 * n_params)} in fp32), above the limit of {max_params:,}: sample from a checkpoint on a "
            f"machine that holds it (jaxpar.restore onto one device, then sample_text with max_params raised)"
        )
    vocab = plan.cfg.model.vocab_size
    if tok.vocab_size > vocab:
        raise SamplingUnavailable(f"the tokenizer has {tok.vocab_size} ids, the model only {vocab}")
    ids = ([tok.bos_id] if tok.bos_id is not None else []) + [int(i) for i in tok.encode(prompt)]
    if not ids:
        raise SamplingUnavailable(f"the prompt {prompt!r} encodes to no token and the tokenizer has no BOS")
    start = 1 if tok.bos_id is not None else 0
    window = plan.cfg.data.seq_len
    if jax.process_count() > 1:  # shards live on other processes: all-gather them to every host
        params = multihost_utils.process_allgather(params, tiled=True)
    host = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(params))
    forward = jax.jit(lambda p, ids: plan.global_mdef.bind(p)(ids, plan.compute_dtype))
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
    return tok.decode(ids[start:])
