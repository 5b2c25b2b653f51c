"""Context parallelism in the plan (`mesh.context` c > 1, `jaxpar.parallel.context`): the collectives over the
`context` mesh axis that `jaxpar.analysis.planner.comm` counts. Letters as in `jaxpar.analysis.planner.plan`; r = s/c
tokens of each sequence on one device, G/t key/value heads on one device, Bc the compute dtype's bytes as a
collective moves them (`jaxpar.analysis.planner.dims.collective_bytes`), kv = b*r*(G/t)*K the elements of one
device's keys (or values) of one layer and microbatch. Passes and layers per pass as
`jaxpar.analysis.planner.comm` counts them (per 1F1B tick with a pipeline). Ring bytes per op:
`jaxpar.analysis.hlo.ring.ring_bytes`.

all_gather (`context.strategy`; Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2): per layer and
  forward pass, all-gathers of K and V over `context` (gathered size S = c*kv*Bc each, (c-1)/c of it sent); per
  layer and backward pass the same two again (no remat policy of `jaxpar.model.stack` saves the gathered K/V: the
  all-gather's output carries no checkpoint name and is no matmul, so every policy, none included, re-gathers them
  in the backward) and the reduce-scatters of dK and dV (the all-gather's transpose; input S = c*kv*Bc each: XLA
  gives them the compute dtype, bf16 under bf16 compute).
ring (Liu et al. 2023, "Ring Attention with Blockwise Transformers", arXiv 2310.01889): per layer and forward
  pass, c - 1 collective-permutes each of the K and V blocks (S = kv*Bc); per layer and backward pass the second
  ring pass's c - 1 of each again and c of each of the fp32 dK and dV sums (S = 4*kv; the c-th brings the sums
  home). Remat none saves the ring's residuals (q, k, v, output and log-sum-exp); the other policies rebuild the
  forward in the backward, whose c - 1 permutes of each block are the second ring pass's too (the same blocks
  permuted the same way: XLA merges them, `jax.checkpoint(..., prevent_cse=False)` in `jaxpar.model.stack`), so
  the count is the same under every policy.
Positions and segment ids (int32 [b, r], 4 bytes per token): the key positions are all-gathered with K/V
  (all_gather; no segment ids in the planned batch, whose keys are `jaxpar.data.batch.BATCH_KEYS`) or permuted
  with each block (ring: positions and the all-zero segment ids, c - 1 each per ring pass). They derive from the
  device's index alone, so jax's scan moves the forward's out of the layer loop (once per forward pass) and XLA:CPU's
  loop-invariant code motion moves them out of every loop and merges the backward's with the forward's: once per
  step in the CPU executable (the plan for cpu; under a zero-bubble schedule, whose F and B ops sit in the slot
  switch, which they cannot leave, once per F and once per B op, a rebuilt forward's merged with its B's), once
  per forward pass plus once per layer and backward pass in the partitioned program (the plan for gpu and tpu;
  exact without a pipeline; in a pipeline's partitioned program, which the tests do not compare, XLA has not yet
  merged the recomputed forwards' and GPipe's: a few int32 ops per tick either way; the GPU compiler then merges
  them into the K/V all-gathers as [r] vectors).
Mixture of experts (`jaxpar.model.moe`): per MoE block and forward pass 2 all-reduces of fp32 [b, E] router
  statistics over `context` (the token counts and the mean router probabilities, summed over the whole sequence),
  per backward pass 2 (the probabilities' sum again, which no remat policy keeps, and its cotangent's); S = 4*b*E.
The batch (`jaxpar.training.context_batch`): once per step every batch array, int32 or fp32 [B', r] with B' = b*M*m
  the device's rows of the step, all-gathered over `context` (S = B'*s*4 each).
Gradients (`jaxpar.training.grad_reduction.reduce_replicated`): parameters are replicated over `context` and each
  rank saw its own slice of every sequence, so every gradient (as stored over fsdp, and data under ZeRO-3) is
  all-reduced over `context` once per step in Br, jointly with `tensor` for the norm scales under sequence
  parallelism and with `pipeline` for the embedding, final norm and head in a pipeline (those rows are
  `jaxpar.analysis.planner.comm`'s tensor and pipeline gradient terms, their axes with `context` added).
Not listed: the scalar psums of the loss and token count over data, fsdp and context (unplanned scalars, as
  elsewhere).

"""

from __future__ import annotations

from jaxpar.analysis.planner.dims import local_size, param_leaves
from jaxpar.analysis.planner.pipeline import ZERO_BUBBLE
from jaxpar.config.mesh_axes import CONTEXT, PIPELINE, TENSOR
from jaxpar.config.schema import Config
from jaxpar.data.batch import BATCH_KEYS
from jaxpar.parallel.sharding import storage_axes

INT_BYTES = 4  # int32 positions and segment ids, int32/fp32 batch arrays

# A collective term as `jaxpar.analysis.planner.comm` builds it: (name, axes, kind, count, S summed over the ops).
Row = tuple[str, tuple[str, ...], str, int, float]


def kv_elements(cfg: Config, d) -> int:
    """kv = b*r*(G/t)*K: one device's keys (or values) of one layer and microbatch, in elements."""
    return d.b * d.r * (cfg.model.kv_heads // d.shape[TENSOR]) * cfg.model.head_width


def context_terms(cfg: Config, d, passes: dict, joint: set[str]) -> list[Row]:
    """The collectives over `context` of one step (module docstring), as rows for
    `jaxpar.analysis.planner.comm`; [] for c = 1. `d`: `jaxpar.analysis.planner.dims.dims`; `passes`:
    `jaxpar.analysis.planner.comm`'s passes per step; `joint`: the paths of the parameters whose gradients
    comm's tensor or pipeline terms all-reduce over `context` jointly with that axis."""
    c = d.c
    if c == 1:
        return []
    axes, layers = (CONTEXT,), passes["layers"]
    fwd, bwd = passes["fwd"], passes["bwd"]
    kv, bc, ints = kv_elements(cfg, d), d.wire(d.compute_bytes), d.b * d.r * INT_BYTES
    # A rebuilt forward of one layer per model chunk (pipeline.recompute) whose K/V collectives XLA merges with the
    # backward's (module docstring): one per backward tick under interleaved 1F1B, all under a zero-bubble schedule.
    zb = d.shape[PIPELINE] > 1 and cfg.pipeline.schedule in ZERO_BUBBLE
    merged = passes.get("rebuilt_merged", 0)
    if zb and cfg.pipeline.recompute and layers == 1:
        merged = 2 * bwd
    # How often the int32 positions (and ring's segment ids) go per ring pass or gather (module docstring).
    if d.platform != "cpu":
        int_ops = fwd + bwd * layers
    elif zb:
        int_ops = 2 * bwd  # one per F op and one per B op (a rebuilt forward's merged with its B's)
    else:
        int_ops = 1
    rows: list[Row] = []
    if cfg.context.strategy == "ring":
        blocks = 2 * (c - 1) * layers * (fwd + bwd) - (c - 1) * merged
        rows.append(("key/value blocks (ring)", axes, "collective-permute", blocks, blocks * kv * bc))
        sums = 2 * c * layers * bwd
        rows.append(("key/value gradient sums (ring, fp32)", axes, "collective-permute", sums, sums * kv * d.wire(4)))
        ops = 2 * (c - 1) * int_ops
        rows.append(("positions and segment ids (ring, int32)", axes, "collective-permute", ops, ops * ints))
    else:
        gathers = 2 * layers * (fwd + bwd) - merged
        rows.append(("keys and values", axes, "all-gather", gathers, gathers * c * kv * bc))
        scatters = 2 * layers * bwd
        rows.append(("key and value gradients", axes, "reduce-scatter", scatters, scatters * c * kv * bc))
        rows.append(("key positions (int32)", axes, "all-gather", int_ops, int_ops * c * ints))
    if cfg.model.moe.enabled:
        # the router statistics' sums over the sequence (`jaxpar.parallel.context.ContextParallel.sequence_sum`)
        stats = (passes["layers"] // cfg.model.moe.every) * 2 * (fwd + bwd)
        size = d.b * cfg.model.moe.num_experts * 4
        rows.append(("MoE router statistics (fp32)", axes, "all-reduce", stats, stats * size))
    rows_step = d.b * d.accum * d.m
    n = len(BATCH_KEYS)
    rows.append(("batch arrays (int32, fp32)", axes, "all-gather", n, n * rows_step * d.s * INT_BYTES))
    storage = storage_axes("params", d.zero)
    leaves = [x for x in param_leaves(cfg.model) if x.path not in joint]
    grads = sum(local_size(x, d.shape, storage, d.expert_axes) for x in leaves)
    rows.append(("gradients", axes, "all-reduce", len(leaves), grads * d.wire(d.reduce_bytes)))
    return rows
