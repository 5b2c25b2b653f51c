"""Matmul FLOPs each device executes in one run of a compiled SPMD program, read from its HLO text.

    compiled = jax.jit(step).lower(*args).compile()
    per_device = dot_flops_per_device(compiled.as_text())   # [FLOPs of partition 0, 1, ...]

Why not `compiled.cost_analysis()["flops"]`: it counts a while loop's body once, whatever its trip count, and a
conditional's branches without knowing which one a device takes (checked in tests/unit/test_hlo_flops.py), so
it says little about a step made of scans (layer scans, accumulation, pipeline ticks) with stage-dependent
`lax.cond`s (`jaxpar.parallel.pipeline`).

Counted: every `dot` (also inside fusions and called computations), 2 x (result elements) x (product of the
lhs contracting dimensions) FLOPs (a multiply and an add per term; the convention of
`jaxpar.model.flops.flops_per_token`). Elementwise work, reductions and convolutions are not counted (a module with a
convolution raises). Each computation is multiplied by the trip counts of the while loops around it
(`jaxpar.analysis.hlo.collectives`'s trip-count reading: backend_config `known_trip_count`, else the loop condition's
`compare(counter, constant(N)), direction=LT`; a loop with neither raises). A `conditional` counts only the
branch the device takes: its selector is evaluated for each partition id from the integer scalar
computation that produces it (`partition-id`, constants, converts, comparisons, integer arithmetic, bit
operations, select, fusions of those, and values carried unchanged through while loops or passed into
called computations); a selector computed otherwise (from data, e.g. the optimizer's skip of a non-finite
update) is accepted when every branch costs the same, and raises ValueError when not.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxpar.analysis.hlo.collectives import (
    _arrays,
    _Instr,
    _trip_count,
    called_computations,
    hlo_attr,
    parse_module,
)

_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": operator.add,
    "subtract": operator.sub,
    "multiply": operator.mul,
    "and": lambda a, b: a & b,
    "or": lambda a, b: a | b,
    "xor": lambda a, b: a ^ b,
    "maximum": max,
    "minimum": min,
    "shift-left": lambda a, b: a << b,
    "shift-right-logical": lambda a, b: a >> b,
    "shift-right-arithmetic": lambda a, b: a >> b,
    "divide": lambda a, b: int(a / b),  # integer division truncates towards zero in HLO
    "remainder": lambda a, b: int(math.fmod(a, b)),
}
_COMPARE = {
    "EQ": operator.eq,
    "NE": operator.ne,
    "LT": operator.lt,
    "LE": operator.le,
    "GT": operator.gt,
    "GE": operator.ge,
}
_PASS_THROUGH = ("convert", "copy", "bitcast", "reshape", "broadcast", "bitcast-convert")


@dataclasses.dataclass(frozen=True)
class _Frame:
    """A call site: the computation and instruction that called the computation being evaluated, and for a
    conditional the branch taken."""

    comp: str
    instr: _Instr
    branch: int = -1


class _Module:
    def __init__(self, text: str, cost, skip_conditionals: bool = False, branch_weights=None):
        self.cost = cost  # (module, computation, instruction) -> cost of one execution of the instruction
        self.skip_conditionals = skip_conditionals
        self.branch_weights = branch_weights
        self.comps, self.entry, self.num_partitions = parse_module(text)
        self.by_name = {c: {i.name: i for i in instrs} for c, instrs in self.comps.items()}
        self._static: dict[str, float] = {}  # cost of computations without conditionals
        self._conditional: dict[str, bool] = {}

    # --- values of integer scalar computations -------------------------------------------------------------

    def value(self, comp: str, name: str, frames: tuple[_Frame, ...], pid: int):
        i = self.by_name[comp][name]
        op = i.opcode
        args = lambda: [self.value(comp, o, frames, pid) for o in i.operands]  # noqa: E731
        if op == "partition-id":
            return pid
        if op == "replica-id":
            return 0
        if op == "constant":
            return _literal(i)
        if op in _PASS_THROUGH:
            (v,) = args()
            return _cast(v, i.type_str)
        if op == "compare":
            a, b = args()
            return bool(_COMPARE[hlo_attr(r"direction=(\w+)", i.attrs)](a, b))
        if op == "not":
            (v,) = args()
            return (not v) if isinstance(v, bool) else ~v
        if op == "negate":
            (v,) = args()
            return -v
        if op in _BINARY:
            a, b = args()
            return _cast(_BINARY[op](a, b), i.type_str)
        if op == "select":
            c, a, b = i.operands
            return self.value(comp, a if self.value(comp, c, frames, pid) else b, frames, pid)
        if op in ("dynamic-slice", "slice"):
            arr = np.asarray(self.value(comp, i.operands[0], frames, pid)).ravel()
            if op == "slice":
                start = int(hlo_attr(r"slice=\{\[(\d+):", i.attrs))
            else:
                start = int(self.value(comp, i.operands[1], frames, pid))
            return _cast(arr[min(max(start, 0), arr.size - 1)], i.type_str)
        if op == "fusion" or op == "call":
            called = hlo_attr(r"(?:calls|to_apply)=%?([\w.\-]+)", i.attrs)
            return self.value(called, _root(self.comps[called]), (*frames, _Frame(comp, i)), pid)
        if op == "get-tuple-element":
            index = int(hlo_attr(r"index=(\d+)", i.attrs))
            return self._element(comp, i.operands[0], index, frames, pid)
        if op == "parameter":
            return self._parameter(comp, i, frames, pid)
        raise ValueError(f"cannot evaluate {op} ({name} in {comp}) for a conditional's selector")

    def _element(self, comp: str, name: str, index: int, frames, pid: int):
        i = self.by_name[comp][name]
        if i.opcode == "tuple":
            return self.value(comp, i.operands[index], frames, pid)
        if i.opcode == "parameter" and frames and frames[-1].instr.opcode == "while":
            caller = frames[-1]
            body = hlo_attr(r"body=%?([\w.\-]+)", caller.instr.attrs)
            if comp == body:  # the element must come back unchanged at the end of each iteration
                root = self.by_name[comp][_root(self.comps[comp])]
                back = self.by_name[comp].get(root.operands[index]) if root.opcode == "tuple" else None
                if not (
                    back is not None
                    and back.opcode == "get-tuple-element"
                    and back.operands == [name]
                    and hlo_attr(r"index=(\d+)", back.attrs) == str(index)
                ):
                    raise ValueError(f"element {index} of while loop {caller.instr.name} is not loop-invariant")
            return self._element(caller.comp, caller.instr.operands[0], index, frames[:-1], pid)
        if i.opcode == "parameter":
            return self._parameter(comp, i, frames, pid)[index]
        raise ValueError(f"cannot take element {index} of {i.opcode} ({name} in {comp})")

    def _parameter(self, comp: str, i: _Instr, frames, pid: int):
        if not frames:
            raise ValueError(f"a conditional's selector depends on the program's argument {i.name}")
        k = int(i.raw_operands.strip())
        caller = frames[-1]
        if caller.instr.opcode == "while":
            raise ValueError(f"while parameter {i.name} used whole in a selector")
        operand = caller.instr.operands[caller.branch + 1 if caller.instr.opcode == "conditional" else k]
        return self.value(caller.comp, operand, frames[:-1], pid)

    # --- FLOPs ----------------------------------------------------------------------------------------------

    def total(self, comp: str, frames: tuple[_Frame, ...], pid: int) -> float:
        """Cost of one execution of `comp`, reached through the call sites `frames`, on partition `pid`."""
        static = not self._has_conditional(comp)
        if static and comp in self._static:
            return self._static[comp]
        total = 0.0
        for i in self.comps[comp]:
            total += self.cost(self, comp, i)
            if i.opcode == "convolution":
                raise ValueError(f"convolution {i.name} in {comp}: not counted by this module")
            elif i.opcode == "while":
                trips = _trip_count(i, self.comps)
                if trips is None:
                    raise ValueError(f"trip count of while loop {i.name} not found")
                body = hlo_attr(r"body=%?([\w.\-]+)", i.attrs)
                total += trips * self.total(body, (*frames, _Frame(comp, i)), pid)
            elif i.opcode == "conditional":
                total += 0.0 if self.skip_conditionals else self._conditional_cost(comp, i, frames, pid)
            else:
                for role, called in called_computations(i.attrs):
                    if role in ("calls", "to_apply") and called in self.comps:
                        total += self.total(called, (*frames, _Frame(comp, i)), pid)
        if static:
            self._static[comp] = total
        return total

    def _conditional_cost(self, comp: str, i: _Instr, frames: tuple[_Frame, ...], pid: int) -> float:
        branches = [n for role, n in called_computations(i.attrs) if role == "branch"]
        pred = not branches
        if pred:  # the true_computation / false_computation form: branch 0 runs on true
            branches = [hlo_attr(rf"{k}_computation=%?([\w.\-]+)", i.attrs) for k in ("true", "false")]
        try:
            selector = self.value(comp, i.operands[0], frames, pid)
        except ValueError:
            # A data-dependent selector (e.g. the optimizer's skip of a non-finite update): fine if every branch
            # costs the same.
            each = [self.total(b, (*frames, _Frame(comp, i, k)), pid) for k, b in enumerate(branches)]
            if len(set(each)) == 1:
                return each[0]
            found = re.search(r'op_name="([^"]*)"', i.attrs)
            op_name = found.group(1) if found else ""
            weights = self.branch_weights(pid, len(branches), op_name) if self.branch_weights else None
            if weights is None:
                raise
            return float(sum(w * c for w, c in zip(weights, each, strict=True)))
        if pred:
            taken = 0 if selector else 1
        else:  # an index selector; out of range runs the last branch (HLO semantics)
            taken = int(selector) if 0 <= int(selector) < len(branches) else len(branches) - 1
        return self.total(branches[taken], (*frames, _Frame(comp, i, taken)), pid)

    def _has_conditional(self, comp: str) -> bool:
        """Whether `comp` or anything it calls holds a conditional (then its FLOPs depend on the partition)."""
        if comp not in self._conditional:
            self._conditional[comp] = False  # no recursion in HLO; guards the walk
            self._conditional[comp] = any(
                i.opcode == "conditional"
                or any(self._has_conditional(c) for _, c in called_computations(i.attrs) if c in self.comps)
                for i in self.comps[comp]
            )
        return self._conditional[comp]

    def operand_arrays(self, comp: str, i: _Instr, k: int):
        """The arrays of instruction `i`'s operand `k` (its type as printed where it is defined)."""
        return _arrays(self.by_name[comp][i.operands[k]].type_str)


def _dot_flops(module: _Module, comp: str, i: _Instr) -> float:
    if i.opcode != "dot":
        return 0.0
    result = _arrays(i.type_str)[0]
    lhs_array = module.operand_arrays(comp, i, 0)[0]
    dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", i.attrs)
    contracting = [int(d) for d in dims.group(1).split(",") if d] if dims else []
    return 2.0 * math.prod(result.shape) * math.prod(lhs_array.shape[d] for d in contracting)


def _root(instrs: list[_Instr]) -> str:
    return instrs[-1].name  # the ROOT instruction is printed last


def _literal(i: _Instr):
    text = i.raw_operands.strip()
    if text in ("true", "false"):
        return text == "true"
    values = [int(float(v)) if v not in ("true", "false") else v == "true" for v in re.findall(r"-?[\w.]+", text)]
    if len(values) == 1 and "{" not in text:
        return _cast(values[0], i.type_str)
    return np.array(values)


def _cast(v, type_str: str):
    arrays = _arrays(type_str)
    dtype = arrays[0].dtype if arrays else ""
    if dtype == "pred":
        return bool(v)
    if isinstance(v, np.ndarray):
        return v
    if dtype.startswith(("s", "u")):
        v = int(v)
        bits = int(dtype[1:])
        v &= (1 << bits) - 1
        if dtype.startswith("s") and v >= 1 << (bits - 1):
            v -= 1 << bits
        return v
    return v


def dot_flops_per_device(
    hlo_text: str, skip_conditionals: bool = False, branch_weights: BranchWeights | None = None
) -> list[float]:
    """Matmul FLOPs of one run of the program on each partition (index = partition id, i.e. position in
    `mesh.devices.flat`); module docstring. With `skip_conditionals` the branches of every conditional count
    nothing: the FLOPs every tick runs whatever its branch (e.g. interleaved 1F1B's blocks, whose embedding and
    head conds select on the tick as well as the stage, a selector this module cannot evaluate).

    `branch_weights(pid, n, op_name)`: for a conditional of n branches whose selector this module cannot
    evaluate and whose branches cost differently, the share of its executions on partition `pid` that take each
    branch (a list of n, summing to 1; None: raise as without it), given the conditional's `op_name` metadata
    (jax's name stack, e.g. ".../active_rows/cond"); its cost is then the weighted mean of its branches'. Exact
    for a conditional inside a loop when the shares are counted over the loop's iterations: the zero-bubble
    schedules' slot switch, whose per-device counts of F, B, W and idle come from the schedule's table
    (`jaxpar.parallel.pipeline_zb`), or an uneven pipeline split's skip of its padding rows
    (`jaxpar.model.stack.active_rows`).

    Raises:
      ValueError: a while loop without a readable trip count, a conditional selector this module cannot
        evaluate, or a convolution.
    """
    return per_device_cost(hlo_text, _dot_flops, skip_conditionals, branch_weights)


BranchWeights = Callable[[int, int, str], "list[float] | None"]


def per_device_cost(
    hlo_text: str, cost, skip_conditionals: bool = False, branch_weights: BranchWeights | None = None
) -> list[float]:
    """Sum of `cost(module, computation, instruction)` over the instructions each partition executes in one
    run, each times its executions (loop trip counts; only the branch of a conditional the partition takes).
    `dot_flops_per_device` is this with the matmul FLOPs; a test can count e.g. gathers of a given shape.

    Raises: as `dot_flops_per_device`."""
    module = _Module(hlo_text, cost, skip_conditionals, branch_weights)
    return [module.total(module.entry, (), pid) for pid in range(module.num_partitions)]
