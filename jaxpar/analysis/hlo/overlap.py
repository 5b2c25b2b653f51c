"""Which asynchronous collectives of a compiled program run under compute, read from its scheduled HLO text.

    hlo = compiled.as_text()           # a scheduled module (`is_scheduled=true`): instructions in run order
    rows = async_collectives(hlo)
    summary(rows)["collective-permute"]   # {"count": 6, "overlapped": 4, "under_gemm": 4}

XLA's GPU compiler splits each collective into a start and a done (`collective-permute-start` /
`collective-permute-done`, `all-gather-start` / `-done`, `reduce-scatter-start` / `-done`, `all-reduce-start` /
`-done`, or an `async-start` / `async-done` pair around the collective), and its latency-hiding scheduler places
independent work between the two: the collective's transfer runs on its own stream while the compute stream runs
that work. A collective whose start and done are adjacent in the schedule (or that stays synchronous) stalls the
compute stream for its whole transfer.

For each start, the reader counts the instructions scheduled between it and its done in the same computation
that run kernels: fusions, custom calls (cuBLAS / cuDNN), dots and convolutions, and loops, calls and
conditionals whose computations hold any. GEMMs among them (cuBLAS calls, GEMM fusions, cuDNN's fused attention)
are counted apart: they are what hides a transfer of megabytes. Nothing is timed: a pair separated by a single
small fusion hides little, so the rows also name what lies between.

XLA:CPU's schedule keeps every collective synchronous, so on CPU every row is a synchronous collective.
"""

from __future__ import annotations

import dataclasses
import re

from jaxpar.analysis.hlo.collectives import called_computations, op_name, parse_module, through_calls, while_loops

KINDS = ("collective-permute", "all-gather", "reduce-scatter", "all-reduce", "all-to-all")
_COMPUTE_OPCODES = {"fusion", "custom-call", "dot", "convolution"}
_GEMM_TARGET = re.compile(r'custom_call_target="(__cublas[^"]*|__cudnn\$[^"]*)"')
_GEMM_FUSION = re.compile(r"calls=%?[\w.\-]*gemm|__triton_gemm|__cublas|__cudnn")
_SOURCE_TARGET = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_PAIRS = re.compile(r"\{(\d+),(\d+)\}")


@dataclasses.dataclass(frozen=True)
class AsyncCollective:
    """One collective of the schedule and what runs under it.

    Attributes:
      computation: the HLO computation it is scheduled in (a loop body for a pipeline tick).
      kind: one of `KINDS`.
      name: the start instruction's name (the collective's own for a synchronous one).
      op_name: the jax operation it came from (metadata), e.g. ".../while/body/closed_call/ppermute".
      asynchronous: whether it was split into a start and a done.
      compute: kernels scheduled between start and done (0 for a synchronous collective).
      gemms: of those, GEMMs (cuBLAS, GEMM fusions, cuDNN), or loops and conditionals that run some.
      trips: the trip count of the while loop whose body `computation` is (a pipeline schedule's ticks), None
        outside a loop body or where the compiler gives none.
      direction: for a collective-permute, "up" when most of its pairs send to a higher device id (on the
        pipeline axis: to the next stage, the forward's activations), "down" when most send to a lower one
        (the backward's gradients), "" otherwise.
    """

    computation: str
    kind: str
    name: str
    op_name: str
    asynchronous: bool
    compute: int
    gemms: int
    trips: int | None = None
    direction: str = ""

    @property
    def overlapped(self) -> bool:
        """Whether any kernel runs between its start and done."""
        return self.compute > 0


def _direction(attrs: str) -> str:
    found = _SOURCE_TARGET.search(attrs)
    pairs = [(int(a), int(b)) for a, b in _PAIRS.findall(found.group(1))] if found else []
    up = sum(b > a for a, b in pairs) - sum(b < a for a, b in pairs)
    return "up" if up > 0 else "down" if up < 0 else ""


def _kind(opcode: str, attrs: str, comps: dict) -> str | None:
    base = opcode.removesuffix("-start")
    if base in KINDS:
        return base
    if opcode == "async-start":  # an async wrapper: the collective is its called computation's root
        for _, name in called_computations(attrs):
            for ins in comps.get(name, []):
                if ins.opcode in KINDS:
                    return ins.opcode
    return None


def async_collectives(hlo_text: str) -> list[AsyncCollective]:
    """Every collective of the scheduled module `hlo_text` (a compiled executable's `as_text()`), in schedule
    order per computation, with the kernels scheduled between its start and done (module docstring)."""
    comps, _, _ = parse_module(hlo_text)

    def gemm_kernel(ins) -> bool:
        if ins.opcode == "custom-call":
            return bool(_GEMM_TARGET.search(ins.attrs))
        if ins.opcode == "fusion":
            return bool(_GEMM_FUSION.search(ins.attrs))
        return ins.opcode in ("dot", "convolution")

    # A fusion, loop, call or conditional counts by what it runs (GEMM fusions, a layer loop's matmuls).
    is_gemm = through_calls(comps, gemm_kernel)
    is_compute = through_calls(comps, lambda ins: ins.opcode in _COMPUTE_OPCODES)

    trips = {w.body: w.trip_count for w in while_loops(hlo_text)}
    rows: list[AsyncCollective] = []
    for comp, instrs in comps.items():
        for n, ins in enumerate(instrs):
            asynchronous = ins.opcode.endswith("-start")
            kind = (
                _kind(ins.opcode, ins.attrs, comps) if asynchronous else (ins.opcode if ins.opcode in KINDS else None)
            )
            if kind is None:
                continue
            between = []
            if asynchronous:
                for later in instrs[n + 1 :]:
                    if later.opcode.endswith("-done") and ins.name in later.operands:
                        break
                    between.append(later)
            rows.append(
                AsyncCollective(
                    computation=comp,
                    kind=kind,
                    name=ins.name,
                    op_name=op_name(ins.attrs),
                    asynchronous=asynchronous,
                    compute=sum(is_compute(i) for i in between),
                    gemms=sum(is_gemm(i) for i in between),
                    trips=trips.get(comp),
                    direction=_direction(ins.attrs) if kind == "collective-permute" else "",
                )
            )
    return rows


def summary(rows: list[AsyncCollective]) -> dict[str, dict[str, int]]:
    """{kind: {"count", "overlapped" (some kernel between start and done), "under_gemm" (a GEMM between)}} over
    the collectives of the schedule (each counted once, whatever its loop's trip count)."""
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        d = out.setdefault(r.kind, {"count": 0, "overlapped": 0, "under_gemm": 0})
        d["count"] += 1
        d["overlapped"] += r.overlapped
        d["under_gemm"] += r.gemms > 0
    return out


def pipeline_permutes(rows: list[AsyncCollective]) -> list[AsyncCollective]:
    """The collective-permutes that run once per iteration of a loop of more than one trip whose body holds no
    other loop with permutes: a pipeline schedule's ticks (1F1B: one loop per phase, warm-up, steady,
    cool-down; the zero-bubble schedules: one loop over slots), in schedule order."""
    return [r for r in rows if r.kind == "collective-permute" and (r.trips or 0) > 1]


def format_rows(rows: list[AsyncCollective]) -> str:
    """A table of `rows`: loop trips, kind, direction, name, kernels between start and done, GEMMs among them."""
    lines = [f"  {'loop trips':>10}  {'collective':<20}{'to':<6}{'start':<30}{'kernels under it':>17}{'GEMMs':>7}"]
    for r in rows:
        under = str(r.compute) if r.asynchronous else "synchronous"
        lines.append(f"  {r.trips or '-':>10}  {r.kind:<20}{r.direction:<6}{r.name:<30}{under:>17}{r.gemms:>7}")
    return "\n".join(lines)
