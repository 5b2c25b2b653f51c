"""Analytic plan of one train step: per-device bytes of model state and activations, and the collectives.

Pure arithmetic on a resolved `Config` (`jaxpar.config.resolve_config`): no jax devices, no compilation, so a
13B model on 64 GPUs is planned on a laptop. `jaxpar.analysis.planner.compiled` checks the numbers against XLA's
compiled step, `jaxpar.analysis.planner.comm` holds the collective terms, `jaxpar.analysis.planner.report` prints them.

Shape letters: b microbatch rows per device, s sequence length, r = s/c the tokens of each sequence on one device
under context parallelism (`mesh.context` c; r = s without), s' = r/t the tokens between blocks under sequence
parallelism (else r): every per-token term below counts r (or s') tokens, not s. D model
width, H query heads, G key/value heads, K head width, F MLP hidden width, V vocabulary, L layers (L/p per
stage), t tensor size, p pipeline stages, m pipeline microbatches, M gradient-accumulation microbatches
(`train.grad_accum_steps`).

Model state (ZeRO, Rajbhandari et al. 2019, arXiv 1910.02054, section 3): bytes per
parameter by precision layout `fp32` (4 + 4 + 8) or `16p` (bf16 params 2 + bf16 grads 2 + fp32 master, Adam m
and v 12), each kind divided by the fsdp size and, for the kinds the ZeRO stage partitions, by the data size
(`jaxpar.analysis.planner.memory.state_bytes_formula`), applied to P per tensor/pipeline rank (the parameters one rank
holds before ZeRO's split: tensor-sharded leaves count 1/t, the stacked layers 1/p, the embedding and head are on
every stage).

Activations: Korthikanti et al. 2022 (arXiv 2205.05198, section 4, Table 2) give, per layer and 16-bit
activations, s*b*h*(34 + 5*a*s/h) bytes without recomputation (divided by t with tensor + sequence
parallelism) and 2*s*b*h with full recomputation. jaxpar stores something different (no dropout masks, the
softmax recomputed from the saved scores, what is kept set by `model.remat`); `activation_bytes` counts what
its checkpoint policies keep, in the compute dtype (Bc bytes), per layer and microbatch:
    all policies   the block input, b*s'*D (the layer scan's carry)
    full           nothing else (recompute the block)
    names          + attention context b*s*(H/t)*K + MLP hidden b*s*F/t
    dots           + q, k, v b*s*(H+2G)/t*K + 2 projection outputs 2*b*s*D + gate, up 2*b*s*F/t
    none           dots + attention context b*s*(H/t)*K + the fp32 attention probabilities 4*b*(H/t)*s*s bytes
    with t > 1     the tensor collectives' outputs (`jaxpar.model.stack`): full and names keep the attention
                   exit b*s'*D (dots and none count it as the attention projection's output); with sequence
                   parallelism none and dots keep the 2 gathered block inputs 2*b*s*D
plus, outside the layers, the embedding output b*s'*D and the logits b*s*(V/t) (XLA's GPU buffer assignment
keeps them in Bc through the layers' backward; the cross-entropy's fp32 copies live only before it).
Microbatches in flight: one without a pipeline (gradient accumulation runs them one after the other); 1F1B with
`pipeline.recompute: true` holds a ring of 2p - 1 stage inputs b*s'*D and one microbatch's layers, without it a
ring of 2p - 1 microbatches' layers (what the remat policy keeps, the block inputs included); GPipe keeps every
tick's (m + p - 1) layers and stage input (`jaxpar.analysis.planner.pipeline`). Interleaved 1F1B
(`pipeline.virtual_stages` v > 1; Narayanan et al. 2021, arXiv 2104.04473, section 2.2.2; the ring from
`jaxpar.parallel.schedule`) holds a ring of 2pv - 1 chunk-microbatches of L/(pv) layers each, (2pv - 1)/v stages'
worth (about 2p, against 2p - 1), or with recompute a ring of 2pv - 1 chunk inputs b*s'*D (each the size of a
stage input) and one chunk's L/(pv) layers.

Attention scores (`attention_working_bytes`), on XLA's attention path (`model.attention` xla, or auto on cpu:
`jaxpar.config.attention`): `jax.nn.dot_product_attention`'s XLA implementation computes the logits
[b, H/t, s, s] in fp32, the softmax in fp32 and casts the probabilities to Bc, so the score tensors are written
to memory. At the peak of one layer's backward XLA's GPU buffer
assignment holds the fp32 logits and their fp32 gradient and the probabilities and their gradient in Bc:
(2*4 + 2*Bc) bytes per score element (12 with bf16; read from the buffer assignment's peak breakdown of the
step compiled for H100 by XLA's GPU compiler, the same for every remat policy; remat none also keeps each layer's fp32
probabilities, above). cuDNN's fused (flash) kernel (`auto` on gpu) keeps scores on chip: no score bytes; remat
none keeps its fp32 softmax statistics (logsumexp) 4*b*(H/t)*s per layer instead of the probabilities. The
compiled check reports whether the program materialises scores. Under context parallelism the scores are this
device's r queries against all s keys, b*(H/t)*r*s elements (`score_elements`), always in memory (all_gather
runs XLA's attention with an explicit mask, ring its own fp32 einsums), with their working set, what remat none
keeps of them and the keys and values in flight from `jaxpar.analysis.planner.context` (measured on XLA's GPU
compiler: all_gather 2*4 + Bc + 1 bytes per score element, ring 4 + 1 and one more fp32 step [b, r, H/t, r]).

Temporaries (`temp_bytes`): the activations, the working set of one layer's backward (its attention scores
above and, when weights are gathered (fsdp or ZeRO-3), its gradients at full size in the reduce dtype before
their reduce-scatter, (layer parameters / t) * Br), the gathered weights in use, fp32 gradient accumulators and
the gradient outputs; with interleaved 1F1B also the step's chunk-order copy of the stage's layer parameters (the
local shard in the parameter dtype) and of their gradients (in Br), which `jaxpar.training.step.make_grad_fn`
makes once per step (`jaxpar.parallel.pipeline.to_chunk_order`, `from_chunk_order`). Checked against XLA's GPU
compiler for every shipped config on its cluster (`jaxpar.analysis.gpu.deviceless`).

Platform (`jaxpar.config.precision.PLATFORMS`: gpu, tpu, cpu; `jaxpar-plan --platform`, a sweep file's `platform:`,
default gpu) is the machine the step is planned for. It resolves `precision.compute_dtype: auto` (float32 on cpu,
bfloat16 elsewhere: `jaxpar.config.precision.resolve_compute_dtype`) and sets the width of collectives
(`jaxpar.analysis.planner.dims.collective_bytes`): gpu and tpu count each collective in the dtype the partitioned
program gives it (the HLO after XLA's SPMD partitioner, which every backend receives; the GPU compiler only
promotes 16-bit integer all-reduce and reduce-scatter, so bf16 stays bf16), cpu counts what XLA:CPU compiles, whose
backend passes widen every bf16 all-reduce and reduce-scatter (AllReducePromotion BF16 -> F32: its collectives
implement no bf16 reduction) and every bf16 all-gather and collective-permute (FloatNormalization for BF16) to fp32
(passes of XLA:CPU's compiler pipeline; seen in HLO by tests/unit/test_hlo_collectives.py, and the plans checked
against both programs by tests/unit/test_plan.py). Memory is planned the same on every platform.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxpar.analysis.planner import context as context_plan
from jaxpar.analysis.planner import experts as expert_plan
from jaxpar.analysis.planner.comm import by_axis, collective_terms, gathered_leaf
from jaxpar.analysis.planner.dims import Dims, dims, expert_axes, local_size, param_leaves, rank_params_split
from jaxpar.analysis.planner.experts import expert_summary
from jaxpar.analysis.planner.memory import expert_state_bytes_formula, formula_expression, state_bytes_formula
from jaxpar.analysis.planner.pipeline import ZERO_BUBBLE, schedule_bubble
from jaxpar.config.attention import PLANNED_GPU_CAPABILITY, resolve_attention
from jaxpar.config.choices import REMAT_KEEPING_EXITS_ONLY
from jaxpar.config.errors import ConfigError
from jaxpar.config.mesh_axes import PIPELINE, TENSOR, mesh_sizes
from jaxpar.config.precision import resolve_compute_dtype
from jaxpar.config.schema import Config
from jaxpar.log import GB
from jaxpar.model import init_params
from jaxpar.model.flops import inactive_expert_params, row_flops_per_token
from jaxpar.parallel import schedule, zero_bubble
from jaxpar.parallel.layer_split import balanced_split, stage_flops
from jaxpar.parallel.sharding import storage_axes
from jaxpar.parallel.slot_program import program as slot_program
from jaxpar.training.fp8_history import history_bytes

# How each platform's compiler leaves the partitioned program's collectives (module docstring).
COLLECTIVE_DTYPES = {
    "gpu": "collectives in the partitioned program's dtypes (bf16 stays bf16)",
    "tpu": "collectives in the partitioned program's dtypes (bf16 stays bf16)",
    "cpu": "as XLA:CPU compiles them: bf16 all-reduce, reduce-scatter, all-gather, collective-permute widened to fp32",
}


def state_bytes(cfg: Config) -> dict:
    """Model-state bytes per device: {"params", "grads", "opt_state" (with the 16p fp32 master), "total",
    "expression" (e.g. "ZeRO-1 16p: 4P + 12P/N"), "n_params" (P per rank, the experts' 1/ep under expert
    parallelism), "n_expert_params" (P_e: the routed experts' part of it), "experts" (the bytes of P_e's state,
    part of "total"), "fp8_history" (FP8 delayed scaling's amax history, `jaxpar.training.fp8_history.
    history_bytes`, part of "total"; 0 without)}. With `model.moe.expert_axes` the
    experts' part is divided by the storage axes that are not expert axes only
    (`jaxpar.analysis.planner.memory.expert_state_bytes_formula`). Raises ValueError as
    `jaxpar.analysis.planner.memory.state_bytes_formula`."""
    experts = expert_axes(cfg)
    dense, expert = rank_params_split(cfg.model, mesh_sizes(cfg.mesh), experts)
    layout, zero = cfg.precision.layout, cfg.optimizer.zero_stage
    out = expert_state_bytes_formula(dense, expert, layout, zero, cfg.mesh.data, cfg.mesh.fsdp, experts)
    expression = formula_expression(layout, zero, cfg.mesh.fsdp)
    history = history_bytes(cfg)  # FP8 delayed scaling's amax history (0 without)
    out = {**out, "fp8_history": history, "total": out["total"] + history}
    return {**out, "expression": expression, "n_params": dense + expert, "n_expert_params": expert}


def score_elements(cfg: Config, d: Dims) -> int:
    """Elements of one layer's attention scores for one microbatch on one device: b * (H/t) * r * s (the
    query heads, grouped key/value heads broadcast to them; this device's r = s/c queries against the whole
    sequence's s keys, r = s without context parallelism)."""
    return d.b * (cfg.model.n_heads // d.shape[TENSOR]) * d.r * d.s


# Bytes per attention score element that XLA's attention path writes (module docstring): saved per layer for
# the backward by remat none (fp32 probabilities), and the working set of one layer's backward (fp32 logits and
# their gradient; the probabilities and their gradient add 2 * Bc).
SCORE_SAVED_BYTES = 4
SCORE_WORKING_FP32_BYTES = 2 * 4


def attention_implementation(cfg: Config, platform: str = "gpu") -> str:
    """`model.attention` resolved on `platform` (`jaxpar.config.attention.resolve_attention`): xla or cudnn. A
    `gpu` is planned as a Hopper-class one (`PLANNED_GPU_CAPABILITY`: H100, H200 and B200 alike take cuDNN head
    widths up to 256; an A100 takes 128, so a head wider than 128, e.g. MLA's 192, runs XLA's attention there).
    Under context parallelism (`mesh.context` > 1) cudnn where it resolves to cudnn (both strategies then call the
    fused kernel: `jaxpar.model.context_attention`, `jaxpar.model.context_ring`), else the strategy's own XLA path:
    xla for all_gather (`jaxpar.parallel.context.gathered_kv_attention`, XLA's attention with an explicit mask),
    ring for ring (its own fp32 einsums per step).

    Raises:
      ConfigError: cudnn on a platform or with a dtype or head width it does not take."""
    dtype = resolve_compute_dtype(cfg.precision.compute_dtype, platform)
    try:
        m = cfg.model
        capability = PLANNED_GPU_CAPABILITY if platform == "gpu" else None
        resolved = resolve_attention(m.attention, platform, dtype, m.kernel_head_width, m.attention_softcap, capability)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if cfg.mesh.context > 1 and resolved != "cudnn":
        return "ring" if cfg.context.strategy == "ring" else "xla"
    return resolved


def stage_balance(cfg: Config, d: Dims) -> dict | None:
    """Training FLOPs per token of the pipeline's model chunks (the stages, or with v virtual stages the p*v chunks one
    tick each runs; `jaxpar.parallel.layer_split.stage_flops`): a layer 6P/L + 12*D*T plus what remat recomputes
    (`jaxpar.model.flops.row_flops_per_token`), the head 6*D*V on the last (PaLM, Chowdhery et al. 2022, appendix B;
    the embedding is a gather), under the even split, under the whole-layer split that balances them
    (`balanced_split`, what pipeline.balance_stages runs) and under the configured one: {"layer_flops",
    "head_flops", "head_in_layers", "even" (busiest / mean chunk), "balanced_split" (layers per chunk), "balanced"
    (its busiest / mean), "split" (the configured layers per chunk), "vocab_parallel" (`pipeline.vocab_parallel`:
    the head split over the stages alike), "configured" (the configured split's busiest / mean, the head spread with
    vocab_parallel)}, in rows of the layer stack (`model.moe.every` blocks with MoE); the first chunk also runs the
    `model.moe.first_dense` blocks, each costed as 1/`model.layers_per_unit` row (as `chunk_counts`). With MoE a row
    costs its active parameters' FLOPs (`jaxpar.model.flops.active_non_embedding_params`). None without a
    pipeline."""
    p, mdl = d.shape[PIPELINE], cfg.model
    if p == 1:
        return None
    chunks, rows = p * d.virtual, mdl.stack_depth
    layer = row_flops_per_token(cfg, jax.eval_shape(lambda: init_params(mdl, 0)))
    head = 6 * mdl.d_model * mdl.vocab_size
    embed = layer * mdl.first_dense / mdl.layers_per_unit
    spread = cfg.pipeline.vocab_parallel
    balanced = balanced_split(rows, chunks, layer, 0.0 if spread else head, embed)  # as chunk_counts
    even = (rows // chunks,) * chunks if rows % chunks == 0 else None
    split = d.layout.counts if d.layout is not None else even

    def busiest(counts: tuple[int, ...] | None, spread: bool = False) -> float | None:
        if counts is None:
            return None
        loads = stage_flops(counts, layer, 0.0 if spread else head, embed)
        loads = [x + (head / chunks if spread else 0.0) for x in loads]
        return max(loads) / (sum(loads) / chunks)

    return {
        "layer_flops": layer,
        "head_flops": head,
        "head_in_layers": head / layer,
        "even": busiest(even, spread),
        "balanced_split": list(balanced),
        "balanced": busiest(balanced, spread),
        "split": None if split is None else list(split),
        "vocab_parallel": cfg.pipeline.vocab_parallel,
        "configured": busiest(split, spread),
    }


def _boundary_bytes(cfg: Config, d: Dims) -> int:
    """Bytes of B's boundary that a zero-bubble schedule keeps for W, per layer and microbatch, as
    `jaxpar.parallel.split_backward` splits the dense Llama block (counted from its trace at tensor 1 and 2, with
    and without sequence parallelism, and two sequence lengths; `tests/unit/test_split_backward.py`).

    With R = b*s rows of the full sequence, R' = b*s' rows of the activations (s' = s/t under sequence
    parallelism), D_t and D_kv/t the query and key-value widths and F_t the MLP width on one device:
      R (q D_t + k D_kv/t + 4 F_t)   the projections' inputs and output cotangents that W multiplies (q = 2,
                                     k = 2 under model.remat none, else q = 1, k = 3),
      + R 4D                         (R 2D + 2D under none or dots) without sequence parallelism; with it,
                                     R' 4D under full and (R + R') 2D under none or dots (W gathers the
                                     block inputs and output gradients again from their s/t rows),
      + R' 4D (+ 2 R' in fp32 unless full)   the norms' terms (W converts them to fp32 again),
      + the attention's (not under none): b (H/t) s^2 probabilities on XLA's path (`score_elements`), or
        R (2 D_t + D_kv/t) on cuDNN's (read from the GPU compiler's buffers at Llama 1B's shape),
    in the compute dtype but where named. model.remat full at tensor 1 traces differently: R (6D + 2 D_kv + 4F)
    + the norms' R 4D, i.e. R (10D + 2D_kv + 4F) elements, no attention term. (model.remat names counts as
    dots.)"""
    mdl, t, bc = cfg.model, d.shape[TENSOR], d.compute_bytes
    dm, rows, rows_act = mdl.d_model, d.b * d.r, d.b * d.s_act
    d_t, d_kv, f_t = mdl.n_heads * mdl.head_width // t, mdl.kv_heads * mdl.head_width // t, mdl.d_ff // t
    none, full = mdl.remat == "none", mdl.remat == "full"
    norms, fp32 = rows_act * 4 * dm, 0 if full else 2 * rows_act
    if full and t == 1:
        return (rows * (6 * dm + 2 * d_kv + 4 * f_t) + norms) * bc
    compute = norms + rows * ((2 if none else 1) * d_t + (2 if none else 3) * d_kv + 4 * f_t)
    if d.sp:  # W gathers the block inputs again (`split_backward._REDO_IN_W`); none and dots stash two gathered
        compute += rows_act * 4 * dm if full else (rows + rows_act) * 2 * dm
    else:
        compute += rows * 4 * dm if full else rows * 2 * dm + 2 * dm
    if not none:
        cudnn = attention_implementation(cfg, d.platform) == "cudnn"
        compute += rows * (2 * d_t + d_kv) if cudnn else score_elements(cfg, d)
    return compute * bc + fp32 * 4


def _attention_widths(cfg: Config, t: int) -> tuple[int, int]:
    """Per token on one of t tensor ranks, elements of (the attention's projection outputs, its context). The usual
    attention: queries, keys and values (H/t + 2 G/t) K, context (H/t) K. Multi-head Latent Attention
    (`jaxpar.model.mla`): the latents X + Z + R (whole on every rank), queries (H/t)(N + R) and the keys' and
    values' up-projection (H/t)(N + E); context (H/t) E."""
    mdl = cfg.model
    h_t = mdl.n_heads // t
    if not mdl.mla:
        k = mdl.head_width
        return (h_t + 2 * (mdl.kv_heads // t)) * k, h_t * k
    nope, rope, value = mdl.mla_widths
    latents = (mdl.q_lora_rank or 0) + (mdl.kv_lora_rank or 0) + rope
    return latents + h_t * (nope + rope) + h_t * (nope + value), h_t * value


def _layer_bytes(cfg: Config, d: Dims, platform: str) -> dict[str, int]:
    """Bytes one layer saves for the backward of one microbatch, by what they are (module docstring)."""
    mdl, t, bc = cfg.model, d.shape[TENSOR], d.compute_bytes
    b, s = d.b, d.r  # this device's tokens of each sequence
    f_t, dm = mdl.d_ff // t, mdl.d_model
    projections, context = _attention_widths(cfg, t)
    out = {"block input": b * d.s_act * dm * bc}
    if mdl.remat == "names":
        out["context + mlp hidden"] = b * s * (context + f_t) * bc
    if mdl.remat in ("dots", "none"):
        out["matmul outputs"] = b * s * (projections + 2 * dm + 2 * f_t) * bc
    if mdl.remat == "none":
        out["attention context"] = b * s * context * bc
        if attention_implementation(cfg, platform) == "cudnn":
            out["fp32 softmax statistics"] = 4 * b * (mdl.n_heads // t) * s
        elif d.c > 1:  # context attention on XLA: its own scores and masks (`jaxpar.analysis.planner.context`)
            out.update(context_plan.saved_score_bytes(cfg, score_elements(cfg, d)))
        else:
            out["fp32 attention probabilities"] = SCORE_SAVED_BYTES * score_elements(cfg, d)
    # The tensor collectives' outputs the policies keep (`jaxpar.model.stack`).
    if t > 1 and mdl.remat in REMAT_KEEPING_EXITS_ONLY:
        out["attention exit"] = b * d.s_act * dm * bc
    if d.sp and mdl.remat not in REMAT_KEEPING_EXITS_ONLY:
        out["gathered block inputs"] = 2 * b * s * dm * bc
    moe = expert_plan.saved_bytes(cfg, d) // mdl.moe.every  # one block in `every` is MoE
    if moe:
        out["expert all-to-all outputs"] = moe
    return out


def attention_working_bytes(cfg: Config, platform: str = "gpu") -> int:
    """Bytes of attention scores that one layer's backward holds at its peak on XLA's attention path: (2*4 +
    2*Bc) bytes per score element (`score_elements`; module docstring, measured from XLA's GPU buffer
    assignment); 0 with cuDNN's fused kernel (scores stay on chip). Per device."""
    d = dims(cfg, platform)
    cudnn = attention_implementation(cfg, platform) == "cudnn"
    if d.c > 1:  # context attention (`jaxpar.analysis.planner.context`)
        return context_plan.attention_working_bytes(cfg, d, score_elements(cfg, d), fused=cudnn)
    if cudnn:
        return 0
    return (SCORE_WORKING_FP32_BYTES + 2 * d.compute_bytes) * score_elements(cfg, d)


def head_working_bytes(cfg: Config, platform: str = "gpu") -> int:
    """Bytes the head's backward adds at its peak: the fp32 gradient of the logits, 4*b*s*(V/t) (the softmax
    cross-entropy differentiates in fp32; read from XLA's GPU buffer assignment of the step compiled for H100,
    where it sits beside the bf16 logits that `activation_bytes` counts). Per device; with a pipeline
    only the last stage has it, and the planner counts the largest stage; with `pipeline.vocab_parallel` every
    stage has its 1/p of it."""
    d = dims(cfg, platform)
    slices = d.shape[TENSOR] * (d.shape[PIPELINE] if cfg.pipeline.vocab_parallel else 1)
    return 4 * d.b * d.r * (cfg.model.vocab_size // slices)


def activation_bytes(cfg: Config, platform: str = "gpu") -> dict:
    """Activation bytes per device held for the backward, as jaxpar stores them (module docstring).

    Args:
      cfg: resolved config; platform: `cpu` or an accelerator (resolves `precision.compute_dtype: auto`).

    Returns:
      {"per_layer" (bytes per layer per microbatch), "layers" (all layers and microbatches in flight),
       "stage_inputs" (pipeline stash), "outside" (embedding output, logits), "total", "in_flight" (microbatches
       whose layers are held, in stages' worth of layers: (2pv - 1)/v, or 1/v with recompute, under interleaved
       1F1B), "layers_held" (layer-microbatches held: L/p x in_flight), "formula" (text), "korthikanti" (the
       paper's 16-bit count for the same layers and microbatches: 34 + 5as/h, or 2sbh with remat full; with
       tensor parallelism the Table 2 variant)}.
    """
    d = dims(cfg, platform)
    mdl, p, t, v = cfg.model, d.shape[PIPELINE], d.shape[TENSOR], d.virtual
    bc = d.compute_bytes
    per_layer = sum(_layer_bytes(cfg, d, platform).values())
    stage_input = d.b * d.s_act * mdl.d_model * bc
    slices = t * (p if cfg.pipeline.vocab_parallel else 1)  # the logits' vocabulary shards
    # the embedding's output, the input each first dense block keeps (`model.moe.first_dense`: they run with the
    # embedding, checkpointed like a stacked layer) and the logits
    outside = (1 + mdl.first_dense) * stage_input + d.b * d.r * (mdl.vocab_size // slices) * bc
    slots = schedule.stash_slots(p, v)  # 2pv - 1 (2p - 1 for plain 1F1B)
    if d.layout is not None:
        depth = f"n_max={d.layers_per_chunk} (the uneven split's deepest model chunk; padding rows held, skipped)"
    else:
        depth = f"L/p={d.layers_per_stage}" if v == 1 else f"L/(pv)={d.layers_per_chunk}"
    in_flight: float  # microbatches (or, interleaved, stages' worth of chunk-microbatches) whose layers are held
    w_ring = 0
    if p == 1:
        in_flight, stash, formula_flight = 1, 0, "1 microbatch (accumulation runs them in turn)"
    elif cfg.pipeline.schedule in ZERO_BUBBLE:
        prog = slot_program(zero_bubble.build(cfg.pipeline.schedule, p, d.m, v))
        # Each ring's slots (the table's peak) and one more row: what the slot's switch returns to be written
        # (`jaxpar.parallel.pipeline_zb`).
        stash_rows, w_rows = prog.stash_slots + 1, prog.w_slots + 1
        w_ring = w_rows * d.layers_per_chunk * _boundary_bytes(cfg, d)
        if cfg.pipeline.recompute:
            in_flight, stash = 1 / v, stash_rows * stage_input
        else:
            in_flight, stash = stash_rows / v, 0
        formula_flight = (
            f"{cfg.pipeline.schedule}: a stash ring of {prog.stash_slots} chunk-microbatches' "
            + ("inputs (forward recomputed)" if cfg.pipeline.recompute else "layers")
            + f" and a W ring of {prog.w_slots} chunk-microbatches' B boundaries (the table's peaks), each with one "
            "more row (the slot switch's result)"
        )
    elif cfg.pipeline.schedule == "1f1b" and cfg.pipeline.recompute and v == 1:
        in_flight, stash = 1, (2 * p - 1) * stage_input
        formula_flight = f"1F1B recomputing: 1 microbatch's layers + a ring of 2p-1={2 * p - 1} stage inputs"
    elif cfg.pipeline.schedule == "1f1b" and cfg.pipeline.recompute:
        in_flight, stash = 1 / v, slots * stage_input
        formula_flight = (
            f"interleaved 1F1B (v={v}) recomputing: 1 chunk's layers + a ring of 2pv-1={slots} chunk inputs of "
            f"stage-input size b*s'*D"
        )
    elif cfg.pipeline.schedule == "1f1b" and v == 1:
        in_flight, stash = 2 * p - 1, 0
        formula_flight = f"1F1B keeping residuals: a ring of 2p-1={2 * p - 1} microbatches' layers"
    elif cfg.pipeline.schedule == "1f1b":
        in_flight, stash = slots / v, 0
        formula_flight = (
            f"interleaved 1F1B (v={v}) keeping residuals: a ring of 2pv-1={slots} chunk-microbatches' layers, "
            f"(2pv-1)/v={slots / v:g} stages' worth"
        )
    else:
        in_flight, stash = d.m + p - 1, (d.m + p - 1) * stage_input
        outside *= in_flight
        formula_flight = f"GPipe: every tick's layers and stage input, m+p-1={d.m + p - 1}"
    # Layer-microbatches held: L/p per microbatch in flight, or L/(pv) per chunk-microbatch (an integer).
    held: float
    if cfg.pipeline.schedule in ZERO_BUBBLE and p > 1:
        held = d.layers_per_chunk * (1 if cfg.pipeline.recompute else prog.stash_slots + 1)
    elif v == 1:
        held = d.layers_per_chunk * in_flight
    else:
        held = d.layers_per_chunk * (1 if cfg.pipeline.recompute else slots)
    layers = per_layer * held + w_ring
    # Korthikanti et al. 2022, Table 2 (16-bit, i.e. 2 bytes per element), for the same layers in flight.
    # per device: its r = s/c tokens, each query's scores over the whole sequence s
    sbh, ratio = d.r * d.b * mdl.d_model, 5 * mdl.n_heads * d.s / mdl.d_model
    ref: float
    if mdl.remat == "full":
        ref = 2 * sbh
    elif t == 1:
        ref = sbh * (34 + ratio)
    elif d.sp:
        ref = sbh * (34 + ratio) / t
    else:
        ref = sbh * (10 + 24 / t + ratio / t)
    terms = " + ".join(_layer_bytes(cfg, d, platform))
    return {
        "per_layer": per_layer,
        "layers": layers,
        "stage_inputs": stash,
        "w_boundaries": w_ring,
        "outside": outside,
        "total": layers + stash + outside,
        "in_flight": in_flight,
        "layers_held": held,
        "formula": f"remat={mdl.remat}: per layer ({terms}) in {bc}-byte elements (fp32 where named) x "
        f"{depth} x {formula_flight}; + embedding output and logits (b={d.b}, "
        f"s={d.s}, r=s/c={d.r}, s'={d.s_act})",
        "korthikanti": ref * held,
    }


def temp_bytes(cfg: Config, platform: str = "gpu") -> dict:
    """Estimate of the step's temporary bytes per device (XLA's `temp_size_in_bytes`), module docstring:
    {"activations" (`activation_bytes`), "attention_working" (`attention_working_bytes`: one layer's backward
    on XLA's attention path), "head_working" (`head_working_bytes`: the head's backward; the total counts the
    larger of the two working sets), "layer_grads" (with fsdp/ZeRO-3 sharding, one layer's gradients at full size in
    the reduce dtype before their reduce-scatter), "grad_accumulators" (fp32, one per local parameter shard as
    stored over fsdp and, under ZeRO-3, data; 0 with a single microbatch), "grad_outputs" (the step's gradients in the
    parameter dtype, `state_bytes` grads), "gathered_weights" (with fsdp/ZeRO-3 sharding, the weights in use at the
    peak: one layer's and the largest of embedding and head, all-gathered, in the compute dtype), "chunk_order"
    (interleaved 1F1B, v > 1: the step's chunk-order copy of the stage's layer parameters, the local shard as stored
    over fsdp and, under ZeRO-3, data, in the parameter dtype, plus that of their gradients in the reduce dtype:
    `jaxpar.parallel.pipeline.to_chunk_order` / `from_chunk_order` in `jaxpar.training.step.make_grad_fn`; with
    an uneven split the stage layout's v*n_max rows instead, `jaxpar.parallel.layer_split`; 0 for v = 1 and the
    even split), "moe_working" (a mixture of experts: one MoE block's backward at its peak,
    `jaxpar.analysis.planner.experts.working_bytes`; 0 for a dense model), "moe_moment" (the temporaries at that
    moment, below), "total"}.

    The total is the larger of two moments. The sum of every term but the MoE block's, with the larger of the
    attention's and the head's working sets (they never overlap), is the step's end, where the gradient outputs and
    the chunk-order gradients join what the loop held. A mixture of experts peaks earlier, inside the layers'
    backward: the activations, one layer's gathered weights and gradients, the accumulators, the chunk-order
    parameters (not yet their gradients, which are the accumulators) and the MoE block's working set ("moe_moment";
    read from the GPU compiler's buffer assignment at the peak of configs/mixtral_8x7b.yaml, where the gradient
    outputs are not live). The optimizer update's own temporaries and XLA's fusion scratch are not counted: an
    estimate, compared with XLA's by `jaxpar.analysis.planner.compiled` (CPU) and `jaxpar.analysis.gpu.deviceless`
    (the GPU compiler), not a bound."""
    d = dims(cfg, platform)
    storage = storage_axes("params", d.zero)
    leaves = param_leaves(cfg.model)
    summed = d.accum * d.m > 1  # microbatches whose gradients add up (pipeline microbatches included)
    ea = d.expert_axes
    accum = 4 * sum(local_size(x, d.shape, storage, ea) for x in leaves) if summed else 0
    if summed and d.layout is not None:  # the layers' accumulators in the stage layout: v*n_max rows, not L/p
        blocks = 4 * sum(local_size(x, d.shape, storage, ea) for x in leaves if x.in_blocks)
        accum += blocks * d.virtual * d.layers_per_chunk // d.layers_per_stage - blocks
    gathered = layer_grads = 0
    if math.prod(d.shape[a] for a in storage) > 1:
        w_out = max(local_size(x, d.shape) for x in leaves if not x.in_blocks)
        # a layer's weights gathered whole; the routed experts' E/ep of them only where a storage axis that is not
        # an expert axis splits them (`jaxpar.analysis.planner.comm.gathered_leaf`)
        w_layer = sum(
            local_size(x, d.shape, (), ea) for x in leaves if x.in_blocks and gathered_leaf(x, d.shape, storage, ea)
        )
        w_layer //= d.layers_per_stage
        gathered = (w_out + w_layer) * d.compute_bytes
        layer_grads = w_layer * d.reduce_bytes
    chunk_order = chunk_params = 0
    if d.virtual > 1 or d.layout is not None:
        stage_layers = sum(local_size(x, d.shape, storage, ea) for x in leaves if x.in_blocks)
        if d.layout is not None:  # the stage layout holds v*n_max rows against the L/p stored
            stage_layers = stage_layers * d.virtual * d.layers_per_chunk // d.layers_per_stage
        chunk_params = stage_layers * d.param_bytes
        chunk_order = stage_layers * (d.param_bytes + d.reduce_bytes)
    out = {
        "activations": activation_bytes(cfg, platform)["total"],
        "attention_working": attention_working_bytes(cfg, platform),
        "head_working": head_working_bytes(cfg, platform),
        "layer_grads": layer_grads,
        "grad_accumulators": accum,
        "grad_outputs": int(state_bytes(cfg)["grads"]),
        "gathered_weights": gathered,
        "chunk_order": chunk_order,
        "moe_working": expert_plan.working_bytes(cfg, d),
    }
    # One layer's backward and the head's backward do not overlap: the larger working set counts.
    working = max(out["attention_working"], out["head_working"])
    end = sum(v for k, v in out.items() if k not in ("attention_working", "head_working", "moe_working")) + working
    moment = out["moe_working"]
    if moment:
        moment += out["activations"] + layer_grads + accum + gathered + chunk_params
    out["moe_moment"] = moment
    out["total"] = max(end, moment)
    return out


def plan(cfg: Config, platform: str = "gpu") -> dict:
    """The analytic plan of a resolved config: memory per device and collectives per step (JSON-ready).

    Args:
      cfg: resolved config (`resolve_config(cfg, devices)`); platform: one of `jaxpar.config.precision.PLATFORMS`,
        the machine the run targets (module docstring): `cpu` when comparing with a step compiled by XLA:CPU.

    Returns:
      {"devices", "mesh", "platform", "collective_dtypes" (how the platform's compiler leaves the collectives,
       `COLLECTIVE_DTYPES`), "compute_dtype", "layout", "zero_stage", "batch", "params", "pipeline" {"schedule",
       "microbatches", "stages", "recompute", "virtual_stages" (v; 1 without a pipeline), "bubble" ((p - 1)/(v*m +
       p - 1), `jaxpar.parallel.schedule.bubble_fraction`; 0 without a pipeline)},
       "memory": {params, grads, opt_state, model_state, expert_state (the routed experts' part of
       model_state), activations, total (model state + activations),
       peak_estimate (params + opt_state + `temp_bytes`, which holds the gradients), all bytes per device;
       expression, activation_formula, korthikanti_activations, temp_estimate (`temp_bytes`)},
       "activations" (see `activation_bytes`), "experts" (None for a dense model;
       `jaxpar.analysis.planner.experts.expert_summary`: the expert axes, ep and the all-to-all bytes per step),
       "collectives" (list of `jaxpar.analysis.planner.comm.collective_terms` rows), "by_axis" {(axes, kind) label:
       bytes}, "by_axis_hlo" (the same as a static reading of the compiled HLO counts them: equal to "by_axis"
       except under interleaved 1F1B, where it counts the embedding's and head's conds in every tick that
       evaluates them, `collective_terms(..., branches="evaluated")`), "by_axis_partitioned" (that reading of the
       program after XLA's SPMD partitioner, before the platform's compiler folds any collectives:
       `collective_terms(..., program="partitioned")`)}.

    Raises:
      ValueError: platform not one of `jaxpar.config.precision.PLATFORMS`; the config is not resolved.
    """
    d = dims(cfg, platform)
    state = state_bytes(cfg)
    act = activation_bytes(cfg, platform)
    leaves = param_leaves(cfg.model)
    total_params = sum(leaf.size for leaf in leaves)
    embedding = sum(leaf.size for leaf in leaves if leaf.path.startswith(("embed/", "lm_head/")))
    terms = collective_terms(cfg, platform)
    # What a static reading of the compiled HLO counts (jaxpar.analysis.planner.comm.collective_terms, branches):
    # under interleaved 1F1B the edge conds' collectives in every tick that evaluates them, under a zero-bubble
    # schedule every branch of the slot switch in every slot.
    evaluated = d.virtual > 1 or (d.shape[PIPELINE] > 1 and cfg.pipeline.schedule in ZERO_BUBBLE)
    static = collective_terms(cfg, platform, "evaluated") if evaluated else terms
    partitioned = collective_terms(cfg, platform, "evaluated" if evaluated else "taken", "partitioned")
    model_state = state["total"]
    temp = temp_bytes(cfg, platform)
    return {
        "devices": math.prod(d.shape.values()),
        "mesh": d.shape,
        "platform": platform,
        "collective_dtypes": COLLECTIVE_DTYPES[platform],
        "compute_dtype": resolve_compute_dtype(cfg.precision.compute_dtype, platform),
        "layout": cfg.precision.layout,
        "zero_stage": d.zero,
        "remat": cfg.model.remat,
        "attention": attention_implementation(cfg, platform),
        "pipeline": {
            "schedule": cfg.pipeline.schedule,
            "microbatches": d.m,
            "stages": d.shape[PIPELINE],
            "recompute": cfg.pipeline.recompute,
            "virtual_stages": d.virtual,
            # (p - 1)/(v*m + p - 1), GPipe and 1F1B alike for v = 1 (jaxpar.parallel.schedule); the table's
            # idle share for zb-h1 and zb-v (jaxpar.parallel.zero_bubble)
            "bubble": schedule_bubble(cfg.pipeline.schedule, d.shape[PIPELINE], d.m, d.virtual),
            "stage_balance": stage_balance(cfg, d),
        },
        "sequence_parallel": d.sp,
        # context parallelism (`jaxpar.analysis.planner.context`): each device's slice of every sequence
        "context_parallel": {
            "size": d.c,
            "strategy": cfg.context.strategy if d.c > 1 else None,
            "tokens_per_device": d.r,
            "tokens_between_blocks": d.s_act,
        },
        "batch": {
            "global_batch_size": cfg.train.global_batch_size,
            "seq_len": d.s,
            "grad_accum_steps": d.accum,
            "rows_per_microbatch": d.b,
            "tokens_per_step": cfg.train.global_batch_size * d.s,
        },
        "params": {
            "total": total_params,
            "non_embedding": total_params - embedding,
            "active": total_params - inactive_expert_params(cfg.model),
            # the same less the input embedding, a lookup that does no matmul (tied to the head: nothing less)
            "active_without_input_embedding": total_params
            - inactive_expert_params(cfg.model)
            - sum(leaf.size for leaf in leaves if leaf.path.startswith("embed/") and not cfg.model.tie_embeddings),
            "per_rank": state["n_params"],
        },
        "memory": {
            "params": state["params"],
            "grads": state["grads"],
            "opt_state": state["opt_state"],
            "fp8_history": state["fp8_history"],
            "model_state": model_state,
            "expert_state": state["experts"],
            "activations": act["total"],
            "total": model_state + act["total"],
            "expression": state["expression"],
            "activation_formula": act["formula"],
            "korthikanti_activations": act["korthikanti"],
            "temp_estimate": temp,
            "peak_estimate": state["params"] + state["opt_state"] + state["fp8_history"] + temp["total"],
        },
        "activations": act,
        "experts": expert_summary(cfg, d, state, terms),
        "collectives": [dataclasses.asdict(term) | {"bytes": term.bytes} for term in terms],
        "by_axis": {f"{','.join(k[0])} {k[1]}": v for k, v in by_axis(terms).items()},
        "by_axis_hlo": {f"{','.join(k[0])} {k[1]}": v for k, v in by_axis(static).items()},
        "by_axis_partitioned": {f"{','.join(k[0])} {k[1]}": v for k, v in by_axis(partitioned).items()},
    }


def zero_exercise(n_params: float = 13e9, devices: int = 8, budget_bytes: float = 24 * GB, layout: str = "16p") -> dict:
    """The seed exercise: model-state bytes per device of P parameters on N data-parallel devices under DDP and
    ZeRO-1/2/3 (`jaxpar.analysis.planner.memory.state_bytes_formula`, fsdp = 1), and the smallest N whose ZeRO-3 state
    fits `budget_bytes`.

    Returns:
      {"n_params", "devices", "layout", "budget_bytes", "stages": [{"zero_stage", "expression", "bytes"}],
       "smallest_devices_zero3" (int), "zero3_bytes_at_smallest"}.

    Raises:
      ValueError: n_params or budget_bytes <= 0, devices < 1, unknown layout.
    """
    if n_params <= 0 or budget_bytes <= 0 or devices < 1:
        raise ValueError(
            f"need n_params > 0, budget_bytes > 0, devices >= 1; got {n_params}, {budget_bytes}, {devices}"
        )
    stages = [
        {
            "zero_stage": z,
            "expression": formula_expression(layout, z),
            "bytes": state_bytes_formula(n_params, layout, z, devices, 1)["total"],
        }
        for z in range(4)
    ]
    full = state_bytes_formula(n_params, layout, 3, 1, 1)["total"]  # ZeRO-3 state is full / N
    smallest = max(1, math.ceil(full / budget_bytes))
    while full / smallest > budget_bytes:  # guard the float ceil
        smallest += 1
    return {
        "n_params": n_params,
        "devices": devices,
        "layout": layout,
        "budget_bytes": budget_bytes,
        "stages": stages,
        "smallest_devices_zero3": smallest,
        "zero3_bytes_at_smallest": full / smallest,
    }


def fsdp_config(cfg: Config, devices: int, rows_per_device: int = 1) -> Config:
    """`cfg` on mesh data=1, fsdp=devices (tensor = pipeline = 1) with `rows_per_device` sequences per device and
    no accumulation, left unvalidated so that a device count jaxpar could not shard (d_model % N != 0) can
    still be planned by formula."""
    return dataclasses.replace(
        cfg,
        mesh=dataclasses.replace(cfg.mesh, data=1, fsdp=devices, tensor=1, pipeline=1),
        tensor=dataclasses.replace(cfg.tensor, sequence_parallel=False),
        pipeline=dataclasses.replace(cfg.pipeline, microbatches=1),
        train=dataclasses.replace(cfg.train, global_batch_size=devices * rows_per_device, grad_accum_steps=1),
    )


def smallest_fitting_devices(
    cfg: Config,
    budget_bytes: float,
    include_temp: bool,
    shardable: bool,
    platform: str = "gpu",
    max_devices: int = 1 << 16,
) -> int | None:
    """Smallest N for which `fsdp_config(cfg, N)` needs at most `budget_bytes` per device: model state plus
    activations, or with `include_temp` model state plus `temp_bytes` (activations, fp32 gradient accumulators,
    gradient outputs, gathered weights). `shardable`: only N that divide d_model (jaxpar shards state along the
    embed dimension). None if no N up to `max_devices` fits (activations alone exceed the budget)."""
    for n in range(1, max_devices + 1):
        if shardable and cfg.model.d_model % n:
            continue
        c = fsdp_config(cfg, n)
        state = state_bytes(c)
        if include_temp:  # the temp estimate holds the gradients that the model state counts as well
            need = state["params"] + state["opt_state"] + state["fp8_history"] + temp_bytes(c, platform)["total"]
        else:
            need = state["total"] + activation_bytes(c, platform)["total"]
        if need <= budget_bytes:
            return n
    return None


def exercise_activations(cfg: Config, exercise: dict, platform: str = "gpu") -> dict:
    """What activations add to the seed exercise (`zero_exercise`) for the model shape of `cfg`, with one
    sequence of `data.seq_len` tokens per device: Korthikanti et al. 2022 (Table 2, 16-bit) without and with full
    recomputation, jaxpar's own count for `model.remat`, the attention scores one layer's backward holds with the
    config's attention (0 with cuDNN's fused kernel) and on XLA's path, and the smallest N that fits the exercise's
    budget (`smallest_fitting_devices`). Bytes per device."""
    n, budget = exercise["smallest_devices_zero3"], exercise["budget_bytes"]
    mdl, s = cfg.model, cfg.data.seq_len
    one_layer = s * mdl.d_model * (34 + 5 * mdl.n_heads * s / mdl.d_model)
    at_n = fsdp_config(cfg, n)
    return {
        "n_params": sum(x.size for x in param_leaves(mdl)),
        "layers": mdl.n_layers,
        "d_model": mdl.d_model,
        "heads": mdl.n_heads,
        "seq_len": s,
        "remat": mdl.remat,
        "korthikanti_none": mdl.n_layers * one_layer,
        "korthikanti_full": 2 * s * mdl.d_model * mdl.n_layers,
        "one_layer": one_layer,
        "jaxpar_activations": activation_bytes(at_n, platform)["total"],
        "attention_working_at_smallest": temp_bytes(at_n, platform)["attention_working"],
        "attention": attention_implementation(at_n, platform),
        "attention_working_xla_at_smallest": attention_working_bytes(
            dataclasses.replace(at_n, model=dataclasses.replace(at_n.model, attention="xla")), platform
        ),
        "fit_state_acts": smallest_fitting_devices(cfg, budget, False, False, platform),
        "fit_temp": smallest_fitting_devices(cfg, budget, True, False, platform),
        "fit_temp_shardable": smallest_fitting_devices(cfg, budget, True, True, platform),
    }
