"""The step's batch under context parallelism (`mesh.context` > 1), inside the shard_map: from the natural slices
the batch arrives in to the load-balanced layout attention runs on, with each token's rotary position.

Shape letters: B this device's rows, T the whole sequence, R = T/c one device's slice of it, c the context size.

The batch arrives sharded over `context` in natural order (device i holds positions i*R .. (i+1)*R - 1: what
any loader or `jax.device_put` of a [B, T] array gives, so nothing upstream knows the layout). The step all-gathers
its integer arrays over `context` once per step (4 bytes per token and array, against the K/V bytes a layer
moves), computes the rotary positions on the whole sequence (restarting at each packed document, which may begin
on another device), and keeps this device's chunks i and 2c - 1 - i (`jaxpar.parallel.context.balanced_order`).
The loss, a sum over tokens, does not care about their order, so nothing goes back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.data.batch import SEGMENT_IDS
from jaxpar.model.attention import segment_positions
from jaxpar.parallel.context import ContextParallel

POSITIONS = "positions"  # the batch key of the rotary positions, int32 [B, R] (`jaxpar.training.forward.run_blocks`)


def context_batch(batch: dict[str, jax.Array], cp: ContextParallel) -> dict[str, jax.Array]:
    """{key: [B, R] natural slice} -> {key: [B, R] load-balanced slice} plus `POSITIONS` (int32 [B, R]: each
    token's position in its document, or in the sequence without segment ids); `batch` unchanged when `cp` is
    inactive. Inside the step's shard_map."""
    if not cp.active:
        return batch
    whole = {k: cp.gather_sequence(v) for k, v in batch.items()}
    local = {k: cp.local_slice(v) for k, v in whole.items()}
    if SEGMENT_IDS in whole:
        positions_BR = cp.local_slice(segment_positions(whole[SEGMENT_IDS]))
    else:
        b, r = local["inputs"].shape
        positions_BR = jnp.broadcast_to(cp.positions(r), (b, r))
    return {**local, POSITIONS: positions_BR}
