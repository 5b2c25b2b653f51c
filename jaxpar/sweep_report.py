"""Sweep outputs: points ranked by the objective, a Markdown table (results.md) and a plot (plot.png).

Bytes are per device. "peak" is XLA's arguments + outputs - aliased + temp for a compiled point, else the plan's
peak estimate (params + optimizer state + temp estimate, `jaxpar.plan`).
"""
from __future__ import annotations

import os

from jaxpar.sweep import OBJECTIVES

_UNITS = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def human_bytes(x: float | None) -> str:
    """Decimal units, 4 significant digits: `26 GB`, `431.4 kB`, `-` for None."""
    if x is None:
        return "-"
    for unit, scale in _UNITS:
        if abs(x) >= scale:
            return f"{x / scale:.4g} {unit}"
    return f"{x:.0f} B"


def peak_bytes(rec: dict) -> float | None:
    """Compiled peak if the point was compiled, else the planned peak estimate; None without a plan."""
    if rec.get("compiled"):
        return rec["compiled"]["peak_bytes"]
    return rec["planned"]["peak_estimate"] if rec.get("planned") else None


def objective_value(rec: dict, objective: str) -> float | None:
    """The number a point is ranked by (see `jaxpar.sweep.OBJECTIVES`); None if the point has none."""
    if objective == "memory":
        return peak_bytes(rec)
    if objective == "comm_bytes":  # the plan for the sweep's platform (jaxpar.sweep); compiling checks it
        return rec["planned"]["target_comm_bytes"] if rec.get("planned") else None
    measured = rec.get("measured") or {}
    key = "step_time_s" if objective == "step_time" else objective
    return measured.get(key)


def ranked(records: list[dict], objective: str) -> list[tuple[int | None, dict]]:
    """(rank, record): points with status ok and a value first, best first; the rest after, unranked."""
    good = [r for r in records if r["status"] == "ok" and objective_value(r, objective) is not None]
    good.sort(key=lambda r: objective_value(r, objective), reverse=OBJECTIVES[objective] == "max")
    rest = [r for r in records if not any(r is g for g in good)]
    return [(i + 1, r) for i, r in enumerate(good)] + [(None, r) for r in rest]


def varied(rec: dict) -> str:
    """The point's non-mesh overrides, e.g. `optimizer.zero_stage=3`."""
    return " ".join(o for o in rec["overrides"] if not o.startswith("mesh.")) or "-"


def label(rec: dict) -> str:
    """Short plot label: `d4 f2 t1 p1` plus the varied values."""
    m = rec["mesh"]
    short = " ".join(o.split(".")[-1] for o in rec["overrides"] if not o.startswith("mesh."))
    return f"d{m['data']} f{m['fsdp']} t{m['tensor']} p{m['pipeline']}" + (f"\n{short}" if short else "")


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def write_markdown(path: str, header: dict, records: list[dict]) -> None:
    """results.md: one table row per point, ranked by the objective, then notes for points not ok."""
    objective = header["objective"]
    better = "lower" if OBJECTIVES[objective] == "min" else "higher"
    budget = header["budget_bytes"]
    lines = [f"# Sweep: {os.path.basename(header['sweep'])}", "",
             (f"Base config `{header['base']}`; objective **{objective}** ({better} is better); memory budget "
             f"{human_bytes(budget) if budget else 'none'} per device; measured steps per point: "
             f"{header['measure_steps']}."),
             ("Bytes per device. Peak: XLA's arguments + outputs - aliased + temp when compiled, else the plan's "
             "estimate. State ratio: compiled / planned params + optimizer state. Comm: bytes sent per device per "
             "step (ring formulas) planned for the sweep's platform; comm ratio: the compiled executable's / the "
             "plan for the platform it was compiled on (cpu on simulated devices); partitioned ratio: the "
             "partitioned program's (before any backend pass) / the plan for the sweep's platform (above 1 for "
             "pipeline layouts by the gathers and shifts that the backends' simplifier removes later)."), "",
             ("| rank | data | fsdp | tensor | pipeline | varied | status | planned peak | compiled peak | "
             "state ratio | comm/step planned | comm ratio | partitioned ratio | tokens/s | step ms | MFU |"),
             "|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for rank, r in ranked(records, objective):
        m, planned, comp, meas = r["mesh"], r.get("planned") or {}, r.get("compiled") or {}, r.get("measured") or {}
        step = meas.get("step_time_s")
        lines.append(
            f"| {rank or '-'} | {m['data']} | {m['fsdp']} | {m['tensor']} | {m['pipeline']} | {varied(r)} | "
            f"{r['status'].replace('_', ' ')} | {human_bytes(planned.get('peak_estimate'))} | "
            f"{human_bytes(comp.get('peak_bytes'))} | {_f(comp.get('state_ratio'), '{:.4f}')} | "
            f"{human_bytes(planned.get('target_comm_bytes'))} | {_f(comp.get('comm_ratio'), '{:.3f}')} | "
            f"{_f(comp.get('partitioned_comm_ratio'), '{:.3f}')} | "
            f"{_f(meas.get('tokens_per_s'), '{:,.0f}')} | {_f(None if step is None else step * 1e3, '{:.1f}')} | "
            f"{_f(meas.get('mfu'), '{:.3f}')} |")
        if r["error"]:
            notes.append(f"- `{' '.join(r['overrides'])}` ({r['status']}): {r['error'].splitlines()[-1]}")
    if notes:
        lines += ["", "Points not ranked:", *notes]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def write_plot(path: str, header: dict, records: list[dict], max_points: int = 32) -> None:
    """plot.png (matplotlib, Agg): per point (the `max_points` best by the objective), throughput (tokens/s
    when measured, else communication bytes per step) on top and memory per device (planned and compiled
    peak, budget line) below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for _, r in ranked(records, header["objective"]) if r.get("planned")]
    shown = f"best {max_points} of {len(recs)} points" if len(recs) > max_points else f"{len(recs)} points"
    recs = recs[:max_points]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(min(24.0, max(7.0, 0.6 * len(recs) + 2)), 8), sharex=True)
    x = list(range(len(recs)))
    colors = ["tab:blue" if r["status"] == "ok" else "tab:gray" for r in recs]

    def unit(values):
        scale = 1e9 if max(values, default=0) >= 1e9 else 1e6
        return scale, "GB" if scale == 1e9 else "MB"

    if any(r.get("measured") for r in recs):
        top.bar(x, [(r.get("measured") or {}).get("tokens_per_s") or 0 for r in recs], color=colors)
        top.set_ylabel("tokens/s (measured)")
    else:
        planned = [r["planned"]["comm_bytes"] for r in recs]
        compiled = [(r.get("compiled") or {}).get("comm_bytes", 0) for r in recs]
        scale, name = unit(planned + compiled)
        top.bar([i - 0.2 for i in x], [v / scale for v in planned], 0.4, label="planned")
        top.bar([i + 0.2 for i in x], [v / scale for v in compiled], 0.4, label="compiled HLO")
        top.set_ylabel(f"communication per step per device ({name})")
        top.legend()
    top.set_title(f"{os.path.basename(header['sweep'])}: {shown}, ranked by {header['objective']}\n"
                  f"(grey bars: over budget or failed)", fontsize=10)
    planned = [r["planned"]["peak_estimate"] for r in recs]
    compiled = [(r.get("compiled") or {}).get("peak_bytes", 0) for r in recs]
    scale, name = unit(planned + compiled + [header["budget_bytes"] or 0])
    bottom.bar([i - 0.2 for i in x], [v / scale for v in planned], 0.4, label="planned peak", color="tab:orange")
    bottom.bar([i + 0.2 for i in x], [v / scale for v in compiled], 0.4, label="compiled peak (XLA)",
               color="tab:green")
    if header["budget_bytes"]:
        bottom.axhline(header["budget_bytes"] / scale, color="tab:red", linestyle="--", label="budget")
    bottom.set_ylabel(f"memory per device ({name})")
    bottom.set_xticks(x)
    bottom.set_xticklabels([label(r) for r in recs], fontsize=7, rotation=90 if len(recs) > 12 else 0)
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
