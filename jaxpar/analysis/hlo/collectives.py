"""The collectives of a compiled XLA program, read from its HLO text, and the mesh axes they run over.

    compiled = jax.jit(step).lower(*args).compile()
    table = collectives_by_axis(compiled.as_text(), mesh)   # {(("tensor",), "all-reduce"): {...}, ...}

The text can be a compiled executable's (`compiled.as_text()`, after the backend's passes) or an XLA pass dump
such as the partitioned program (`jaxpar.analysis.planner.compiled.read_partitioned_hlo`, before them).

`parse_collectives` lists every all-reduce, all-gather, reduce-scatter, all-to-all, ragged all-to-all (its ring
bytes those of balanced routing, `jaxpar.analysis.hlo.ring`: the rows actually sent are known only at run time)
and collective-permute (an
async `-start`/`-done` pair counts once, as its `-start`; a collective wrapped in an async computation counts
once, inside it) with the computation it lives in, its replica groups, shapes, dtypes and ring bytes per
device (`jaxpar.analysis.hlo.ring.ring_bytes`). `times_per_step` is how often it runs per program execution: the product
of the trip counts of the while loops around it. A trip count is read from the loop's backend_config
`known_trip_count`; failing that from its condition `compare(counter, constant(N)), direction=LT` (counting
from 0 by 1, which is what `lax.scan` and `fori_loop` lower to); failing that it is taken as 1 and the
collective's `trip_count_known` is False.

Device ids. jaxpar's collectives carry `use_global_device_ids=true` (SPMD partitioning, one replica): the ids in
replica groups are partition ids, i.e. positions in `mesh.devices.flat`, not `jax.Device.id`. (Checked in
tests/unit/test_hlo_collectives.py with a mesh over a permuted device list: the groups stay the positions.)
Replica groups come in three printed forms, all handled:
    {{0,1},{2,3}}                         explicit lists
    [4,2]<=[2,4]T(1,0)                    iota: arange(8).reshape(2,4).transpose(1,0).reshape(4,2), a row a group
    mesh['a'=2,'b'=4], device_ids=([2,2,2]T(1,0,2)) {'a'}
                                          mesh axes: the device array (iota if device_ids is absent) reshaped to
                                          the mesh; a group is the devices along the listed axes
and `{}` (one group of every partition). Sub-axis references (`'a':(1)2`) raise ValueError.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Callable

import numpy as np
from jax.sharding import Mesh

from jaxpar.analysis.hlo.ring import KINDS, ring_bytes

# Bytes per element by HLO type name ("bf16", "f32", ...): HLO text's own vocabulary, not the dtype names of
# configs and arrays (those are `jaxpar.config.precision.DTYPE_BYTES`).
_DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "s32": 4,
    "u32": 4,
    "s64": 8,
    "u64": 8,
    "f16": 2,
    "bf16": 2,
    "f32": 4,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_CALLED = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    shape: tuple[int, ...]

    @property
    def bytes(self) -> float:
        # fp8 variants (f8e4m3fn, ...) are one byte; unknown types count 0 rather than guessing.
        width = 1 if self.dtype.startswith("f8") else _DTYPE_BYTES.get(self.dtype, 0)
        return width * math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of the program.

    Attributes:
      kind: one of `jaxpar.analysis.hlo.ring.KINDS`.
      name: instruction name; computation: the computation (e.g. a while body) it lives in.
      groups: replica groups as tuples of partition ids (positions in mesh.devices.flat).
      operands, results: per-device arrays (a combined collective has several).
      size_bytes: S of the ring formula: the all-gather result, the reduce-scatter operand, else the operand.
      bytes_per_device: ring bytes sent per device by one execution.
      times_per_step: executions per program run (product of enclosing loop trip counts).
      trip_count_known: False when some enclosing loop's trip count was not found (taken as 1).
      op_name: the jax op_name metadata (e.g. ".../transpose(jvp())/psum"), "" if absent.
    """

    kind: str
    name: str
    computation: str
    groups: tuple[tuple[int, ...], ...]
    operands: tuple[Array, ...]
    results: tuple[Array, ...]
    size_bytes: float
    bytes_per_device: float
    times_per_step: int
    trip_count_known: bool
    op_name: str

    @property
    def group_size(self) -> int:
        return len(self.groups[0]) if self.groups else 0


@dataclasses.dataclass(frozen=True)
class WhileLoop:
    """A while instruction: the computation holding it, its body and condition, trip count and op_name."""

    name: str
    computation: str
    body: str
    condition: str
    trip_count: int | None
    op_name: str


@dataclasses.dataclass
class _Instr:
    name: str
    type_str: str
    opcode: str
    operands: list[str]
    raw_operands: str
    attrs: str


def _arrays(type_str: str) -> tuple[Array, ...]:
    type_str = re.sub(r"/\*.*?\*/", "", type_str)
    return tuple(Array(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(type_str))


def _split_call(rest: str) -> tuple[str, str]:
    """`a, b), attrs...` -> ("a, b", "attrs...") at the parenthesis matching the opcode's."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i], rest[i + 1 :]
    return rest, ""


def parse_module(text: str) -> tuple[dict[str, list[_Instr]], str, int]:
    """HLO module text -> ({computation: its instructions in printed (schedule) order}, entry name,
    num_partitions)."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None or line.startswith(("%", "ENTRY")):
            m = _COMPUTATION.match(line)
            if m and "=" not in line.split("(")[0]:
                current = m.group(2)
                comps[current] = []
                entry = current if m.group(1) else entry
                continue
        if current is None or line.strip() == "}":
            continue
        m = _INSTRUCTION.match(line)
        if m:
            operands, attrs = _split_call(m.group(5))
            comps[current].append(
                _Instr(m.group(2), m.group(3), m.group(4), re.findall(r"%([\w.\-]+)", operands), operands, attrs)
            )
    m = re.search(r"num_partitions=(\d+)", text)
    return comps, entry, int(m.group(1)) if m else 1


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    a = np.arange(math.prod(dims)).reshape(dims)
    return a.transpose(perm) if perm else a


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_replica_groups(attrs: str, num_partitions: int) -> tuple[tuple[int, ...], ...]:
    """Replica groups of an instruction's attribute text, in any of the forms of the module docstring.

    A collective-permute has no groups: its `source_target_pairs` are joined into connected components.
    Raises ValueError on a form not understood (e.g. mesh sub-axes).
    """
    m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", attrs)
    if m:
        groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,\s]*)\}", m.group(1)))
        return groups or (tuple(range(num_partitions)),)
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        ids = _iota(_ints(m.group(3)), _ints(m.group(4)) if m.group(4) else None)
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(int(m.group(1)), int(m.group(2))))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", attrs)
    if m:
        axes = [(n.strip().strip("'"), int(s)) for n, s in (a.split("=") for a in m.group(1).split(","))]
        names, sizes = [n for n, _ in axes], [s for _, s in axes]
        grouped = [g.strip().strip("'") for g in m.group(3).split(",") if g.strip()]
        if any(":" in g for g in grouped) or any(g not in names for g in grouped):
            raise ValueError(f"mesh-axes replica groups with sub-axes or unknown axes: {m.group(0)}")
        ids_text = m.group(2) or ""
        it = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", ids_text)
        if it:
            ids = _iota(_ints(it.group(1)), _ints(it.group(2)) if it.group(2) else None)
        elif ids_text.strip():
            ids = np.array(_ints(ids_text))
        else:
            ids = np.arange(math.prod(sizes))
        keep = [i for i, n in enumerate(names) if n not in grouped] + [names.index(g) for g in grouped]
        per_group = math.prod(sizes[names.index(g)] for g in grouped)
        ids = ids.reshape(sizes).transpose(keep).reshape(-1, per_group)
        return tuple(tuple(int(i) for i in row) for row in ids)
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    if m:
        parent: dict[int, int] = {}

        def root(i: int) -> int:
            while parent.setdefault(i, i) != i:
                i = parent[i]
            return i

        for a, b in (tuple(_ints(p)) for p in re.findall(r"\{(\d+,\d+)\}", m.group(1))):
            parent[root(a)] = root(b)
        comps: dict[int, list[int]] = {}
        for i in sorted(parent):
            comps.setdefault(root(i), []).append(i)
        return tuple(tuple(c) for c in comps.values())
    raise ValueError(f"no replica groups understood in: {attrs[:200]}")


def _trip_count(instr: _Instr, comps: dict[str, list[_Instr]]) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instr.attrs)
    if m:
        return int(m.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", instr.attrs)
    body = comps.get(cond.group(1), []) if cond else []
    consts = {
        i.name: int(i.raw_operands)
        for i in body
        if i.opcode == "constant" and re.fullmatch(r"-?\d+", i.raw_operands.strip())
    }
    for i in body:
        if i.opcode == "compare" and "direction=LT" in i.attrs and len(i.operands) == 2 and i.operands[1] in consts:
            return consts[i.operands[1]]
    return None


def hlo_attr(pattern: str, attrs: str) -> str:
    r"""Group 1 of `pattern`'s first match in an instruction's attributes (e.g. r"body=%?([\w.\-]+)").

    Raises:
      ValueError: no match (HLO text of a form this reader does not know).
    """
    found = re.search(pattern, attrs)
    if found is None:
        raise ValueError(f"no {pattern!r} in the HLO attributes {attrs[:200]!r}")
    return found.group(1)


def while_loops(hlo_text: str) -> list[WhileLoop]:
    """Every while instruction of the module, with its trip count (None where not found)."""
    comps, _, _ = parse_module(hlo_text)
    out = []
    for comp, instrs in comps.items():
        for i in instrs:
            if i.opcode == "while":
                body = hlo_attr(r"body=%?([\w.\-]+)", i.attrs)
                cond = hlo_attr(r"condition=%?([\w.\-]+)", i.attrs)
                out.append(WhileLoop(i.name, comp, body, cond, _trip_count(i, comps), op_name(i.attrs)))
    return out


def op_name(attrs: str) -> str:
    """The jax operation an instruction came from (its metadata's op_name), "" where it names none."""
    m = re.search(r'op_name="([^"]*)"', attrs)
    return m.group(1) if m else ""


# Instructions that run other computations as a whole: a loop, a call, a conditional.
NESTING_OPCODES = frozenset({"while", "call", "conditional"})


def through_calls(comps: dict[str, list[_Instr]], test: Callable[[_Instr], bool]) -> Callable[[_Instr], bool]:
    """`test` extended through the computations an instruction calls (`called_computations`, transitively): the
    returned predicate holds for an instruction when `test` does or when a computation it calls holds an
    instruction for which it does. Memoised per computation; a call cycle counts as holding none."""
    holds: dict[str, bool] = {}

    def comp_holds(comp: str) -> bool:
        if comp not in holds:
            holds[comp] = False  # no recursion through a cycle
            holds[comp] = any(passes(ins) for ins in comps.get(comp, []))
        return holds[comp]

    def passes(ins: _Instr) -> bool:
        return test(ins) or any(comp_holds(c) for _, c in called_computations(ins.attrs) if c in comps)

    return passes


def called_computations(attrs: str) -> list[tuple[str, str]]:
    """(role, computation) pairs an instruction's attributes call: body, condition, calls, to_apply, a
    conditional's true_computation and false_computation (a predicate) or branch (an index)."""
    called = [(role, name) for role, name in _CALLED.findall(attrs)]
    return called + [("branch", b.strip().lstrip("%")) for m in _BRANCHES.findall(attrs) for b in m.split(",")]


def _multiplicities(comps: dict[str, list[_Instr]], entry: str) -> dict[str, tuple[int, bool]]:
    """computation -> (executions per program run, all trip counts known), summed over call sites."""
    edges: dict[str, list[tuple[str, int | None]]] = {c: [] for c in comps}
    for comp, instrs in comps.items():
        for i in instrs:
            trips = _trip_count(i, comps) if i.opcode == "while" else 1
            for role, name in called_computations(i.attrs):
                if name in comps:
                    edges[comp].append((name, trips if role in ("body", "condition") else 1))
    out: dict[str, tuple[int, bool]] = {}

    def visit(comp: str, times: int, known: bool) -> None:
        prev = out.get(comp, (0, True))
        out[comp] = (prev[0] + times, prev[1] and known)
        for child, trips in edges[comp]:
            visit(child, times * (trips or 1), known and trips is not None)

    visit(entry, 1, True)
    return out


def parse_collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled module's HLO text (`compiled.as_text()`); see the module docstring.

    Raises:
      ValueError: replica groups in a form not understood.
    """
    comps, entry, num_partitions = parse_module(hlo_text)
    types = {i.name: i.type_str for instrs in comps.values() for i in instrs}
    mult = _multiplicities(comps, entry)
    out = []
    for comp, instrs in comps.items():
        for i in instrs:
            kind = i.opcode.removesuffix("-start")
            if kind not in KINDS:
                continue
            results = _arrays(i.type_str)
            operands = tuple(a for op in i.operands for a in _arrays(types.get(op, "")))
            if i.opcode.endswith("-start") and kind != "all-reduce":
                # (operands..., results...[, scratch]) tuple: the results follow the operands.
                results = results[len(operands) : len(operands) + len(operands)] or results
            groups = parse_replica_groups(i.attrs, num_partitions)
            # A permute's components can differ in size (a device mapped to itself is a group of one); a device
            # that sends at all sends its whole operand, so its bytes are those of the largest component.
            n = max(len(g) for g in groups) if kind == "collective-permute" else len(groups[0])
            if kind == "all-gather":
                size = sum(a.bytes for a in results)
            elif kind == "ragged-all-to-all":  # (send rows, receive buffer, 4 offset and size arrays)
                # a device sends at most its operand's rows and, balanced, what each receiver's buffer takes: the
                # dispatch sends from [A, D] into [R, D], the combine from [R, D] into [A, D]
                size = min(operands[0].bytes, operands[1].bytes) if len(operands) > 1 else 0.0
            else:
                size = sum(a.bytes for a in operands) or sum(a.bytes for a in results) * (
                    n if kind == "reduce-scatter" else 1
                )
            times, known = mult.get(comp, (1, False))
            out.append(
                Collective(
                    kind,
                    i.name,
                    comp,
                    groups,
                    operands,
                    results,
                    size,
                    ring_bytes(kind, size, n),
                    times,
                    known,
                    op_name(i.attrs),
                )
            )
    return out


def axis_groups(mesh: Mesh, axes: tuple[str, ...]) -> frozenset[frozenset[int]]:
    """The replica groups (as partition ids: positions in mesh.devices.flat) that a collective over `axes` has."""
    ids = np.arange(mesh.size).reshape(mesh.devices.shape)
    names = list(mesh.axis_names)
    keep = [d for d, a in enumerate(names) if a not in axes] + [names.index(a) for a in axes]
    per_group = math.prod(mesh.shape[a] for a in axes)
    return frozenset(frozenset(int(i) for i in row) for row in ids.transpose(keep).reshape(-1, per_group))


def classify_groups(groups, mesh: Mesh, kind: str = "") -> tuple[str, ...] | None:
    """The mesh axes (in mesh order, size-1 axes left out) whose groups equal `groups`; () for groups of one
    device (a no-op collective); None when no set of axes induces them.

    A collective-permute (`kind`) need not pair every device of a group: its groups are the connected components
    of its source-target pairs (`parse_replica_groups`), and it runs over the fewest axes whose groups each
    contain one of its components of two or more devices (e.g. interleaved 1F1B's moves of single model chunks
    between two stages, `jaxpar.parallel.pipeline.to_chunk_order`: over `pipeline`)."""
    wanted = frozenset(frozenset(g) for g in groups)
    if all(len(g) == 1 for g in wanted):
        return ()
    live = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    moving = [g for g in wanted if len(g) > 1]
    for r in range(1, len(live) + 1):
        for axes in itertools.combinations(live, r):
            have = axis_groups(mesh, axes)
            if have == wanted:
                return axes
            if kind == "collective-permute" and all(any(g <= h for h in have) for g in moving):
                return axes
    return None


def collectives_by_axis(
    hlo_text: str, mesh: Mesh, per_step: bool = True, computations: set[str] | None = None
) -> dict[tuple[tuple[str, ...] | None, str], dict]:
    """Counts and ring bytes per device of the module's collectives, keyed by (mesh axes, kind).

    Args:
      hlo_text: compiled HLO text; mesh: the mesh it was compiled for.
      per_step: count each collective `times_per_step` times (inside loops: once per iteration); else once per
        op in the program text.
      computations: only collectives living in these computations (e.g. a while body); None for all.

    Returns:
      {(axes, kind): {"count": int, "bytes": float}}; axes as `classify_groups` gives them.
    """
    out: dict = {}
    for c in parse_collectives(hlo_text):
        if computations is not None and c.computation not in computations:
            continue
        times = c.times_per_step if per_step else 1
        entry = out.setdefault((classify_groups(c.groups, mesh, c.kind), c.kind), {"count": 0, "bytes": 0.0})
        entry["count"] += times
        entry["bytes"] += times * c.bytes_per_device
    return out


def format_axis_table(tables: dict[str, dict]) -> str:
    """Side-by-side text table of several `collectives_by_axis` results (column name -> table): one row per
    (mesh axes, kind), each column `count` and `bytes` per device."""
    keys = sorted({k for t in tables.values() for k in t}, key=lambda k: (str(k[0]), k[1]))
    head = f"{'mesh axes':<18}{'collective':<20}" + "".join(f"{name + ' count':>22}{'bytes':>14}" for name in tables)
    lines = [head, "-" * len(head)]
    for axes, kind in keys:
        label = "?" if axes is None else ",".join(axes) or "(size 1)"
        rows = [t.get((axes, kind), {"count": 0, "bytes": 0.0}) for t in tables.values()]
        cells = "".join(f"{r['count']:>22}{r['bytes']:>14,.0f}" for r in rows)
        lines.append(f"{label:<18}{kind:<20}{cells}")
    return "\n".join(lines)
