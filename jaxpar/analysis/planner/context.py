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
  pass, c - 1 collective-permutes of the K and V blocks, packed as one array (`jaxpar.parallel.context.ring_shift`,
  S = 2*kv*Bc); per layer and backward pass the second ring pass's c - 1 again and c of the fp32 dK and dV sums
  (S = 2*4*kv; the c-th brings the sums home). Remat none saves the ring's residuals (q, k, v, output and
  log-sum-exp); the other policies rebuild the forward in the backward, whose c - 1 permutes are the second ring
  pass's too (the same blocks
  permuted the same way: XLA merges them, `jax.checkpoint(..., prevent_cse=False)` in `jaxpar.model.stack`), so
  the count is the same under every policy.
Positions and segment ids (int32 [b, r], 4 bytes per token): the key positions are all-gathered with K/V
  (all_gather; no segment ids in the planned batch, whose keys are `jaxpar.data.batch.BATCH_KEYS`) or permuted
  with each block (ring: positions and the all-zero segment ids packed as one int32 array, c - 1 per ring pass).
  They derive from the device's index alone,
  so jax's scan moves the forward's out of the layer loop (once per forward pass) and XLA:CPU's
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

Memory. Every per-token activation of `jaxpar.analysis.planner.plan` counts r tokens (s' = r/t between blocks under
sequence parallelism); attention's scores span this device's r queries and the whole sequence's s keys: the score
elements are b*(H/t)*r*s (`jaxpar.analysis.planner.plan.score_elements`). Where `model.attention` resolves to cudnn
both strategies call cuDNN's fused kernel (`jaxpar.model.context_attention`, `jaxpar.model.context_ring`): no
scores in memory, only the K/V terms below (and under remat none the fp32 softmax statistics, as without context
parallelism). On XLA's path (all_gather's explicit mask, ring's einsums) the scores are in memory. Per score
element, read from XLA's GPU buffer assignment of the step compiled for 8 H100s with model.attention xla (Llama 1B's
layer shape, 2 layers, bf16, b = 1, c = 2 and 4, s = 4096 and 8192; the coefficient fitted from the two
lengths' temporary bytes, `attention_working_bytes`):
  all_gather, one layer's backward: the fp32 logits and their fp32 gradient, the probabilities in Bc and the
    bool mask, 2*4 + Bc + 1 bytes (11 with bf16; fitted 10.3 to 11.1 under remat dots and full); plus the gathered
    K and V and their gradients before the reduce-scatter, 4*c*kv*Bc (no remat policy keeps the gathered K/V: the
    backward re-gathers them, above).
  ring, the backward: XLA computes every step's q k^T ahead of the dK/dV chain (each depends only on the block
    the ring brings), so all c steps' fp32 scores and their bool masks are live at once: 4 + 1 bytes per element
    of the whole sequence's scores, and one more fp32 step, 4*b*r*(H/t)*r (fitted: 13.5 and 22.4 bytes per step
    element at c = 2 and 4 under remat dots, planned 14 and 24); plus the two K/V blocks in flight (this step's
    and the next, 4*kv*Bc) and the fp32 dK, dV sums in flight (4*kv*4).
  remat none saves per layer what the backward would otherwise recompute: 4 + 1 bytes per score element, the fp32
    probabilities (all_gather: the attention's logits dot is saveable) or every step's fp32 scores (ring: the
    outputs of its einsums, which dots_saveable keeps inside the custom VJP's forward), and the bool masks
    (fitted 5.0 per layer for all_gather, 5.8 and 6.25 for ring at c = 2 and 4).
The GPU compiler's peak is within 15% of the plan (on XLA's attention: compiled / planned 0.86 to 1.09 over both
strategies, remat none, dots and full, both lengths and both c; tests/system/test_plan_gpu.py checks two of them;
on cuDNN's, Llama 3 8B at 131,072 tokens and c = 8: 0.94 for both strategies, configs/llama_8b_128k.yaml's
record). Its collectives differ from the partitioned program's (which the plan for gpu counts) in one way: XLA's
GPU compiler folds each gradient's all-reduce over context into its all-reduce over data (ZeRO-0/1: one all-reduce
over data x context). The batch's all-gathered integer arrays (12 bytes per token of the device's rows of the step)
are left out of the memory: a few kB.
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
        # one permute per step for K and V together, one for positions and segment ids, one for the dK, dV sums
        # (`jaxpar.parallel.context.ring_shift` packs the arrays of one dtype)
        blocks = (c - 1) * layers * (fwd + bwd) - (c - 1) * merged // 2
        rows.append(("key/value blocks (ring)", axes, "collective-permute", blocks, blocks * 2 * kv * bc))
        sums = c * layers * bwd
        rows.append(
            ("key/value gradient sums (ring, fp32)", axes, "collective-permute", sums, sums * 2 * kv * d.wire(4))
        )
        ops = (c - 1) * int_ops
        rows.append(("positions and segment ids (ring, int32)", axes, "collective-permute", ops, ops * 2 * ints))
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


# Bytes per element of the whole sequence's scores [b, H/t, r, s] (`jaxpar.analysis.planner.plan.score_elements`)
# that context attention holds on XLA's GPU compiler (module docstring, "Memory"). all_gather, at the peak of one
# layer's backward: the fp32 logits and their fp32 gradient, the probabilities in Bc and the bool mask;
# saved per layer by remat none: the fp32 probabilities and the mask. ring, at the peak: every step's fp32 scores
# and mask (plus one more fp32 step, `RING_STEP_WORKING_BYTES` per [b, r, H/t, r] element); saved per layer by remat
# none: every step's fp32 scores and mask.
GATHER_WORKING_FP32_BYTES = 2 * 4
MASK_BYTES = 1
SAVED_FP32_BYTES = 4
RING_WORKING_BYTES = 4 + MASK_BYTES
RING_STEP_WORKING_BYTES = 4


def step_elements(cfg: Config, d) -> int:
    """Elements of one ring step's scores on one device: b*r*(H/t)*r (this device's queries against one block)."""
    return d.b * d.r * (cfg.model.n_heads // d.shape[TENSOR]) * d.r


def saved_score_bytes(cfg: Config, scores: int) -> dict[str, int]:
    """What remat none keeps per layer of the whole sequence's scores (`scores` elements, [b, H/t, r, s]) under
    context parallelism, by name (module docstring, "Memory"); {} under the other policies."""
    if cfg.model.remat != "none":
        return {}
    what = "every ring step's fp32 scores" if cfg.context.strategy == "ring" else "fp32 attention probabilities"
    return {what: SAVED_FP32_BYTES * scores, "attention masks (bool)": MASK_BYTES * scores}


def attention_working_bytes(cfg: Config, d, scores: int, fused: bool = False) -> int:
    """Bytes one layer's backward holds for context attention at its peak (module docstring, "Memory"), `scores` the
    elements of the whole sequence's scores [b, H/t, r, s]. all_gather: (2*4 + Bc + 1) per score element and the
    gathered K and V and their gradients before the reduce-scatter, 4*c*kv*Bc. ring: (4 + 1) per score element, 4
    per element of one step's scores (`step_elements`), the two K/V blocks in flight 4*kv*Bc and the fp32 dK, dV
    sums in flight 4*kv*4. With the `fused` kernel (cuDNN: `jaxpar.model.context_attention`,
    `jaxpar.model.context_ring`) no scores: the K/V terms alone."""
    kv, bc = kv_elements(cfg, d), d.compute_bytes
    if cfg.context.strategy == "ring":
        blocks = 4 * kv * bc + 4 * kv * 4
        if fused:
            return blocks
        return RING_WORKING_BYTES * scores + RING_STEP_WORKING_BYTES * step_elements(cfg, d) + blocks
    gathered = 4 * d.c * kv * bc
    return gathered if fused else (GATHER_WORKING_FP32_BYTES + bc + MASK_BYTES) * scores + gathered
