"""Text reports of a plan (`jaxpar.analysis.planner.plan.plan`), its compiled check
(`jaxpar.analysis.planner.compiled`), its GPU target and
deviceless GPU compile (`jaxpar.analysis.gpu.deviceless`) and the seed exercise.

Bytes are per device; GB = 1e9 bytes. Ratios are compiled / planned.
"""

from __future__ import annotations

from jaxpar.log import human_bytes


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _pct(x: float) -> str:
    """A fraction as a percentage, 3 significant digits: 0.0956 -> 9.56%, 9.6e-5 -> 0.0096%."""
    return f"{x * 100:.3g}%"


def _n(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _pipeline_shape(pipe: dict) -> str:
    """Virtual stages and bubble of a pipelined plan ("" without a pipeline)."""
    if pipe["stages"] == 1:
        return ""
    v = pipe.get("virtual_stages", 1)
    zb = pipe.get("schedule") in ("zb-h1", "zb-v")
    shape = f" {v} chunks per device" if v > 1 and zb else f" virtual stages v={v} (interleaved)" if v > 1 else ""
    formula = "the table's idle share" if zb else "(p-1)/(v*m+p-1)"
    return f"{shape}, bubble {formula} = {pipe['bubble']:.3f}" if "bubble" in pipe else shape


def _balance_lines(balance: dict | None) -> list[str]:
    """The pipeline's chunk FLOPs line (`jaxpar.analysis.planner.plan.stage_balance`); none without one."""
    if not balance:
        return []
    listed = lambda counts: ", ".join(str(c) for c in counts)  # noqa: E731
    even = "" if balance["even"] is None else f"{balance['even']:.3f} with the even split, "
    where = "split over every (pipeline.vocab_parallel)" if balance.get("vocab_parallel") else "on the last"
    line = (
        f"  stage FLOPs (6P/L + 12DT per layer and what remat recomputes, 6DV for the head {where} "
        f"model chunk): the head costs {balance['head_in_layers']:.2f} layers; busiest chunk / mean "
        f"{even}{balance['balanced']:.3f} with whole layers ({listed(balance['balanced_split'])}) per chunk "
        "(pipeline.balance_stages)"
    )
    if balance["split"] is not None and balance["configured"] not in (balance["even"], None):
        line += f"; this run's ({listed(balance['split'])}): {balance['configured']:.3f}"
    return [line]


def _context_lines(context: dict | None) -> list[str]:
    """The context-parallel line of a plan: the per-device sequence slice; none without context parallelism."""
    if not context or context["size"] == 1:
        return []
    c, r, between = context["size"], context["tokens_per_device"], context["tokens_between_blocks"]
    return [
        (
            f"  context parallel c={c} ({context['strategy']}): each device holds r = s/c = {r:,} tokens of every "
            f"sequence (chunks i and 2c-1-i of 2c, load-balanced)"
            + (f", {between:,} between blocks (sequence parallel)" if between != r else "")
            + "; attention's keys span the whole sequence"
        )
    ]


def _expert_lines(experts: dict | None) -> list[str]:
    """The MoE line of a plan (`jaxpar.analysis.planner.experts.expert_summary`); none for a dense model."""
    if not experts:
        return []
    axes = ",".join(experts["axes"]) or "none (every device holds every expert)"
    return [
        (
            f"  experts E={experts['num_experts']} top-{experts['top_k']} {experts['routing']}; expert axes {axes}, "
            f"ep={experts['ep']}: {experts['experts_per_device']} of them per device, P_e per rank "
            f"{experts['expert_params_per_rank']:,}; all-to-all {_n(experts['all_to_all_bytes'])} B/step "
            f"({human_bytes(experts['all_to_all_bytes'])}) in {experts['all_to_all_count']} ops"
        ),
        *_transport_lines(experts),
    ]


def _transport_lines(experts: dict) -> list[str]:
    """How the dispatch moves rows: the ragged all-to-all's balanced and worst-case bytes, the receive buffer."""
    if not experts["axes"]:
        return []
    receive = f"receive buffer {_n(experts['receive_buffer_bytes'])} B ({human_bytes(experts['receive_buffer_bytes'])})"
    if experts["transport"] != "ragged":
        return [f"  dispatch: {experts['transport']} all-to-all of a fixed buffer; {receive} per MoE block"]
    worst = experts["all_to_all_worst_bytes"]
    return [
        f"  dispatch: ragged all-to-all, each device sends only the rows it routes: the bytes above with balanced "
        f"routing, {_n(worst)} B/step ({human_bytes(worst)}) if every row leaves its device; {receive} per MoE "
        f"block as sized (model.moe.receive_factor)"
    ]


def format_plan(p: dict, compiled: dict | None = None, measured: dict | None = None, title: str = "") -> str:
    """Plain-text report: setup, memory per device (planned, and compiled where given) and collectives per step
    by mesh axis and kind (planned, compiled, ratio), then the analytic terms and formula sources."""
    mesh = " ".join(f"{a}={s}" for a, s in p["mesh"].items())
    b, mem, pipe = p["batch"], p["memory"], p["pipeline"]
    lines = [
        f"jaxpar plan{': ' + title if title else ''}",
        (
            f"  mesh {mesh} ({p['devices']} devices); compute {p['compute_dtype']}, "
            f"layout {p['layout']}, ZeRO-{p['zero_stage']}, remat {p['remat']}, attention {p['attention']}, "
            f"sequence parallel {'on' if p['sequence_parallel'] else 'off'}"
        ),
        f"  planned for platform {p['platform']}: {p['collective_dtypes']}",
        (
            f"  batch {b['global_batch_size']} x {b['seq_len']} = {b['tokens_per_step']:,} tokens/step; "
            f"{b['rows_per_microbatch']} rows per microbatch per device; accumulation {b['grad_accum_steps']}; "
            f"pipeline {pipe['schedule']} p={pipe['stages']} m={pipe['microbatches']}"
            + (" recompute" if pipe["recompute"] and pipe["schedule"] == "1f1b" and pipe["stages"] > 1 else "")
            + _pipeline_shape(pipe)
        ),
        (
            f"  parameters {p['params']['total']:,} (non-embedding {p['params']['non_embedding']:,}"
            + (
                f"; active per token {p['params']['active']:,}, the routed experts a token does not use left out, "
                f"{p['params']['active_without_input_embedding']:,} without the input embedding"
                if p["params"].get("active", p["params"]["total"]) != p["params"]["total"]
                else ""
            )
            + f"); P per tensor/pipeline rank {p['params']['per_rank']:,}"
        ),
        *_context_lines(p.get("context_parallel")),
        *_expert_lines(p.get("experts")),
        *_balance_lines(pipe.get("stage_balance")),
        "",
    ]
    state = (compiled or {}).get("state", {})
    temp = (compiled or {}).get("temp", {})
    head = f"  {'memory per device':<38}{'planned bytes':>18}{'':>12}"
    if compiled:
        head += f"{'compiled bytes':>18}{'ratio':>9}"
    lines += [head]

    def row(name, planned, got=None, ratio=None):
        text = f"  {name:<38}{_n(planned):>18}{human_bytes(planned):>12}"
        if compiled:
            text += f"{_n(got):>18}{_ratio(ratio):>9}"
        lines.append(text)

    row("params", mem["params"], state.get("params"), state["params"] / mem["params"] if state else None)
    row("grads", mem["grads"])
    row("optimizer state (+ fp32 master)", mem["opt_state"])
    if mem.get("fp8_history"):
        row("FP8 amax history", mem["fp8_history"])
    row(
        "params + optimizer state" + (" + history" if mem.get("fp8_history") else ""),
        mem["params"] + mem["opt_state"] + mem.get("fp8_history", 0),
        state.get("params_plus_opt_state"),
        state.get("ratio"),
    )
    row(f"model state, {mem['expression']}", mem["model_state"])
    experts = p.get("experts")
    if experts:
        row(f"  of which experts ({experts['experts_per_device']} of {experts['num_experts']})", mem["expert_state"])
    row("activations (saved for the backward)", mem["activations"])
    row("total: model state + activations", mem["total"])
    row("temp estimate (XLA temp)", mem["temp_estimate"]["total"], temp.get("compiled"), temp.get("ratio"))
    row("peak estimate: params + opt + temp", mem["peak_estimate"])
    if compiled:
        ma = compiled["memory_analysis"]
        lines.append(
            f"  XLA memory_analysis: arguments {ma['argument_bytes']:,}, outputs {ma['output_bytes']:,} "
            f"(aliased {ma['alias_bytes']:,}), temp {ma['temp_bytes']:,}; compiled in "
            f"{compiled['compile_seconds']:.1f} s. params + optimizer state = arguments - batch - "
            f"{state['scalars']} B of 0-d counters."
        )
    t = mem["temp_estimate"]
    lines += [
        (
            f"  temp estimate = activations + the larger of one layer's attention scores in memory "
            f"{t['attention_working']:,} ({_attention_note(p)}) and the head's fp32 "
            f"logits gradient {t['head_working']:,} + one layer's full-size gradients {t['layer_grads']:,} + fp32 "
            f"gradient accumulators "
            f"{t['grad_accumulators']:,} + gradient outputs {t['grad_outputs']:,} + gathered weights "
            f"{t['gathered_weights']:,}"
            + (
                f" + chunk-order copies of the stage's layers and their gradients {t['chunk_order']:,} "
                f"(virtual stages: interleaved 1F1B, zb-v; or an uneven split's stage layout)"
                if t.get("chunk_order")
                else ""
            )
            + " (jaxpar.analysis.planner.plan.temp_bytes)"
            + (
                f"; or, if larger, the moment of one MoE block's backward {t['moe_moment']:,}: its working set "
                f"{t['moe_working']:,} beside the activations, accumulators, gathered weights and chunk-order "
                f"parameters (jaxpar.analysis.planner.experts.working_bytes)"
                if t.get("moe_moment")
                else ""
            )
        ),
        f"  activations: {mem['activation_formula']}",
        (
            f"  Korthikanti et al. 2022 (arXiv 2205.05198, Table 2; 16-bit) for the same layers in flight: "
            f"{_n(mem['korthikanti_activations'])} B ({human_bytes(mem['korthikanti_activations'])})"
        ),
        "",
    ]
    lines += _collective_lines(p, compiled)
    if measured:
        mfu = "n/a (peak unknown)" if measured["mfu"] is None else f"{measured['mfu']:.3f}"
        lines += [
            "",
            (
                f"  measured over {measured['steps']} steps on {measured['device_kind']}: "
                f"{measured['step_time_s'] * 1e3:.1f} ms/step, {measured['tokens_per_s']:,.0f} tokens/s, "
                f"MFU {mfu}, peak memory {_n(measured['peak_memory_bytes'])} B"
            ),
        ]
    return "\n".join(lines)


def _attention_note(p: dict) -> str:
    """What the temp line's attention term is, by the plan's attention implementation."""
    context = p.get("context_parallel") or {}
    if context.get("size", 1) > 1 and p["attention"] == "cudnn":
        return (
            f"context attention {context['strategy']} on cuDNN's fused kernel: no scores in memory, the keys and "
            "values in flight (jaxpar.analysis.planner.context)"
        )
    if context.get("size", 1) > 1:
        return (
            f"context attention {context['strategy']}: the whole sequence's scores [b, H/t, r, s] in fp32 "
            "with their masks, and the keys and values in flight (jaxpar.analysis.planner.context)"
        )
    return f"attention {p['attention']}: XLA's path writes them, cuDNN's fused kernel does not"


def _collective_lines(p: dict, compiled: dict | None) -> list[str]:
    lines = [
        f"  collectives per step (bytes sent per device, ring formulas; jaxpar.analysis.planner.comm) planned for "
        f"{p['platform']}" + (", beside the compiled executable's" if compiled else "")
    ]
    head = f"  {'mesh axes':<21}{'collective':<20}{'planned bytes':>19}{'ops':>8}"
    if compiled:
        head += f"{'compiled bytes':>20}{'ops':>8}{'ratio':>9}"
        rows = [
            (r["key"], r["planned_bytes"], r["planned_count"], r["compiled_bytes"], r["compiled_count"], r["ratio"])
            for r in compiled["collectives"]
        ]
    else:
        counts: dict = {}
        for c in p["collectives"]:
            key = f"{','.join(c['axes'])} {c['kind']}"
            counts[key] = counts.get(key, 0) + c["count"]
        rows = [(k, v, counts[k], None, None, None) for k, v in sorted(p["by_axis"].items())]
    lines.append(head)
    for key, planned, pc, got, gc, ratio in rows:
        axes, kind = key.split(" ", 1)
        text = f"  {axes:<21}{kind:<20}{_n(planned):>19}{pc:>8}"
        if compiled:
            text += f"{_n(got):>20}{gc:>8}{_ratio(ratio):>9}"
        lines.append(text)
    if not rows:
        lines.append("  (none: one device, or every axis of size 1)")
    if compiled:
        lines += _hlo_reading_note(compiled["collectives"])
        s = compiled["scalars"]
        lines.append(
            f"  + scalar all-reduces (loss, token count, grad-norm/finite partial sums, FP8 amaxes), not planned: "
            f"{s['count']} ops, {s['bytes']:,.0f} B over {', '.join(s['axes']) or '-'}"
        )
        lines.append("  (ops: XLA combines small reductions, so compiled op counts can be lower at equal bytes)")
        lines += _partitioned_lines(compiled.get("partitioned"), p["pipeline"]["stages"] > 1)
    lines.append("  terms:")
    for c in p["collectives"]:
        lines.append(
            f"    {','.join(c['axes']):<16}{c['kind']:<20}{c['name']:<48} x{c['count']:<6} "
            f"S={c['size_bytes']:,.0f} B, n={c['group_size']}"
        )
    return lines


def _hlo_reading_note(rows: list[dict]) -> list[str]:
    """Where the plan and the HLO reading count differently (interleaved 1F1B's edge conds), how much and why."""
    extra = sum(r.get("planned_hlo_bytes", r["planned_bytes"]) - r["planned_bytes"] for r in rows)
    if not extra:
        return []
    return [
        f"  (interleaved 1F1B: the HLO is read statically, so the embedding's and head's collectives count in every "
        f"tick that evaluates their cond, m*v+p-1 and m*v+p-v*p, where the first and last stage run them in m+p-1 "
        f"and m; the ratio compares with the plan counted that way, {_n(extra)} B above the planned bytes)"
    ]


def _partitioned_lines(part: dict | None, pipeline: bool) -> list[str]:
    """The partitioned program's collectives beside the plan for the target (`jaxpar.analysis.planner.compiled`)."""
    if part is None:
        return ["  partitioned program: not available (no XLA dump was written: a compilation-cache hit?)"]
    lines = [
        (
            f"  the partitioned program (HLO after XLA's SPMD partitioner, before any backend pass: what a "
            f"{part['platform']} compiler receives) beside the plan for {part['platform']} at compute "
            f"{part['compute_dtype']}"
        ),
        f"  {'mesh axes':<21}{'collective':<20}{'planned bytes':>19}{'ops':>8}{'program bytes':>20}{'ops':>8}"
        f"{'ratio':>9}",
    ]
    for r in part["collectives"]:
        axes, kind = r["key"].split(" ", 1)
        lines.append(
            f"  {axes:<21}{kind:<20}{_n(r['planned_bytes']):>19}{r['planned_count']:>8}"
            f"{_n(r['compiled_bytes']):>20}{r['compiled_count']:>8}{_ratio(r['ratio']):>9}"
        )
    lines += _hlo_reading_note(part["collectives"])
    if pipeline:
        lines.append(
            "  (pipeline: the partitioned program still holds loop-invariant weight gathers and unread "
            "shifts that every backend's simplifier hoists or drops later; the plan counts after that)"
        )
    return lines


def format_gpu_target(target: dict, gpu: dict | None = None) -> str:
    """The GPU cluster a plan is for and, when compiled, what XLA's GPU compiler decided, beside the plan.

    Args:
      target: the CLI's {"cluster", "device_kind", "devices", "memory_bytes" (per GPU), "usable_bytes" (the
        share a jax process may use), "planned_peak_bytes", "planned_fraction_of_memory", "planned_fits"}.
      gpu: `jaxpar.analysis.gpu.deviceless.compile_for_gpu`'s result, or None (plan only).
    """
    mem = target["memory_bytes"]
    lines = [
        "",
        (
            f"  target {target['cluster']}: {target['devices']} x {target['device_kind']}, "
            f"{human_bytes(mem)} each; planned peak {human_bytes(target['planned_peak_bytes'])} = "
            f"{_pct(target['planned_fraction_of_memory'])} of it "
            f"({'fits' if target['planned_fits'] else 'DOES NOT FIT'} in the "
            f"{_pct(target['usable_bytes'] / mem)} a jax process may use)"
        ),
    ]
    if gpu is None:
        lines.append("  (--compile compiles the step for it with XLA's GPU compiler, no GPU needed)")
        return "\n".join(lines)
    m = gpu["memory"]
    mesh = " ".join(f"{a}={s}" for a, s in gpu["mesh"].items())
    lines += [
        (
            f"  compiled for {gpu['cluster']} by XLA's GPU compiler without GPUs (jaxpar.analysis.gpu.deviceless): "
            f"mesh {mesh}, compute {gpu['compute_dtype']}, {gpu['compile_seconds']:.1f} s"
        ),
        f"  {'GPU memory per device':<38}{'compiled bytes':>18}{'':>12}",
    ]
    for name, key in (
        ("arguments", "argument_bytes"),
        ("outputs", "output_bytes"),
        ("aliased (outputs in arguments)", "alias_bytes"),
        ("temporaries", "temp_bytes"),
        ("peak", "peak_bytes"),
    ):
        lines.append(f"  {name:<38}{_n(m[key]):>18}{human_bytes(m[key]):>12}")
    lines.append(
        f"  peak compiled / planned: {human_bytes(m['peak_bytes'])} / "
        f"{human_bytes(gpu['planned']['peak_bytes'])} = "
        f"{_ratio(gpu['planned']['ratio'])}"
    )
    verdict = "fits" if gpu["fits"] else "DOES NOT FIT"
    lines.append(
        f"  {verdict}: peak {human_bytes(m['peak_bytes'])} = {_pct(gpu['fraction_of_memory'])} of the "
        f"{human_bytes(gpu['memory_bytes'])} of one {gpu['device_kind']} (a jax process may use "
        f"{_pct(gpu['usable_bytes'] / gpu['memory_bytes'])}: XLA_PYTHON_CLIENT_MEM_FRACTION as "
        f"tools/slurm_gpu.sbatch sets it)"
    )
    fused = gpu["fused_attention"]
    scores = gpu["attention_scores"]
    lines.append(
        f"  fused attention (cuDNN): {'yes, ' + ', '.join(fused) if fused else 'no (XLA attention path)'}; "
        f"attention scores materialised: "
        + (
            f"yes, largest {human_bytes(scores['largest_bytes'])} per device ({', '.join(scores['shapes'])})"
            if scores["materialised"]
            else "no"
        )
    )
    lines += _overlap_lines(gpu.get("overlap"))
    lines += [
        "  collectives per step of the GPU HLO (bytes sent per device, ring formulas) beside the plan for gpu",
        (
            f"  {'mesh axes':<21}{'collective':<20}{'planned bytes':>19}{'ops':>8}{'GPU HLO bytes':>20}"
            f"{'ops':>8}{'ratio':>9}"
        ),
    ]
    for r in gpu["planned"]["collectives"]:
        axes, kind = r["key"].split(" ", 1)
        lines.append(
            f"  {axes:<21}{kind:<20}{_n(r['planned_bytes']):>19}{r['planned_count']:>8}"
            f"{_n(r['compiled_bytes']):>20}{r['compiled_count']:>8}{_ratio(r['ratio']):>9}"
        )
    if not gpu["planned"]["collectives"]:
        lines.append("  (none: one device, or every axis of size 1)")
    lines += _hlo_reading_note(gpu["planned"]["collectives"])
    s = gpu["scalars"]
    lines.append(
        f"  + scalar all-reduces, not planned: {s['count']} ops, {s['bytes']:,.0f} B over {', '.join(s['axes']) or '-'}"
    )
    return "\n".join(lines)


_DIRECTION = {"up": "to the next stage", "down": "to the previous stage"}


def _overlap_lines(overlap: dict | None) -> list[str]:
    """The GPU schedule's collectives under compute (`jaxpar.analysis.gpu.deviceless.overlap_report`)."""
    if not overlap or not overlap["by_kind"]:
        return []
    kinds = ", ".join(
        f"{kind} {d['overlapped']} of {d['count']} ({d['under_gemm']} under a GEMM)"
        for kind, d in sorted(overlap["by_kind"].items())
    )
    lines = [f"  asynchronous collectives with kernels between start and done (scheduled GPU HLO): {kinds}"]
    for r in overlap["pipeline_permutes"]:
        lines.append(
            f"    pipeline tick loop of {r['trips']} trips: {r['name']} ({_DIRECTION.get(r['direction'], '?')}) "
            f"under {r['compute']} kernels, {r['gemms']} with GEMMs"
        )
    return lines


def format_exercise(ex: dict, acts: dict) -> str:
    """The seed exercise (`jaxpar.analysis.planner.plan.zero_exercise`) and what activations add (`acts`, built by the
    CLI)."""
    names = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
    p, n = ex["n_params"], ex["devices"]
    lines = [
        (
            f"Seed exercise: P = {p / 1e9:g}e9 parameters on N = {n} devices, {ex['layout']} layout (bf16 params 2 + "
            f"bf16 grads 2 + fp32 master, Adam m, v 12 = 16 bytes per parameter; ZeRO, Rajbhandari et al. 2019, "
            f"section 3). Model state per device:"
        )
    ]
    for s in ex["stages"]:
        formula = s["expression"].split(": ", 1)[1]
        lines.append(f"  {names[s['zero_stage']]:<8}{formula:<14}{human_bytes(s['bytes']):>9}")
    lines.append(
        f"Smallest N with ZeRO-3 model state <= {human_bytes(ex['budget_bytes'])}: N = "
        f"{ex['smallest_devices_zero3']} ({human_bytes(ex['zero3_bytes_at_smallest'])} per device)."
    )
    lines += [
        "",
        (
            f"Activations on top ({acts['config']}: P = {acts['n_params'] / 1e9:.4g}e9, L = {acts['layers']}, "
            f"h = {acts['d_model']}, a = {acts['heads']}, s = {acts['seq_len']}, one sequence per device, "
            f"16-bit):"
        ),
        (
            f"  Korthikanti et al. 2022 (arXiv 2205.05198, Table 2), no recomputation, sbhL(34 + 5as/h): "
            f"{human_bytes(acts['korthikanti_none'])}"
        ),
        (
            f"  full recomputation, 2sbhL: {human_bytes(acts['korthikanti_full'])}, plus the recomputed layer's "
            f"sbh(34 + 5as/h) = {human_bytes(acts['one_layer'])} while it runs"
        ),
        (
            f"  jaxpar, remat=full (block inputs, embedding output, logits): "
            f"{human_bytes(acts['jaxpar_activations'])}; "
            + (
                f"with cuDNN's fused attention (model.attention auto or cudnn on a GPU) the backward "
                f"keeps no attention scores; on XLA's attention path (model.attention xla) each layer's "
                f"backward would also hold them, 12 bytes per score element: "
                f"{human_bytes(acts['attention_working_xla_at_smallest'])}"
                if acts["attention"] == "cudnn"
                else f"the backward of each layer also holds its attention scores on XLA's attention path, 12 "
                f"bytes per score element: {human_bytes(acts['attention_working_at_smallest'])}"
            )
        ),
        (
            f"  At N = {ex['smallest_devices_zero3']} the model state leaves "
            f"{human_bytes(ex['budget_bytes'] - ex['zero3_bytes_at_smallest'])}: too little for activations "
            f"even with full recomputation and one sequence per device."
        ),
        (
            f"  Smallest N for model state + jaxpar activations <= {human_bytes(ex['budget_bytes'])}: "
            f"{acts['fit_state_acts']}; with jaxpar's peak estimate (params, optimizer state, activations, "
            f"attention scores, gradients, gathered weights): {acts['fit_temp']}; and N dividing d_model = "
            f"{acts['d_model']} (jaxpar shards along embed): {acts['fit_temp_shardable']}."
        ),
        (
            "  So ~9 consumer 24 GB GPUs hold the model state, but training needs about "
            f"{acts['fit_temp']} or more, with ZeRO-3's all-gathers and reduce-scatters (1.5x DDP volume) over "
            "PCIe: possible on commodity hardware, slow."
        ),
    ]
    return "\n".join(lines)
