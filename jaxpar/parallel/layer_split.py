"""Layers per pipeline stage: the split of the layer stack over the model chunks (one per stage, or v per device
with virtual stages), the whole-layer split that balances the stages' FLOPs, and an uneven split's stage layout.

Shape letters: L rows of the layer stack (layers, or groups of `model.moe.every` blocks), p stages, v model
chunks per device, n_max the most rows any chunk has.

Why uneven: the first stage also runs the embedding and the last the head and loss. In a lockstep pipeline every
tick lasts as long as the busiest stage's, so a head worth 2.4 layers (Llama-3-8B: vocabulary 128,256, 32
layers) makes an even split of 8 layers per stage run at 10.4/8.6 = 1.21x the balanced pace; (8, 9, 9, 6) runs at
1.05x (`balanced_split`). Megatron-LM sets the first and last stages' layer counts for the same reason
(`decoder_first_pipeline_num_layers`, `decoder_last_pipeline_num_layers`).

How it runs in one SPMD program: the parameters stay stored in model order, L_s/p rows per device, whatever the split
(checkpoints do not depend on it). L_s = `stored_rows(L, p)` is L rounded up to a multiple of p: a stack that p does not
divide (DeepSeek-V3's 58 MoE blocks over 16 stages) is stored with L_s - L zero rows after the last layer, which no
schedule runs (jax shards an array only evenly). Zero rows are the identity of a pre-norm residual block (every
sublayer's output projection is zero) and get zero gradients, so they stay zero. Once per step `to_stage_layout` moves
each layer to the device that runs it, into the *stage layout*: v slots of n_max rows per device, slot j holding its
chunk's rows first and padding after, with an fp32 mask (1 a real row, 0 padding) that the layer scan reads to skip
padding in a `lax.cond` (`jaxpar.model.stack.active_rows`); `from_stage_layout` moves the weight gradients back. The
schedules see a stack of v*n_max rows and need no change. An even split never takes this path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config.mesh_axes import PIPELINE
from jaxpar.parallel import zero_bubble
from jaxpar.parallel.pipeline import ordered_after

ACTIVE = "active_rows"  # the stage layout's mask leaf, beside the layer parameters in the stack's tree


def stored_rows(rows: int, p: int) -> int:
    """Rows of a layer stack of `rows` layers stored over p pipeline stages (module docstring): rows rounded up to a
    multiple of p (p = 1: rows)."""
    return -(-rows // p) * p


def stage_flops(
    counts: tuple[int, ...], layer_flops: float, head_flops: float, embed_flops: float = 0.0
) -> list[float]:
    """Training FLOPs per token of each pipeline stage (or model chunk) when chunk c runs `counts[c]` layers of
    `layer_flops` each; the first adds the embedding's `embed_flops`, the last the head's `head_flops` (FLOPs per
    token, forward + backward, e.g. PaLM's 6P/L + 12*D*T per layer and 6*D*V for the head; Chowdhery et al.
    2022, appendix B).

    Raises:
      ValueError: an empty `counts`.
    """
    if not counts:
        raise ValueError("counts needs one entry per stage")
    loads = [c * layer_flops for c in counts]
    loads[0] += embed_flops
    loads[-1] += head_flops
    return loads


def balanced_split(
    n_layers: int, p: int, layer_flops: float, head_flops: float, embed_flops: float = 0.0
) -> tuple[int, ...]:
    """Whole layers per stage (or model chunk), each at least one and all `n_layers` in model order, that
    minimise the busiest one's FLOPs (`stage_flops`): the last gives up layers to pay for the head. The smallest
    bound B (a candidate busiest load, c * layer_flops + a stage's extra) at which every stage fits
    floor((B - extra) / layer_flops) >= 1 layers adding up to at least n_layers; the surplus then comes off the
    stages furthest above n_layers / p. Unless the head costs a whole number of layers, a whole-layer split
    leaves the busiest stage above the mean (llama3_8b at p = 4, the head 2.4 layers: (8, 9, 9, 6), the busiest
    1.046x the mean).

    Raises:
      ValueError: p < 1 or n_layers < p (a stage without layers).
    """
    if p < 1 or n_layers < p:
        raise ValueError(f"need 1 <= p <= n_layers, got p={p} n_layers={n_layers}")
    if p == 1:
        return (n_layers,)
    extra = [embed_flops] + [0.0] * (p - 2) + [head_flops]
    # The busiest stage's load is c * layer + extra for some stage and count: try each as the bound.
    bounds = sorted({c * layer_flops + e for c in range(1, n_layers + 1) for e in set(extra)})
    for bound in bounds:
        caps = [int((bound - e) // layer_flops) if layer_flops > 0 else n_layers for e in extra]
        if any(c < 1 for c in caps) or sum(caps) < n_layers:
            continue
        # Fill to n_layers, taking from the most even stages first: start from the caps and remove the surplus
        # from the stages furthest above n_layers / p.
        counts = list(caps)
        surplus = sum(counts) - n_layers
        while surplus > 0:
            s = max(range(p), key=lambda k: (counts[k] - n_layers / p if counts[k] > 1 else -math.inf, -k))
            counts[s] -= 1
            surplus -= 1
        return tuple(counts)
    raise AssertionError("the largest bound admits every split")


def chunk_counts(cfg, p: int, row_flops: Callable[[], float]) -> tuple[int, ...] | None:
    """Stack rows of each model chunk (model order, p*v entries) under `cfg`'s split on p stages:
    `pipeline.stage_layers` (given in layers: divided by `model.layers_per_unit`, e.g. `model.moe.every`), or
    with `pipeline.balance_stages` the `balanced_split` of the chunks' training FLOPs per token, a row costing
    `row_flops()` (called only then; `jaxpar.model.flops.row_flops_per_token`: 6P/L + 12*D*T plus what remat
    recomputes) and the head 6*D*V on the last chunk (PaLM, Chowdhery et al. 2022, appendix B), or on none with
    `pipeline.vocab_parallel` (which spreads it over the stages alike); the first chunk adds the
    `model.moe.first_dense` blocks that run with the embedding, each costed as 1/`model.layers_per_unit` row.
    None for the even split, also when the counts are the even ones. `cfg` is a validated
    `jaxpar.config.Config`."""
    pipe, model = cfg.pipeline, cfg.model
    if p == 1 or not (pipe.stage_layers or pipe.balance_stages):
        return None
    every = model.layers_per_unit  # blocks per stack row
    if pipe.stage_layers:
        counts = tuple(c // every for c in pipe.stage_layers)
    else:
        # the head on the last chunk; split over every stage alike (pipeline.vocab_parallel) it moves no balance
        head = 0.0 if pipe.vocab_parallel else 6 * model.d_model * model.vocab_size
        row = row_flops()
        embed = row * model.first_dense / every
        counts = balanced_split(model.stack_depth, p * pipe.virtual_stages, row, head, embed)
    return None if len(set(counts)) == 1 else counts


def stage_layout(cfg, p: int, row_flops: Callable[[], float]) -> StageLayout | None:
    """The `StageLayout` of `cfg`'s split on p stages (`chunk_counts`, chunks placed by `placement`), None for
    the even split."""
    counts = chunk_counts(cfg, p, row_flops)
    if counts is None:
        return None
    return StageLayout(counts, p, placement(cfg.pipeline.schedule, p, cfg.pipeline.virtual_stages))


def placement(schedule: str, p: int, v: int) -> tuple[int, ...]:
    """The device of each model chunk: the V of zb-v (`jaxpar.parallel.zero_bubble.v_shape`: chunk c on device
    c for c < p, on 2p - 1 - c after), else the interleaved ring (c mod p)."""
    return zero_bubble.v_shape(p) if schedule == "zb-v" else tuple(c % p for c in range(p * v))


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Where an uneven split's layers run (module docstring).

    Attributes:
      counts: stack rows of each model chunk, in model order (p*v entries, summing to L; 0 allowed).
      p: stages (devices on `pipeline`).
      placement: the device of each model chunk (`jaxpar.parallel.pipeline.chunk_routes`): c mod p on the
        interleaved ring, the V of zb-v (`jaxpar.parallel.zero_bubble.v_shape`). A device's chunks take its
        slots in model order.

    Raises:
      ValueError: counts not a multiple of p long, a negative count, or a placement that does not give every
        device v chunks.
    """

    counts: tuple[int, ...]
    p: int
    placement: tuple[int, ...]

    def __post_init__(self):
        if len(self.counts) % self.p or any(c < 0 for c in self.counts):
            raise ValueError(f"need p*v counts of at least 0 for p={self.p}, got {self.counts}")
        if sorted(self.placement) != sorted(d for d in range(self.p) for _ in range(self.v)):
            raise ValueError(f"placement {self.placement} must put v={self.v} chunks on each of p={self.p} devices")

    @property
    def v(self) -> int:
        return len(self.counts) // self.p

    @property
    def rows(self) -> int:
        """L, the stack's rows."""
        return sum(self.counts)

    @property
    def stored(self) -> int:
        """L_s, the rows the stack is stored with (`stored_rows`: L rounded up to a multiple of p)."""
        return stored_rows(self.rows, self.p)

    @property
    def n_max(self) -> int:
        """Rows of each slot of the stage layout: the most any chunk has."""
        return max(self.counts)

    @functools.cached_property
    def _compute_rows(self) -> np.ndarray:
        """[p, v*n_max]: the model row each stage-layout row holds, -1 for padding."""
        table = np.full((self.p, self.v * self.n_max), -1, np.int64)
        starts = np.concatenate([[0], np.cumsum(self.counts)])
        for d in range(self.p):
            chunks = [c for c in range(self.p * self.v) if self.placement[c] == d]
            for j, c in enumerate(chunks):
                table[d, j * self.n_max : j * self.n_max + self.counts[c]] = np.arange(starts[c], starts[c + 1])
        return table

    def mask(self) -> np.ndarray:
        """fp32 [p, v*n_max]: 1 where a stage-layout row holds a layer, 0 for padding."""
        return (self._compute_rows >= 0).astype(np.float32)

    def device_rows(self) -> list[int]:
        """Real rows each device runs per microbatch (all its chunks): the busiest sets the tick."""
        return [int(r) for r in (self._compute_rows >= 0).sum(axis=1)]

    @functools.cached_property
    def moves(self) -> tuple[np.ndarray, np.ndarray, list[list[tuple[int, int, int, int]]]]:
        """(local [p, v*n_max]: the storage row each stage-layout row copies on its own device, -1 where it comes from
        another device or is padding; local_back [p, L_s/p]: the stage-layout row each storage row's gradient comes
        from on its own device, -1 where from another or a storage padding row; rounds: the moves between devices,
        (source device, storage row, destination device, stage-layout row), grouped so that a device sends at most
        one row and receives at most one per round: one `ppermute` each)."""
        per = self.stored // self.p
        local = np.full((self.p, self.v * self.n_max), -1, np.int64)
        local_back = np.full((self.p, per), -1, np.int64)
        rounds: list[list[tuple[int, int, int, int]]] = []
        for d in range(self.p):
            for q, r in enumerate(self._compute_rows[d]):
                if r < 0:
                    continue
                src, row = divmod(int(r), per)
                if src == d:
                    local[d, q], local_back[d, row] = row, q
                    continue
                # first-fit: the first round in which neither end is busy
                for moves in rounds:
                    if all(m[0] != src and m[2] != d for m in moves):
                        moves.append((src, row, d, q))
                        break
                else:
                    rounds.append([(src, row, d, q)])
        return local, local_back, rounds


def _index_table(values: np.ndarray, pad: int) -> jax.Array:
    """An int32 table with -1 entries replaced by `pad` (a scratch row)."""
    return jnp.asarray(np.where(values < 0, pad, values), jnp.int32)


def to_stage_layout(layers, layout: StageLayout):
    """This device's layer stack in storage order (leaves [L_s/p, ...]: model rows s*L_s/p .. (s+1)*L_s/p - 1) -> in
    the stage layout (leaves [v*n_max, ...], padding rows zero), with the mask under `ACTIVE` (fp32 [v*n_max]).
    Inside the shard_map.

    Cost: the rows that change device cross the pipeline axis once, one `ppermute` per round of
    `StageLayout.moves` per leaf (one row each), run one after the other (`ordered_after`: a fixed collective
    order); the rest are local copies."""
    mask = jnp.asarray(layout.mask())[jax.lax.axis_index(PIPELINE)]
    moved = _move(layers, layout, inverse=False)
    return {**jax.tree.map(lambda a: a * mask.reshape(-1, *([1] * (a.ndim - 1))).astype(a.dtype), moved), ACTIVE: mask}


def from_stage_layout(grads, layout: StageLayout):
    """The inverse of `to_stage_layout` for the weight gradients: leaves [v*n_max, ...] (without `ACTIVE`; the
    padding rows' values are dropped) -> [L_s/p, ...] in storage order, zeros at the storage padding rows. Inside
    the shard_map."""
    return _move(grads, layout, inverse=True)


def _move(tree, layout: StageLayout, inverse: bool):
    """Each leaf's rows moved storage -> stage layout (or back, `inverse`): local copies by a gather (a row that
    comes from nowhere, zeros), then each round of `StageLayout.moves` as one `ppermute` of one row, written into
    place (a device that receives nothing in a round writes a scratch row, dropped at the end)."""
    s = jax.lax.axis_index(PIPELINE)
    local, local_back, rounds = layout.moves
    source = local_back if inverse else local
    width = source.shape[1]
    steps = []  # per round: (row each device sends, row each device writes, pairs)
    for moves in rounds:
        send, recv = np.zeros(layout.p, np.int64), np.full(layout.p, width, np.int64)
        for src, row, dst, q in moves:
            sender, receiver, sent, written = (dst, src, q, row) if inverse else (src, dst, row, q)
            send[sender], recv[receiver] = sent, written
        pairs = [(dst, src) if inverse else (src, dst) for src, _, dst, _ in moves]
        steps.append((jnp.asarray(send, jnp.int32)[s], jnp.asarray(recv, jnp.int32)[s], pairs))
    prev: list[jax.Array] = []

    def one(a):
        nonlocal prev
        zero = jnp.zeros((1, *a.shape[1:]), a.dtype)
        out = jnp.take(jnp.concatenate([a, zero]), _index_table(source, a.shape[0])[s], axis=0)
        out = jnp.concatenate([out, zero])  # row `width`: scratch
        for send, recv, pairs in steps:
            piece = jax.lax.dynamic_index_in_dim(a, send, keepdims=True)
            piece = ordered_after(piece, prev) if prev else piece
            moved = jax.lax.ppermute(piece, PIPELINE, pairs)
            prev = [moved]
            out = jax.lax.dynamic_update_slice_in_dim(out, moved, recv, axis=0)
        return out[:width]

    return jax.tree.map(one, tree)


def rows_in_model_order(rows: jax.Array, layout: StageLayout) -> jax.Array:
    """Per-row results of one device's stage layout, [v, n_max, ...] (e.g. a mixture-of-experts unit's expert
    load), placed at their model rows in a zero array [L, ...]: the sum over `pipeline` (psum) of the devices'
    results is every row in model order; padding rows are dropped. Inside the shard_map."""
    s = jax.lax.axis_index(PIPELINE)
    target = _index_table(layout._compute_rows, layout.rows)[s]
    flat = rows.reshape(layout.v * layout.n_max, *rows.shape[2:])
    out = jnp.zeros((layout.rows + 1, *rows.shape[2:]), rows.dtype)
    return out.at[target].add(flat)[: layout.rows]
