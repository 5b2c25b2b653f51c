"""The batch a train or eval step takes, and its abstract form for compiling a step ahead of time.

    {"inputs": int32 [B, T], "targets": int32 [B, T], "loss_mask": float32 [B, T]}

B the rows of a global batch (`train.global_batch_size`: sequences over all devices), T sequence length (the
`jaxpar` glossary's letters). `targets` are the next tokens of `inputs`;
`loss_mask` is 1 where a target is scored and 0 for padding (`jaxpar.data.pack`). A batch of packed documents
may also carry "segment_ids": int32 [B, T], numbering the documents of each row; the train step then keeps
attention within each document (`jaxpar.model.attention`). Each array is sharded by rows
over the data-parallel axes (`jaxpar.training.plan.StepPlan.batch_sharding`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BATCH_KEYS = ("inputs", "targets", "loss_mask")
SEGMENT_IDS = "segment_ids"  # the optional key of packed documents
BATCH_DTYPES = {
    "inputs": np.dtype(np.int32),
    "targets": np.dtype(np.int32),
    "loss_mask": np.dtype(np.float32),
    SEGMENT_IDS: np.dtype(np.int32),
}


def random_batch(
    global_batch_size: int,
    seq_len: int,
    vocab_size: int,
    sharding: jax.sharding.Sharding,
    seed: int = 0,
    masked_prefix: int = 0,
) -> dict[str, jax.Array]:
    """Uniform random tokens in [0, vocab_size) for `inputs` and `targets`, placed with `sharding`; the first
    `masked_prefix` positions of every row have loss_mask 0, the rest 1 (for timing and benchmarking a step)."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    shape = (global_batch_size, seq_len)
    batch = {
        "inputs": jax.random.randint(k1, shape, 0, vocab_size, BATCH_DTYPES["inputs"]),
        "targets": jax.random.randint(k2, shape, 0, vocab_size, BATCH_DTYPES["targets"]),
        "loss_mask": jnp.ones(shape, BATCH_DTYPES["loss_mask"]).at[:, :masked_prefix].set(0.0),
    }
    return jax.device_put(batch, sharding)


def abstract_batch(
    global_batch_size: int, seq_len: int, sharding: jax.sharding.Sharding | None = None
) -> dict[str, jax.ShapeDtypeStruct]:
    """`jax.ShapeDtypeStruct`s of one global batch, [global_batch_size, seq_len] each, carrying `sharding` (what
    `jit(...).lower` needs to compile a step without data)."""
    return {
        k: jax.ShapeDtypeStruct((global_batch_size, seq_len), BATCH_DTYPES[k], sharding=sharding) for k in BATCH_KEYS
    }
