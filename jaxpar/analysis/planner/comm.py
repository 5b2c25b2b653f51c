"""The collectives of one jaxpar train step, counted analytically per mesh axis and kind (bytes per device).

Letters as in `jaxpar.analysis.planner.plan`; Bc, Br, Bp bytes of the compute, the gradient-reduction and the
working-parameter dtype (Bp = 2 for the 16p layout, 4 for fp32), each as a collective moves it on the plan's
platform (`jaxpar.analysis.planner.dims.collective_bytes`: on cpu XLA:CPU widens bf16 collectives, so 2 becomes 4);
x = b*r*D*Bc, one microbatch's activations (r = s/c tokens of each sequence per device under context parallelism,
s without). Ring costs per op are `jaxpar.analysis.hlo.ring.ring_bytes` (NCCL tests,
doc/PERFORMANCE.md): all-reduce 2(n-1)/n*S, all-gather and reduce-scatter (n-1)/n*S, collective-permute S (ring
algorithms: Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of workstations").
This is jaxpar's one analytic communication model: the planner, the sweeps and the benchmarks' tensor-axis
rows (`jaxpar.analysis.bench.report.tensor_analytic`) all count with it.

The counts follow jaxpar's step (`jaxpar.training.step`, `jaxpar.parallel`) as XLA compiles it; where XLA hoists
or drops a collective the rule says so (generic HLO simplification that CPU and GPU compilers both run). tests/
test_plan.py checks them against the compiled HLO: the plan for cpu against the XLA:CPU executable, the plan for
gpu against the partitioned program (the HLO after the SPMD partitioner, before any backend pass).

Storage axes: fsdp, and data under ZeRO-3 (Rajbhandari et al. 2019, section 5.3; `jaxpar.parallel.gather`).
  Each layer's weights are all-gathered (Bc) in every forward pass and again in every backward pass (jaxpar
  re-gathers instead of keeping them); each layer's gradient is reduce-scattered (Br) in every backward pass.
  Passes per step: M*m forward and M*m backward without a pipeline. 1F1B: M*(m+p-1) forward ticks and
  M*(m+p-1) backward ticks: 2 gathers per layer and tick (the backward regathers the weights its residuals
  need), 3 with pipeline.recompute (the rebuilt forward gathers too). GPipe: the head ticks' forward gathers are
  loop-invariant and XLA hoists them out of the tick loop (once per accumulation step), the p - 1 warm-up ticks
  gather their own, the backward re-gathers in each of the M*(m+p-1) ticks. Without a pipeline the embedding,
  final norm and head are gathered once per step (loop-invariant, hoisted) and reduce-scattered per backward
  pass; in a pipeline they sit in conds on the stage index (`jaxpar.parallel.pipeline`), counted for the stage
  that runs them: the embedding's gathered and reduce-scattered in each of the M*(m+p-1) forward and backward
  ticks, the head's in the M*m ticks that run it. With one layer per stage and no pipeline the layer loop
  disappears and the block gathers become loop-invariant too: once per step.
  Interleaved 1F1B (`pipeline.virtual_stages` v > 1; tick arithmetic from `jaxpar.parallel.schedule`): the block
  passes run in chunk ticks, M*(m*v+p-1) forward (v*p - 1 warm-up, then steady) and as many backward, each of
  L/(pv) layers, with the same 2 (3 with recompute) gathers per layer and tick; with recompute and one layer
  per chunk the chunk's layer loop is gone and XLA merges the rebuilt forward's gathers with the backward's (2).
  The first stage embeds in the M*(m+p-1) forward ticks of its chunk 0 and the last runs the head in M*m; the
  conds around them are evaluated in every forward (steady) tick, which is what a static reading of the HLO
  counts (`collective_terms(..., branches="evaluated")`, the plan's `by_axis_hlo`).
data axis, ZeRO 0-2: one all-reduce (ZeRO-0/1) or reduce-scatter (ZeRO-2) of the fsdp-sharded gradients,
  P/F*Br, per step; ZeRO-1/2 add the compiler's all-gather of the updated parameters, P/F*Bp: the partitioner
  casts the data-sharded fp32 optimizer target (for the 16p layout the fp32 master) to the parameter dtype on
  each shard and gathers the result (bf16 under 16p; XLA:CPU then widens that gather to fp32).
tensor axis (Megatron; Shoeybi et al. 2019, section 3: 2 all-reduces of x per layer in the forward and 2 in the
  backward; Korthikanti et al. 2022, section 4.2: with sequence parallelism each becomes an all-gather and a
  reduce-scatter of the same total bytes; what jaxpar's model adds around the layers):
  forward pass: the embedding exit and 2 exits per layer (all-reduce of x; with sequence parallelism
  reduce-scatters, plus 2 all-gathers per layer at the enters and 1 at the head) and the cross-entropy's 3
  all-reduces of b*s*4 bytes; backward pass: 2 enter transposes per layer and the head's (all-reduce; SP:
  reduce-scatter), with SP 2 exit transposes per layer and the embedding's (all-gather). Every remat policy saves
  the exits' outputs and none and dots the SP enters' too (`jaxpar.model.stack`): only names and full with SP
  re-run collectives in the backward, the 2 enters (all-gathers) per layer.
  In a pipeline the embedding runs in M*(m+p-1) ticks (first stage) and the head in M*m (last stage), once per
  microbatch; a 1F1B recompute re-runs the layers' forward collectives (interleaved with one layer per chunk,
  XLA drops the rebuilt forward's last exit, whose output nobody reads, and under remat full with SP merges its
  first enter with the backward's regather: one each fewer per backward tick). With SP the norm-scale gradients
  (replicated over tensor, each rank saw s/t of the sequence) are all-reduced once per step.
pipeline axis (`jaxpar.parallel.pipeline`): one collective-permute of the stage activation b*s'*D*Bc per tick
  and direction, m+p-1 each; 1F1B loses an unread shift when its one-tick loop is unrolled (the forward one
  if m = 1, the backward one if p = 2). Interleaved 1F1B: a ring permute (all p devices send) per chunk tick and
  direction, m*v+p-1 each (no loop is one tick long); and per step the permutes of the stage's layers into chunk
  order (parameter dtype) and of their gradients back (Br), one ppermute per layer leaf and chunk route that
  moves a chunk between devices (`jaxpar.parallel.pipeline.to_chunk_order`: v^2 routes or fewer, those whose
  chunks all stay home move nothing), each one chunk of the local leaf, L/(pv) layers. The embedding,
  final-norm and head gradients, which one stage used, are all-reduced over pipeline once per step (the final
  norm over pipeline x tensor with SP). On gpu, under ZeRO-0/1, XLA's GPU compiler folds the embedding's and
  head's all-reduce over pipeline and the one over data that follows into one all-reduce over data x pipeline
  (seen in the deviceless H100 compile of every such layout, with and without gradient accumulation and
  interleaving; XLA:CPU keeps both), so the gpu plan counts them there: 2(dp-1)/(dp) S instead of
  2(d-1)/d S + 2(p-1)/p S (`_edge_fold`). The partitioned program, before the backend's passes, still has
  both (`collective_terms(..., program="partitioned")`).
context axis (`mesh.context` c > 1; `jaxpar.analysis.planner.context`, which states each term's formula and source:
  Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2, and Liu et al. 2023, arXiv 2310.01889):
  all_gather: per layer and forward pass 2 all-gathers of K, V (S = c*kv*Bc, kv = b*r*(G/t)*K), per layer and
  backward pass 2 again (re-gathered under every remat policy) and 2 reduce-scatters of dK, dV (S = c*kv*Bc, the
  compute dtype); ring: per layer and pass 2(c-1) collective-permutes of the K, V blocks (S = kv*Bc; the backward's
  second ring pass, which a rebuilt forward shares), and per layer and backward pass 2c of the fp32 dK, dV sums
  (S = kv*4); int32 positions (and ring's segment ids), 4*b*r bytes each, with them (where: the context module);
  per step the batch arrays' all-gathers (S = b*M*m*s*4 each) and the all-reduce of every gradient in Br, jointly
  with tensor (SP norm scales) or pipeline (embedding, final norm, head) where those reduce it too.
Expert parallelism (`model.moe.expert_axes`): the dispatch and combine all-to-alls of every MoE block
  (`jaxpar.analysis.planner.experts`: count and size, formula and sources); the routed experts' weights are not
  all-gathered and their gradients not reduce-scattered over expert axes ("expert weights" terms over the storage
  axes that remain), and not reduced over data when data is an expert axis.
Not listed: scalar all-reduces (loss, token count, grad-norm and finite-check partial sums, FP8's amaxes: one max per
GEMM operand), a few bytes.
"""

from __future__ import annotations

import dataclasses
import math

from jaxpar.analysis.hlo.ring import ring_bytes
from jaxpar.analysis.planner.context import context_terms
from jaxpar.analysis.planner.dims import dims, local_size, param_leaves
from jaxpar.analysis.planner.experts import all_to_all_count, all_to_all_elements, is_ragged, offset_all_to_alls
from jaxpar.analysis.planner.pipeline import ZERO_BUBBLE
from jaxpar.config.choices import REMAT_KEEPING_EXITS_ONLY
from jaxpar.config.mesh_axes import CONTEXT, DATA, FSDP, MESH_AXES, PIPELINE, TENSOR
from jaxpar.config.schema import FIRST_DENSE, Config
from jaxpar.parallel import schedule, zero_bubble
from jaxpar.parallel.pipeline import chunk_routes  # the routes the step permutes its layers by
from jaxpar.parallel.sharding import storage_axes


@dataclasses.dataclass(frozen=True)
class CollectiveTerm:
    """`count` collectives of `kind` over the mesh `axes` per step; `size_bytes` is S of the ring formula summed
    over those ops (ring bytes are linear in S), `group_size` the devices in each group."""

    name: str
    axes: tuple[str, ...]
    kind: str
    count: int
    size_bytes: float
    group_size: int

    @property
    def bytes(self) -> float:
        """Bytes sent per device per step."""
        return ring_bytes(self.kind, self.size_bytes, self.group_size)


def live_axes(shape: dict[str, int], axes) -> tuple[str, ...]:
    """`axes` with the size-1 ones dropped, in mesh order (as `jaxpar.analysis.hlo.collectives.classify_groups` names
    groups)."""
    return tuple(a for a in MESH_AXES if a in axes and shape[a] > 1)


def _term(out: list, shape: dict, name: str, axes, kind: str, count: int, size: float) -> None:
    live = live_axes(shape, axes)
    if live and count > 0 and size > 0:
        out.append(CollectiveTerm(name, live, kind, int(count), float(size), math.prod(shape[a] for a in live)))


BRANCHES = ("taken", "evaluated")
PROGRAMS = ("compiled", "partitioned")  # `collective_terms`' program


def _edge_ticks(p: int, v: int, m: int, branches: str) -> tuple[int, int]:
    """(embedding ticks, head ticks) of one 1F1B loop. "taken": the ticks in which the first stage runs the
    embedding (m + p - 1: its chunk 0's forward ticks, microbatches past m included) and the last stage the
    head (m: its last chunk's, steady ticks only). "evaluated": the ticks that evaluate their `lax.cond`, every
    forward tick (m*v + p - 1) and every steady tick (m*v + p - v*p); a static reading of the HLO counts a
    branch's collectives that often, since the predicate is known only at run time. Equal for v = 1 (the
    predicate is the stage index alone)."""
    if branches not in BRANCHES:
        raise ValueError(f"branches must be one of {BRANCHES}, got {branches!r}")
    if branches == "taken":
        return m + p - 1, m
    warm = schedule.warmup_ticks(p, v)
    steady = schedule.forward_tick(m - 1, p * v - 1, p, v) + 1 - warm
    return schedule.ticks(p, v, m) - warm, steady


def _passes(cfg: Config, d, branches: str = "taken") -> dict[str, int]:
    """Passes per step: forward and backward passes of the stage's blocks ("fwd", "bwd"; a 1F1B recompute is a
    forward pass too; with interleaved 1F1B chunk passes), each of "layers" layers (L/p, or L/(pv) with v > 1),
    of the embedding ("embed_fwd", "embed_bwd") and of the head and loss ("head_fwd", "head_bwd"); the
    stage-weight gathers per layer ("gathers"); and per step the gathers and gradient reduce-scatters of the
    embedding's and of the head's (final norm, output projection) weights ("embed_gathers", "head_gathers",
    "embed_scatters", "head_scatters"). `branches`: the edge conds' runs as the stages take them ("taken") or as
    a static HLO reading counts them ("evaluated", `_edge_ticks`)."""
    p, a, m, per_stage, v = d.shape[PIPELINE], d.accum, d.m, d.layers_per_stage, d.virtual
    if p > 1 and cfg.pipeline.schedule in ZERO_BUBBLE:
        return _zero_bubble_passes(cfg, d, branches)
    # Forward (and as many backward) ticks of one pipeline loop: m*v + p - 1 (jaxpar.parallel.schedule: v*p - 1
    # forward-only warm-up ticks, then the steady ones), m + p - 1 for v = 1 (GPipe's too).
    ticks = schedule.ticks(p, v, m) - schedule.warmup_ticks(p, v)
    if p == 1:
        n = a * m
        out = {"fwd": n, "bwd": n, "embed_fwd": n, "embed_bwd": n, "head_fwd": n, "head_bwd": n, "gathers": 2 * n}
        # Loop-invariant, hoisted out of the accumulation loop: once per step; gradients once per backward.
        out.update(embed_gathers=1, head_gathers=1, embed_scatters=n, head_scatters=n)
        # the first dense blocks, gathered and checkpointed as a stacked layer is: forward and backward
        out.update(dense_gathers=2 * n, dense_scatters=n)
    else:
        # The first stage embeds in every forward tick and back-propagates into the table in every backward
        # tick, the last runs head and loss in the m ticks that hold a microbatch (in conds on the stage index:
        # a count is what the stage that runs them does). Their fsdp gathers sit inside the conds, once per
        # run.
        recompute = cfg.pipeline.schedule == "1f1b" and cfg.pipeline.recompute
        embed, head = _edge_ticks(p, v, m, branches)
        out = {
            "fwd": a * ticks * (2 if recompute else 1),
            "bwd": a * ticks,
            "embed_fwd": a * embed,
            "embed_bwd": a * embed,
            "head_fwd": a * head,
            "head_bwd": a * head,
            "embed_gathers": a * embed,
            "head_gathers": a * head,
            "embed_scatters": a * embed,
            "head_scatters": a * head,
            # the first dense blocks run with the embedding, gathered inside its cond in its forward ticks and
            # again in its backward ones (checkpointed as a stacked layer is, rebuilt forward included)
            "dense_gathers": (3 if recompute else 2) * a * embed,
            "dense_scatters": a * embed,
        }
        if cfg.model.first_dense:
            # and the backward tick gathers the embedding table again, rebuilding the first dense block's input
            # (seen in the deviceless H100 compile of DeepSeek-V3's shape: one table gather per backward tick)
            out["embed_gathers"] *= 2
        if cfg.pipeline.schedule == "1f1b":
            # Forward, backward, and with recompute the rebuilt forward (without, the backward regathers the
            # weights its residuals need instead of stashing them). Interleaved with one layer per chunk, the
            # chunk's layer loop is gone, and the rebuilt forward's gathers (of the same chunk as the
            # backward's, in the same tick) are common subexpressions of the backward's: XLA merges them.
            merged = recompute and v > 1 and d.layers_per_chunk == 1
            out["gathers"] = (3 if recompute and not merged else 2) * a * ticks
            # The same lost loop lets XLA drop the rebuilt forward's last tensor exit (its output, the chunk's,
            # is never read: dead code) and, under remat full with sequence parallelism, merge its first enter
            # (the all-gather of the chunk input) with the backward's regather: one each per backward tick.
            out["rebuilt_merged"] = a * ticks if merged else 0
        else:
            # The head ticks' forward gathers are hoisted out of their loop; the p - 1 warm-up ticks gather
            # their own; the backward regathers in each tick.
            out["gathers"] = a * (1 + (p - 1) + ticks)
    if per_stage == 1 and p == 1:
        out["gathers"] = 1
    out["layers"] = d.layers_per_chunk
    return out


def _zero_bubble_passes(cfg: Config, d, branches: str) -> dict[str, int]:
    """`_passes` of zb-h1 and zb-v (`jaxpar.parallel.pipeline_zb`): a device runs only its own ops, m*v each of
    F, B and W per accumulation step (an idle slot runs nothing), its chunk of L/(pv) layers each; the first
    stage embeds m times (F of chunk 0) and back-propagates into the table m times (B of chunk 0), the last runs
    the head m times (F of the last chunk, gradient included). Gathers per chunk op: F's, B's (the forward it
    rebuilds with pipeline.recompute gathers again) and W's none (dW = x^T dy reads no weight); the weight
    gradients' reduce-scatters run in W, one per backward pass. "w" counts the W ops (their sequence-parallel
    all-gathers: `_tensor_terms`). `branches` "evaluated" (a static reading of the
    HLO, which cannot tell which branch of the slot switch a slot takes): every branch in every slot, the
    table's slot count in place of m*v and m."""
    a, n = d.accum, d.accum * d.m * d.virtual
    recompute = cfg.pipeline.recompute
    edge = a * d.m
    if branches == "evaluated":
        n = edge = a * zero_bubble.build(cfg.pipeline.schedule, d.shape[PIPELINE], d.m, d.virtual).slots
    return {
        "fwd": n * (2 if recompute else 1),
        "bwd": n,
        "embed_fwd": edge,
        "embed_bwd": edge,
        "head_fwd": edge,
        "head_bwd": edge,
        "embed_gathers": edge,
        "head_gathers": edge,
        "embed_scatters": edge,
        "head_scatters": edge,
        "dense_gathers": (3 if recompute else 2) * edge,
        "dense_scatters": edge,
        "gathers": (3 if recompute else 2) * n,
        "rebuilt_merged": 0,
        "layers": d.layers_per_chunk,
        "w": n,
    }


def _dense_leaves(cfg: Config) -> list:
    """The parameters of the `model.moe.first_dense` blocks, which run with the embedding, outside the stack."""
    return [x for x in param_leaves(cfg.model) if not x.in_blocks and x.path.startswith(FIRST_DENSE)]


def _edge_leaves(cfg: Config, part: str) -> list:
    """The parameters outside the layer stack and the first dense blocks that the embedding (`part` "embed") or
    the head ("head") uses."""
    dense = {x.path for x in _dense_leaves(cfg)}
    outside = [x for x in param_leaves(cfg.model) if not x.in_blocks and x.path not in dense]
    if part == "embed":
        return [x for x in outside if x.path.startswith("embed/")]
    head = [x for x in outside if not x.path.startswith("embed/")]
    return head + ([x for x in outside if x.path.startswith("embed/")] if cfg.model.tie_embeddings else [])


def gathered_leaf(leaf, shape: dict[str, int], storage: tuple[str, ...], expert_axes: tuple[str, ...]) -> bool:
    """Whether a `storage` axis of size > 1 splits `leaf` (`jaxpar.analysis.planner.dims.Leaf`), so that it is
    all-gathered before use: for a routed expert's weight only the storage axes that are not `expert_axes`."""
    return math.prod(shape[a] for a in storage if not (leaf.expert and a in expert_axes)) > 1


def _storage_terms(cfg: Config, d, passes: dict, out: list) -> None:
    shape = d.shape
    axes = storage_axes("params", d.zero)
    leaves = param_leaves(cfg.model)
    layers = passes["layers"]
    bc, br = d.wire(d.compute_bytes), d.wire(d.reduce_bytes)
    # Expert parallelism: the routed experts' weights (E/ep each) are gathered over the storage axes that are not
    # expert axes only; without expert axes they are layer weights like the others.
    experts = [x for x in leaves if x.in_blocks and x.expert and d.expert_axes]
    groups = [
        ("layer", axes, [x for x in leaves if x.in_blocks and x not in experts]),
        ("expert", tuple(a for a in axes if a not in d.expert_axes), experts),
    ]
    # per layer, gathered whole (the routed experts: E/ep of them)
    sizes = [sum(local_size(x, shape, (), d.expert_axes) for x in g) // d.layers_per_stage for _, _, g in groups]
    for (what, group_axes, group), w_layer in zip(groups, sizes):
        _term(
            out,
            shape,
            f"{what} weights",
            group_axes,
            "all-gather",
            passes["gathers"] * layers * len(group),
            passes["gathers"] * layers * w_layer * bc,
        )
    gathers = [(x, passes[f"{part}_gathers"]) for part in ("embed", "head") for x in _edge_leaves(cfg, part)]
    scatters = [(x, passes[f"{part}_scatters"]) for part in ("embed", "head") for x in _edge_leaves(cfg, part)]
    if shape[PIPELINE] == 1:  # one program part: each weight gathered once, whoever uses it
        gathers = [(x, 1) for x in {x.path: x for x, _ in gathers}.values()]
        scatters = [(x, passes["bwd"]) for x in {x.path: x for x, _ in scatters}.values()]
    _term(
        out,
        shape,
        "embedding/norm/head weights",
        axes,
        "all-gather",
        sum(n for _, n in gathers),
        sum(n * local_size(x, shape) for x, n in gathers) * bc,
    )
    dense = [x for x in _dense_leaves(cfg) if gathered_leaf(x, shape, axes, ()) and "embed" in x.axes]
    if dense:
        _term(
            out,
            shape,
            "first dense blocks' weights",
            axes,
            "all-gather",
            passes["dense_gathers"] * len(dense),
            passes["dense_gathers"] * sum(local_size(x, shape) for x in dense) * bc,
        )
        _term(
            out,
            shape,
            "first dense blocks' gradients",
            axes,
            "reduce-scatter",
            passes["dense_scatters"] * len(dense),
            passes["dense_scatters"] * sum(local_size(x, shape) for x in dense) * br,
        )
    for (what, group_axes, group), w_layer in zip(groups, sizes):
        _term(
            out,
            shape,
            f"{what} gradients",
            group_axes,
            "reduce-scatter",
            passes["bwd"] * layers * len(group),
            passes["bwd"] * layers * w_layer * br,
        )
    _term(
        out,
        shape,
        "embedding/norm/head gradients",
        axes,
        "reduce-scatter",
        sum(n for _, n in scatters),
        sum(n * local_size(x, shape) for x, n in scatters) * br,
    )


def _edge_fold(d, program: str) -> bool:
    """Whether the embedding's and head's gradient all-reduces over data and over pipeline are one all-reduce over
    data x pipeline in `program` (module docstring: XLA's GPU compiler folds them under ZeRO-0/1 with a
    pipeline; the partitioned program has both)."""
    folds = d.zero in (0, 1) and d.shape[PIPELINE] > 1 and d.shape[DATA] > 1
    return folds and d.platform == "gpu" and program == "compiled"


def _data_terms(cfg: Config, d, out: list, fold: bool) -> None:
    if d.zero == 3:
        return
    # The routed experts' gradients need no reduction over data when data is an expert axis; the edge leaves'
    # gradient all-reduce over data is folded into their pipeline term where `_edge_fold` (not the gather of their
    # updated values).
    leaves = [x for x in param_leaves(cfg.model) if not (x.expert and DATA in d.expert_axes)]
    grads = sum(local_size(x, d.shape, (FSDP,), d.expert_axes) for x in leaves)
    edge = _edge_rest(cfg, d) if fold else []
    folded = [x for x in leaves if x in edge]
    reduced = grads - sum(local_size(x, d.shape, (FSDP,), d.expert_axes) for x in folded)
    kind = "reduce-scatter" if d.zero == 2 else "all-reduce"
    _term(out, d.shape, "gradients", (DATA,), kind, len(leaves) - len(folded), reduced * d.wire(d.reduce_bytes))
    if d.zero in (1, 2):
        width = {2: "bf16", 4: "fp32"}
        name = f"updated parameters ({width[d.param_bytes]}" + (
            f", {width[d.wire(d.param_bytes)]} on {d.platform})" if d.wire(d.param_bytes) != d.param_bytes else ")"
        )
        _term(out, d.shape, name, (DATA,), "all-gather", len(leaves), grads * d.wire(d.param_bytes))


def _tensor_terms(cfg: Config, d, passes: dict, out: list) -> None:
    shape, layers = d.shape, passes["layers"]
    if shape[TENSOR] == 1:
        return
    x = d.b * d.r * cfg.model.d_model * d.wire(d.compute_bytes)
    ce = d.b * d.r * 4
    # Every remat policy saves the exits' outputs, none and dots the SP enters' too (`jaxpar.model.stack`): names
    # and full with SP re-gather both block inputs of each layer in the backward.
    regather = cfg.model.remat in REMAT_KEEPING_EXITS_ONLY
    fwd, bwd = passes["fwd"], passes["bwd"]
    head_fwd, head_bwd, embed_fwd, embed_bwd = (passes[k] for k in ("head_fwd", "head_bwd", "embed_fwd", "embed_bwd"))
    tensor = (TENSOR,)
    # Exits: the embedding's and 2 per layer in the forward; enters: 2 per layer and the head's.
    merged = passes.get("rebuilt_merged", 0)
    exits = embed_fwd + fwd * 2 * layers - merged
    enter_grads = bwd * 2 * layers + head_bwd
    if d.sp:
        ag = fwd * 2 * layers + head_fwd + bwd * (2 * layers + (2 * layers if regather else 0)) + embed_bwd
        ag -= merged if cfg.model.remat == "full" else 0
        # A zero-bubble W gathers again what it multiplies rather than keep it gathered since B
        # (`jaxpar.parallel.split_backward._REDO_IN_W`): both block inputs and both exits' output gradients, or
        # under none and dots, which stash the gathered inputs, the two output gradients.
        ag += passes.get("w", 0) * layers * (4 if regather else 2)
        _term(
            out,
            shape,
            "activations (sequence parallel)",
            tensor,
            "reduce-scatter",
            exits + enter_grads,
            (exits + enter_grads) * x,
        )
        _term(out, shape, "activations (sequence parallel)", tensor, "all-gather", ag, ag * x)
    else:
        _term(out, shape, "activations", tensor, "all-reduce", exits + enter_grads, (exits + enter_grads) * x)
    if not cfg.pipeline.vocab_parallel:  # else over (tensor, pipeline): `_pipeline_terms`
        _term(out, shape, "cross-entropy statistics", tensor, "all-reduce", 3 * head_fwd, 3 * head_fwd * ce)
    if d.sp:
        storage = storage_axes("params", d.zero)
        # Parameters replicated over tensor receive partial gradients under sequence parallelism: the norm
        # scales, [L/p, D/shards] in the stack and [D/shards] outside it; with context parallelism over context
        # too, in the same all-reduce (`jaxpar.analysis.planner.context`).
        stacked = sum(local_size(x, shape, storage) for x in _norm_scales(cfg, d))
        _term(out, shape, "norm-scale gradients", (CONTEXT, TENSOR), "all-reduce", 1, stacked * d.wire(d.reduce_bytes))


def _norm_scales(cfg: Config, d) -> list:
    """The parameters replicated over tensor whose gradients the tensor terms all-reduce under sequence
    parallelism (the norm scales; outside the stack only without a pipeline, where the pipeline terms take them);
    [] without sequence parallelism."""
    if not d.sp:
        return []
    replicated = [x for x in param_leaves(cfg.model) if not {"vocab", "heads", "mlp"} & set(x.axes)]
    return [x for x in replicated if x.in_blocks or d.shape[PIPELINE] == 1]


def _joint_gradients(cfg: Config, d) -> set[str]:
    """Paths of the parameters whose gradients the tensor or pipeline terms all-reduce (over context too, in
    the same op), which `jaxpar.analysis.planner.context` leaves out of its own gradient all-reduce."""
    edge = [x for x in param_leaves(cfg.model) if not x.in_blocks] if d.shape[PIPELINE] > 1 else []
    return {x.path for x in _norm_scales(cfg, d) + edge}


def _pipeline_terms(cfg: Config, d, out: list, fold: bool) -> None:
    shape, p = d.shape, d.shape[PIPELINE]
    if p == 1:
        return
    zb = cfg.pipeline.schedule in ZERO_BUBBLE
    if zb:  # two permutes (to s + 1 and to s - 1) after every slot of the table
        shifts = 2 * zero_bubble.build(cfg.pipeline.schedule, p, d.m, d.virtual).slots
    else:  # every forward and every backward (chunk) tick: m*v + p - 1 of each (1F1B's, GPipe's)
        shifts = 2 * (schedule.ticks(p, d.virtual, d.m) - schedule.warmup_ticks(p, d.virtual))
    act = d.b * d.s_act * cfg.model.d_model * d.wire(d.compute_bytes)
    if cfg.pipeline.vocab_parallel:
        # The vocabulary-parallel head (`jaxpar.parallel.pipeline_1f1b`), in the m steady ticks of each loop: the
        # last stage's output to every stage and the slices' input gradients back (all-reduces of [b, T', D]),
        # and the cross-entropy's max, normaliser and target logit over every vocabulary shard ([b, T] fp32).
        heads = d.accum * d.m
        _term(
            out,
            shape,
            "head input and its gradient (vocabulary-parallel head)",
            (PIPELINE,),
            "all-reduce",
            2 * heads,
            2 * heads * act,
        )
        ce = d.b * d.r * 4
        _term(out, shape, "cross-entropy statistics", (TENSOR, PIPELINE), "all-reduce", 3 * heads, 3 * heads * ce)
    _term(
        out,
        shape,
        "stage activations and their gradients" + (" (ring)" if d.virtual > 1 or zb else ""),
        (PIPELINE,),
        "collective-permute",
        d.accum * shifts,
        d.accum * shifts * act,
    )
    storage = storage_axes("params", d.zero)
    if d.layout is not None:
        # An uneven split's moves into the stage layout and of the gradients back (`jaxpar.parallel.layer_split.
        # to_stage_layout`): per layer leaf one ppermute per round of moves, in which a device sends at most one
        # row of its local shard.
        rounds = len(d.layout.moves[2])
        blocks = [x for x in param_leaves(cfg.model) if x.in_blocks]
        row = sum(local_size(x, shape, storage, d.expert_axes) for x in blocks) // d.layers_per_stage * d.row_layers
        for what, width in (
            ("layer parameters into the stage layout", d.param_bytes),
            ("layer gradients back from it", d.reduce_bytes),
        ):
            _term(
                out, shape, what, (PIPELINE,), "collective-permute", rounds * len(blocks), rounds * row * d.wire(width)
            )
    elif d.virtual > 1:
        # The step's permutes of the stage's layers into chunk order and of their gradients back
        # (`jaxpar.parallel.pipeline.to_chunk_order`): per layer leaf one ppermute per route, each one chunk of the
        # local shard. A route whose chunks all stay on their device moves nothing (a group of one in the HLO,
        # which XLA leaves as a copy or drops); the others count in full (the chunk's bytes) for each op.
        moving = sum(any(src != dst for src, dst in pairs) for pairs in chunk_routes(p, d.virtual).values())
        blocks = [x for x in param_leaves(cfg.model) if x.in_blocks]
        chunk = sum(local_size(x, shape, storage, d.expert_axes) for x in blocks) // d.virtual
        for what, width in (
            ("layer parameters into chunk order", d.param_bytes),
            ("layer gradients back", d.reduce_bytes),
        ):
            _term(
                out,
                shape,
                what,
                (PIPELINE,),
                "collective-permute",
                moving * len(blocks),
                moving * chunk * d.wire(width),
            )
    rest = _edge_rest(cfg, d)
    norms = [x for x in param_leaves(cfg.model) if not x.in_blocks and x not in rest]  # the final norm under SP
    br = d.wire(d.reduce_bytes)
    _term(
        out,
        shape,
        "embedding/head gradients (one stage used them)" + (", with their data all-reduce" if fold else ""),
        (DATA, PIPELINE, CONTEXT) if fold else (PIPELINE, CONTEXT),
        "all-reduce",
        len(rest),
        sum(local_size(x, shape, storage) for x in rest) * br,
    )
    _term(
        out,
        shape,
        "final-norm gradient (one stage, s/t each)",
        (PIPELINE, CONTEXT, TENSOR),
        "all-reduce",
        len(norms),
        sum(local_size(x, shape, storage) for x in norms) * br,
    )


def _edge_rest(cfg: Config, d) -> list:
    """The parameters outside the layer stack that one pipeline stage uses and whose gradients the pipeline term
    all-reduces over pipeline (and context): the embedding, head and, without sequence parallelism, the final norm."""
    outside = [x for x in param_leaves(cfg.model) if not x.in_blocks]
    return [x for x in outside if not (d.sp and x.path == "final_norm/scale")]


def _expert_terms(cfg: Config, d, passes: dict, out: list) -> None:
    size = all_to_all_elements(cfg, d)
    count = all_to_all_count(cfg, d, passes) if size else 0
    name = f"MoE dispatch/combine ({cfg.model.moe.routing})"
    kind = "ragged-all-to-all" if is_ragged(cfg, d) else "all-to-all"
    _term(out, d.shape, name, d.expert_axes, kind, count, count * size * d.wire(d.compute_bytes))
    offsets, elements = offset_all_to_alls(cfg, d, passes)
    _term(out, d.shape, "MoE dispatch offsets (int32)", d.expert_axes, "all-to-all", offsets, elements * 4)


def collective_terms(
    cfg: Config, platform: str = "gpu", branches: str = "taken", program: str = "compiled"
) -> list[CollectiveTerm]:
    """Every non-scalar collective of the train step of a resolved config, as `CollectiveTerm`s (module
    docstring). `platform` (`jaxpar.config.precision.PLATFORMS`) resolves `precision.compute_dtype: auto`
    (float32 on cpu, else bfloat16) and sets the collectives' width (`jaxpar.analysis.planner.dims.collective_bytes`).
    `branches`: "taken" (the plan: what the stages run) or "evaluated" (interleaved 1F1B's edge conds counted in
    every tick that evaluates them, as a static reading of the compiled HLO does; the same for v = 1).
    `program`: "compiled" (what the platform's compiler runs, with the GPU compiler's fold of the edge gradients'
    all-reduces, `_edge_fold`) or "partitioned" (the program after XLA's SPMD partitioner, before the backend).
    Raises ValueError for an unknown platform, `branches` or `program`, or an unresolved config."""
    d = dims(cfg, platform)
    passes = _passes(cfg, d, branches)
    out: list[CollectiveTerm] = []
    _storage_terms(cfg, d, passes, out)
    if program not in PROGRAMS:
        raise ValueError(f"program must be one of {PROGRAMS}, got {program!r}")
    fold = _edge_fold(d, program)
    _data_terms(cfg, d, out, fold)
    _tensor_terms(cfg, d, passes, out)
    _pipeline_terms(cfg, d, out, fold)
    _expert_terms(cfg, d, passes, out)
    for row in context_terms(cfg, d, passes, _joint_gradients(cfg, d)):
        _term(out, d.shape, *row)
    return out


def by_axis(terms: list[CollectiveTerm]) -> dict[tuple[tuple[str, ...], str], float]:
    """Bytes per device per step summed by (mesh axes, kind)."""
    out: dict = {}
    for t in terms:
        out[(t.axes, t.kind)] = out.get((t.axes, t.kind), 0.0) + t.bytes
    return out
