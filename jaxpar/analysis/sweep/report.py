"""Sweep outputs: points ranked by the objective, a Markdown table (results.md) and a plot (plot.png).

Bytes are per device. "peak" is, for a sweep with a GPU `target`, XLA's GPU compiler's peak for that cluster
(`jaxpar.analysis.sweep.gpu`); else XLA's arguments + outputs - aliased + temp for a point compiled on simulated CPU
devices; else the plan's peak estimate (params + optimizer state + temp estimate, `jaxpar.analysis.planner.plan`).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable

from jaxpar.config.extras import require
from jaxpar.config.mesh_axes import CONTEXT, DATA, FSDP, PIPELINE, TENSOR
from jaxpar.config.paths import write_atomic
from jaxpar.log import human_bytes

# What a sweep can rank its points by, and whether lower or higher is better; the measured ones need timed steps.
OBJECTIVES = {"memory": "min", "comm_bytes": "min", "tokens_per_s": "max", "step_time": "min", "mfu": "max"}
MEASURED_OBJECTIVES = ("tokens_per_s", "step_time", "mfu")
PLOT_FEATURE = "a sweep's plot.png"


def peak_bytes(rec: dict) -> float | None:
    """The GPU-compiled peak if the point was compiled for a GPU target, else the compiled peak if it was
    compiled, else the planned peak estimate; None without a plan."""
    if rec.get("gpu_compiled"):
        return rec["gpu_compiled"]["peak_bytes"]
    if rec.get("compiled"):
        return rec["compiled"]["peak_bytes"]
    return rec["planned"]["peak_estimate"] if rec.get("planned") else None


def objective_value(rec: dict, objective: str) -> float | None:
    """The number a point is ranked by (see `OBJECTIVES`); None if the point has none."""
    if objective == "memory":
        return peak_bytes(rec)
    if objective == "comm_bytes":  # the plan for the sweep's platform (jaxpar.analysis.sweep.run); compiling checks it
        return rec["planned"]["target_comm_bytes"] if rec.get("planned") else None
    measured = rec.get("measured") or {}
    key = "step_time_s" if objective == "step_time" else objective
    return measured.get(key)


def ranked(records: list[dict], objective: str) -> list[tuple[int | None, dict]]:
    """(rank, record): points with status ok and a value first, best first; the rest after, unranked."""
    scored = [(v, r) for r in records if r["status"] == "ok" and (v := objective_value(r, objective)) is not None]
    scored.sort(key=lambda vr: vr[0], reverse=OBJECTIVES[objective] == "max")
    good = [r for _, r in scored]
    rest = [r for r in records if not any(r is g for g in good)]
    return [(i + 1, r) for i, r in enumerate(good)] + [(None, r) for r in rest]


def varied(rec: dict) -> str:
    """The point's non-mesh overrides, e.g. `optimizer.zero_stage=3`."""
    return " ".join(o for o in rec["overrides"] if not o.startswith("mesh.")) or "-"


def label(rec: dict) -> str:
    """Short plot label: `d4 f2 t1 p1` plus the varied values."""
    m = rec["mesh"]
    short = " ".join(o.split(".")[-1] for o in rec["overrides"] if not o.startswith("mesh."))
    return f"d{m[DATA]} f{m[FSDP]} t{m[TENSOR]} p{m[PIPELINE]}" + (f"\n{short}" if short else "")


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.3g}%"


def _attention(gpu: dict) -> str:
    if gpu.get("fused_attention"):
        return "fused (cuDNN)"
    if gpu.get("scores_materialised"):
        return f"scores materialised ({human_bytes(gpu['largest_scores_bytes'])})"
    return "-" if not gpu else "XLA, no scores"


def _columns(header: dict) -> list[tuple[str, str, Callable[[dict], str]]]:
    """(heading, alignment, cell) of each results.md column after rank, mesh, varied and status."""

    def planned(r):
        return r.get("planned") or {}

    def comp(r):
        return r.get("compiled") or {}

    def gpu(r):
        return r.get("gpu_compiled") or {}

    bubble = ("bubble", "---:", lambda r: _f(planned(r).get("bubble"), "{:.3f}"))
    if header.get("target"):
        memory = header["target"]["memory_bytes"]
        return [
            bubble,
            ("planned peak", "---:", lambda r: human_bytes(planned(r).get("peak_estimate"))),
            ("GPU peak", "---:", lambda r: human_bytes(gpu(r).get("peak_bytes"))),
            ("GPU / planned peak", "---:", lambda r: _f(gpu(r).get("peak_ratio"), "{:.3f}")),
            ("of GPU memory", "---:", lambda r: _pct(None if peak_bytes(r) is None else peak_bytes(r) / memory)),
            ("fits", "---", lambda r: "-" if not gpu(r) else ("yes" if gpu(r)["fits"] else "no")),
            ("GPU temp", "---:", lambda r: human_bytes(gpu(r).get("temp_bytes"))),
            ("attention", "---", lambda r: _attention(gpu(r))),
            ("comm/step planned", "---:", lambda r: human_bytes(planned(r).get("target_comm_bytes"))),
            ("GPU HLO comm/step", "---:", lambda r: human_bytes(gpu(r).get("comm_bytes"))),
            ("GPU comm ratio", "---:", lambda r: _f(gpu(r).get("comm_ratio"), "{:.3f}")),
        ]

    def step_ms(r):
        step = (r.get("measured") or {}).get("step_time_s")
        return _f(None if step is None else step * 1e3, "{:.1f}")

    return [
        bubble,
        ("planned peak", "---:", lambda r: human_bytes(planned(r).get("peak_estimate"))),
        ("compiled peak", "---:", lambda r: human_bytes(comp(r).get("peak_bytes"))),
        ("state ratio", "---:", lambda r: _f(comp(r).get("state_ratio"), "{:.4f}")),
        ("comm/step planned", "---:", lambda r: human_bytes(planned(r).get("target_comm_bytes"))),
        ("comm ratio", "---:", lambda r: _f(comp(r).get("comm_ratio"), "{:.3f}")),
        ("partitioned ratio", "---:", lambda r: _f(comp(r).get("partitioned_comm_ratio"), "{:.3f}")),
        ("tokens/s", "---:", lambda r: _f((r.get("measured") or {}).get("tokens_per_s"), "{:,.0f}")),
        ("step ms", "---:", step_ms),
        ("MFU", "---:", lambda r: _f((r.get("measured") or {}).get("mfu"), "{:.3f}")),
    ]


def _expert_columns() -> list[tuple[str, str, Callable[[dict], str]]]:
    """The MoE columns (`jaxpar.analysis.sweep.run._planned_summary`): the expert axes and the planned all-to-all
    bytes per device and step (dispatch and combine, `jaxpar.analysis.planner.comm`)."""

    def planned(r):
        return r.get("planned") or {}

    def axes(r):
        value = planned(r).get("expert_axes")
        return "-" if value is None else ",".join(value) or "none"

    return [
        ("expert axes", "---", axes),
        ("all-to-all/step planned", "---:", lambda r: human_bytes(planned(r).get("all_to_all_bytes"))),
    ]


def _explanation(header: dict) -> str:
    t = header.get("target")
    if t:
        return (
            f"Compiled for **{t['cluster']}** ({t['devices']} x {t['device_kind']}, "
            f"{human_bytes(t['memory_bytes'])} each) by XLA's GPU compiler on this machine, without GPUs "
            f"(`jaxpar.analysis.gpu.deviceless`; no autotuning): bubble: the pipeline's planned idle share, "
            f"(p - 1)/(v*m + p - 1); "
            f"the GPU peak, temp, fits, attention and GPU HLO columns are the GPU compiler's, per device; a "
            f"point is ranked by the GPU peak for the memory objective and marked over budget when that peak "
            f"exceeds the budget or does not fit one GPU. Planned: the plan for platform gpu "
            f"(`jaxpar.analysis.planner.plan`). "
            f"Attention: fused (a cuDNN kernel) or XLA's path with its score tensors materialised (the largest "
            f"per device). Comm: bytes sent per device per step (ring formulas); GPU comm ratio: the GPU "
            f"program's / the plan's."
        )
    return (
        "Bubble: the pipeline's idle share of each device's step, (p - 1)/(v*m + p - 1) with v virtual stages "
        "(`pipeline.virtual_stages`; 0 without a pipeline), or the schedule table's for zb-h1 and zb-v, planned. "
        "Bytes per device. Peak: XLA's arguments + outputs - aliased + temp when compiled, else the plan's "
        "estimate. State ratio: compiled / planned params + optimizer state. Comm: bytes sent per device per "
        "step (ring formulas) planned for the sweep's platform; comm ratio: the compiled executable's / the "
        "plan for the platform it was compiled on (cpu on simulated devices); partitioned ratio: the "
        "partitioned program's (before any backend pass) / the plan for the sweep's platform (above 1 for "
        "pipeline layouts by the gathers and shifts that the backends' simplifier removes later)."
    )


def write_markdown(path: str, header: dict, records: list[dict]) -> None:
    """results.md: one table row per point, ranked by the objective, then notes for points not ok. With a GPU
    `target` (header "target") the compiled columns are the GPU compiler's for that cluster."""
    objective = header["objective"]
    better = "lower" if OBJECTIVES[objective] == "min" else "higher"
    budget = header["budget_bytes"]
    columns = _columns(header)
    if any((r.get("planned") or {}).get("expert_axes") is not None for r in records):  # an MoE model
        columns += _expert_columns()
    lines = [
        f"# Sweep: {os.path.basename(header['sweep'])}",
        "",
        (
            f"Base config `{header['base']}`; objective **{objective}** ({better} is better); memory budget "
            f"{human_bytes(budget) if budget else 'none'} per device; measured steps per point: "
            f"{header['measure_steps']}."
        ),
        _explanation(header),
        "",
        "| rank | data | fsdp | tensor | pipeline | context | varied | status | "
        + " | ".join(c[0] for c in columns)
        + " |",
        "|---:|---:|---:|---:|---:|---:|---|---|" + "|".join(c[1] for c in columns) + "|",
    ]
    notes = []
    for rank, r in ranked(records, objective):
        m = r["mesh"]
        lines.append(
            f"| {rank or '-'} | {m[DATA]} | {m[FSDP]} | {m[TENSOR]} | {m[PIPELINE]} | {m.get(CONTEXT, 1)} | "
            f"{varied(r)} | {r['status'].replace('_', ' ')} | " + " | ".join(cell(r) for _, _, cell in columns) + " |"
        )
        if r["error"]:
            notes.append(f"- `{' '.join(r['overrides'])}` ({r['status']}): {r['error'].splitlines()[-1]}")
    if notes:
        lines += ["", "Points not ranked:", *notes]
    write_atomic(path, "\n".join(lines) + "\n")  # a kill mid-write leaves the previous results.md


def write_plot(path: str, header: dict, records: list[dict], max_points: int = 32) -> None:
    """plot.png (matplotlib, Agg): per point (the `max_points` best by the objective), throughput (tokens/s
    when measured, else communication bytes per step, planned beside compiled, both for the platform the point was
    compiled on: results.md's planned column is for the sweep's platform, which the title then names) on top and
    memory per device (planned and compiled peak, budget line) below; the bars of points over budget or failed
    are hatched. With a GPU `target` (header "target") the compiled bars are the GPU compiler's for that cluster,
    and a line marks one GPU's memory.

    Raises:
      jaxpar.config.extras.MissingExtra: matplotlib (the `plot` extra) is not installed.
    """
    matplotlib = require("matplotlib", PLOT_FEATURE)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for _, r in ranked(records, header["objective"]) if r.get("planned")]
    shown = f"best {max_points} of {len(recs)} points" if len(recs) > max_points else f"{len(recs)} points"
    recs = recs[:max_points]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(min(24.0, max(7.0, 0.6 * len(recs) + 2)), 8), sharex=True)
    x = list(range(len(recs)))
    gpu_target = header.get("target")
    compiled_key = "gpu_compiled" if gpu_target else "compiled"
    by = f"XLA GPU compiler, {gpu_target['cluster']}" if gpu_target else "XLA"

    def unit(values):
        """One decimal unit for a whole plot axis (`human_bytes` formats one value; an axis needs one scale)."""
        scale = 1e9 if max(values, default=0) >= 1e9 else 1e6
        return scale, "GB" if scale == 1e9 else "MB"

    def mark_not_ok(bars):
        """Hatches the bars of the points that are over budget or failed."""
        for bar, r in zip(bars, recs):
            if r["status"] != "ok":
                bar.set_hatch("//")

    comm_note = ""
    if any(r.get("measured") for r in recs):
        mark_not_ok(top.bar(x, [(r.get("measured") or {}).get("tokens_per_s") or 0 for r in recs]))
        top.set_ylabel("tokens/s (measured)")
    else:
        # The plan for the platform the compiled bars come from, so each pair compares like with like:
        # results.md's "comm/step planned" column is the plan for the sweep's platform.
        plan_key = "target_comm_bytes" if gpu_target else "comm_bytes"
        platform = "gpu" if gpu_target else (recs[0]["planned"].get("platform", "cpu") if recs else "cpu")
        planned = [r["planned"][plan_key] for r in recs]
        compiled = [(r.get(compiled_key) or {}).get("comm_bytes", 0) for r in recs]
        scale, name = unit(planned + compiled)
        mark_not_ok(top.bar([i - 0.2 for i in x], [v / scale for v in planned], 0.4, label=f"planned for {platform}"))
        mark_not_ok(
            top.bar(
                [i + 0.2 for i in x],
                [v / scale for v in compiled],
                0.4,
                label="GPU HLO" if gpu_target else f"compiled HLO ({platform})",
            )
        )
        top.set_ylabel(f"communication per step per device ({name})")
        top.legend()
        if not gpu_target and header.get("platform") != platform:
            comm_note = f"; results.md's planned comm is the plan for {header.get('platform')}"
    where = (
        f"compiled for {gpu_target['cluster']} ({gpu_target['devices']} x {gpu_target['device_kind']}) by "
        f"XLA's GPU compiler, without GPUs\n"
        if gpu_target
        else ""
    )
    hatched = "hatched: over budget or failed" if any(r["status"] != "ok" for r in recs) else ""
    top.set_title(
        f"{os.path.basename(header['sweep'])}: {shown}, ranked by {header['objective']}\n"
        f"{where}{'; '.join(t for t in (hatched, comm_note.removeprefix('; ')) if t)}",
        fontsize=10,
    )
    planned = [r["planned"]["peak_estimate"] for r in recs]
    compiled = [(r.get(compiled_key) or {}).get("peak_bytes", 0) for r in recs]
    memory = gpu_target["memory_bytes"] if gpu_target else 0
    scale, name = unit(planned + compiled + [header["budget_bytes"] or 0, memory])
    mark_not_ok(
        bottom.bar([i - 0.2 for i in x], [v / scale for v in planned], 0.4, label="planned peak", color="tab:orange")
    )
    mark_not_ok(
        bottom.bar(
            [i + 0.2 for i in x], [v / scale for v in compiled], 0.4, label=f"compiled peak ({by})", color="tab:green"
        )
    )
    if header["budget_bytes"]:
        bottom.axhline(header["budget_bytes"] / scale, color="tab:red", linestyle="--", label="budget")
    if gpu_target:
        bottom.axhline(
            memory / scale, color="tab:purple", linestyle=":", label=f"memory of one GPU ({human_bytes(memory)})"
        )
    bottom.set_ylabel(f"memory per device ({name})")
    bottom.set_xticks(x)
    bottom.set_xticklabels([label(r) for r in recs], fontsize=7, rotation=90 if len(recs) > 12 else 0)
    bottom.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    write_atomic(path, png.getvalue())
