"""The work of ring attention per device under context parallelism (`jaxpar.parallel.context.ring_attention`): which
of its sub-blocks each device computes, and the branch weights that let the compiled program's FLOPs be read per
device (`jaxpar.analysis.hlo.flops.dot_flops_per_device`).

Shape letters: B rows, T the sequence, R = T/c a device's slice of it, n = R/2 a chunk, c the context size.

In step s of the ring, device i holds device (i - s) mod c's key block; both its queries and the block's keys are
two chunks of n tokens, and each of the four (query chunk, key chunk) pairs is computed in a cond only when one
of its queries sees one of its keys (causal by position, same document): `ring_blocks` evaluates those predicates
on the host. With the load-balanced layout (`jaxpar.parallel.context.balanced_order`) and one document per row,
every device computes 2c + 1 of its 4c sub-blocks (3 in the first step, 2 in each other); with the contiguous
layout device i computes 4i + 3: device 0 3, device c - 1 4c - 1 (the rest of device 0's is its causal future).
"""

from __future__ import annotations

import re

import numpy as np

from jaxpar.analysis.hlo.flops import BranchWeights
from jaxpar.parallel.context import RING_SCOPE

_SUB_BLOCK = re.compile(rf"{RING_SCOPE}/([fb])(\d+)q(\d)k(\d)")


def ring_blocks(order: np.ndarray, c: int, segment_ids: np.ndarray | None = None) -> np.ndarray:
    """bool [c, c, 2, 2]: [i, s, a, b] whether device i computes, in ring step s, its query chunk a against key
    chunk b of the block it then holds.

    Args:
      order: int [T], the original position of each position of the layout (device i holds layout positions
        i*R .. (i+1)*R - 1), e.g. `balanced_order(T, c)` or `np.arange(T)` (contiguous).
      segment_ids: int [B, T] in original order, or None (one document per row).
    """
    t = len(order)
    n = t // (2 * c)
    seg = np.zeros((1, t), np.int64) if segment_ids is None else np.asarray(segment_ids)[:, order]
    chunks = order.reshape(2 * c, n)  # chunk k of the layout: device k // 2's half k % 2
    seg_chunks = seg.reshape(seg.shape[0], 2 * c, n)
    out = np.zeros((c, c, 2, 2), bool)
    for i in range(c):
        for s in range(c):
            j = (i - s) % c
            for a in range(2):
                for b in range(2):
                    qa, kb = 2 * i + a, 2 * j + b
                    causal = chunks[kb][None, :] <= chunks[qa][:, None]  # [n_q, n_k]
                    same = seg_chunks[:, qa, :, None] == seg_chunks[:, kb, None, :]  # [B, n_q, n_k]
                    out[i, s, a, b] = bool(np.any(causal[None] & same))
    return out


def ring_branch_weights(blocks: np.ndarray, context_of_partition: list[int]) -> BranchWeights:
    """`branch_weights` for the ring's sub-block conds (name scope `RING_SCOPE`, forward and backward): [skip,
    compute] as `blocks` says for the partition's context rank (`context_of_partition[pid]`); None for any other
    conditional."""

    def weights(pid: int, n: int, op_name: str) -> list[float] | None:
        match = _SUB_BLOCK.search(op_name)
        if match is None or n != 2:
            return None
        step, a, b = (int(x) for x in match.groups()[1:])
        run = float(blocks[context_of_partition[pid], step, a, b])
        return [1.0 - run, run]

    return weights


def computed_fraction(blocks: np.ndarray) -> np.ndarray:
    """float [c]: the share of its 4c sub-blocks each device computes."""
    c = blocks.shape[0]
    return blocks.reshape(c, -1).mean(axis=1)
