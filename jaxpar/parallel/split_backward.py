"""A backward pass split in two, as zero-bubble pipeline schedules run it (Qi et al. 2023, "Zero Bubble Pipeline
Parallelism", arXiv 2401.10241, section 2): B, the gradient with respect to the input (what the previous stage
waits for), and W, the gradients with respect to the weights (which may wait).

`SplitBackward` takes a backward function g(args) -> (input gradient, weight gradients) -- in jaxpar a stage's
`jax.vjp` function rebuilt from its stash (`jaxpar.parallel.pipeline_1f1b.Residuals`) -- traces it once
(`jax.make_jaxpr`) and partitions its equations:

  * B is every equation the input gradient depends on. With rematerialisation that includes the forward the
    policy recomputes (and nothing more: the split adds no recompute of its own).
  * W is every other equation the weight gradients depend on. It reads what B computed instead of computing it
    again: the *boundary*, the values W reads that B produced or that were B's inputs. B returns them, the
    schedule keeps them until W runs, and W takes them.

The layer stack's backward is one `scan` over layers whose body computes both, so a scan is split the same way,
recursively: a B scan that carries the input gradient down the layers and emits, per layer, the boundary values
of its body as extra stacked outputs, and a W scan over those that emits the layers' weight gradients.
A `cond` is split branch by branch (`_CondSplit`): a B cond whose branches run their B parts and also return
what their W parts read (zeros from the other branches), and a W cond that takes those; the uneven pipeline
split's skip of its padding rows is such a cond inside the layer scan (`jaxpar.model.stack.active_rows`).
Call-like equations (`jit`, `checkpoint`, custom derivative calls; no differentiation follows, so their rules
are not needed) are inlined first so that the split sees through them; every other equation is kept whole on
the side that needs it first (B if B reads any of its outputs).

The sum of the two is the unsplit backward: the same equations on the same values, in two groups. XLA may fuse
the groups differently, so results agree bitwise or within fp32 reordering.

Memory W's deferral keeps alive: `boundary_bytes`, per stage-microbatch, held from B until W. W of a linear
layer y = x A needs its input x and its output gradient dy (dA = x^T dy), of an RMSNorm scale the norm's input
and output gradient; which of those B already holds, and which W recomputes from what B holds, depends on the
rematerialisation policy. W recomputes an all-gather rather than keep its result (`_REDO_IN_W`: under sequence
parallelism the block inputs and output gradients, gathered from s/t rows to s), and a conversion, reshape or
transpose whose input is no larger. Counted from the trace of the dense Llama block at tensor 1 (one stage from
its stash, as `jaxpar.parallel.pipeline_zb` runs it, with or without `pipeline.recompute`; D model width, D_kv
the key/value projections' width, F the MLP's hidden width), per layer, in elements of the compute dtype:

    model.remat none:  b T' (8 D + 2 D_kv + 4 F + 2) + 2 D
    model.remat dots:  b T' (8 D + 3 D_kv + 4 F + 2) + 2 D + the attention's
    model.remat full:  b T' (10 D + 2 D_kv + 4 F)

e.g. 4F: the gate's and up projection's outputs, from which W forms the down projection's input, and their
gradients; 2 D_kv: the key and value projections' output gradients. The general count (tensor parallelism,
sequence parallelism, the attention's term) is `jaxpar.analysis.planner.plan`'s; the tests check it to the byte
against this split and compare the figure with the compiled program's temporaries.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

# Equations that only call a jaxpr, inlined before the split: primitive name -> the parameter holding it.
_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "checkpoint": "jaxpr",
    "remat2": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


class _V:
    """A value of the flattened backward: each equation's outputs get fresh ones, so a jaxpr inlined twice (jax
    caches the jaxpr of a `jit` function, Vars and all) gives two sets of values."""

    __slots__ = ("aval",)

    def __init__(self, aval):
        self.aval = aval


@dataclasses.dataclass
class _Const:
    """A constant value standing where a Var of an inlined jaxpr was (a closed jaxpr's const)."""

    val: Any


@dataclasses.dataclass
class _Eqn:
    """One equation kept whole: its primitive, params and input / output atoms in the flattened namespace."""

    eqn: Any
    ins: list
    outs: list


@dataclasses.dataclass
class _Scan:
    """A `scan` equation with its body flattened: consts, carry and xs invars, carry and ys outvars."""

    eqn: Any
    ins: list
    outs: list
    body: list  # of _Eqn | _Scan
    body_ins: list  # the body's invars: consts, carry, xs
    body_outs: list  # atoms: carry out, ys
    num_consts: int
    num_carry: int


@dataclasses.dataclass
class _Branch:
    """One branch of a `cond` equation, flattened: its ops, invars (one per operand) and output atoms."""

    ops: list
    ins: list
    outs: list


@dataclasses.dataclass
class _Cond:
    """A `cond` equation with its branches flattened; ins[0] is the branch index, ins[1:] the operands.

    `extras` are the values W reads that a branch's B computes (`_CondSplit.add_w`): the B cond returns them as
    extra outputs (zeros from the other branches) and the W cond takes them as operands. Keyed by (branch,
    id(value inside the branch)) -> (that value, its outer value); kept on the op so that every split of the
    enclosing level names the same outer values."""

    eqn: Any
    ins: list
    outs: list
    branches: list  # of _Branch
    extras: dict = dataclasses.field(default_factory=dict)

    def extra(self, k: int, inner) -> _V:
        key = (k, id(inner))
        if key not in self.extras:
            self.extras[key] = (inner, _V(inner.aval))
        return self.extras[key][1]


def _resolve(atom, sub: dict):
    if isinstance(atom, Literal):
        return _Const(atom.val)
    return sub[atom]


def _fresh(vars_, sub: dict) -> list:
    """Fresh values for `vars_`, recorded in `sub`."""
    out = [_V(v.aval) for v in vars_]
    sub.update(zip(vars_, out))
    return out


def _flatten(jaxpr: Jaxpr, sub: dict) -> list:
    """`jaxpr`'s equations with call-like ones inlined (their vars substituted in `sub`) and scan bodies flattened."""
    ops: list = []
    for eqn in jaxpr.eqns:
        ins = [_resolve(v, sub) for v in eqn.invars]
        name = eqn.primitive.name
        if name in _CALLS and _CALLS[name] in eqn.params:
            inner = eqn.params[_CALLS[name]]
            consts = inner.consts if isinstance(inner, ClosedJaxpr) else []
            inner = inner.jaxpr if isinstance(inner, ClosedJaxpr) else inner
            inner_sub = dict(zip(inner.constvars, map(_Const, consts)))
            inner_sub.update(zip(inner.invars, ins))
            ops += _flatten(inner, inner_sub)
            for out, inner_out in zip(eqn.outvars, inner.outvars):
                sub[out] = _resolve(inner_out, inner_sub)
            continue
        if name == "scan":
            closed = eqn.params["jaxpr"]
            body_sub = dict(zip(closed.jaxpr.constvars, map(_Const, closed.consts)))
            body_ins = _fresh(closed.jaxpr.invars, body_sub)
            body = _flatten(closed.jaxpr, body_sub)
            ops.append(
                _Scan(
                    eqn,
                    ins,
                    _fresh(eqn.outvars, sub),
                    body,
                    body_ins,
                    [_resolve(v, body_sub) for v in closed.jaxpr.outvars],
                    eqn.params["num_consts"],
                    eqn.params["num_carry"],
                )
            )
            continue
        if name == "cond":
            branches = []
            for closed in eqn.params["branches"]:
                branch_sub = dict(zip(closed.jaxpr.constvars, map(_Const, closed.consts)))
                branch_ins = _fresh(closed.jaxpr.invars, branch_sub)
                branch_ops = _flatten(closed.jaxpr, branch_sub)
                outs = [_resolve(v, branch_sub) for v in closed.jaxpr.outvars]
                branches.append(_Branch(branch_ops, branch_ins, outs))
            ops.append(_Cond(eqn, ins, _fresh(eqn.outvars, sub), branches))
            continue
        ops.append(_Eqn(eqn, ins, _fresh(eqn.outvars, sub)))
    return ops


def _is_var(atom) -> bool:
    return isinstance(atom, _V)


# Equations whose results W computes again from their inputs rather than keeping them from B. An all-gather's
# result is (devices on its axis) times its input, so keeping the input and gathering it again in W (one more
# collective per use, over the axis the forward gathered on) shrinks the boundary: under sequence parallelism
# these are the block inputs and output gradients the weight gradients multiply, gathered from s/t rows to s.
# A reshape, transpose or dtype conversion of one input no larger than its result is redone too (so W also
# reaches an all-gather behind it, and keeps a bf16 value rather than its fp32 conversion), and so is the
# identity `name` that a rematerialisation policy tags values with (`jax.ad_checkpoint.checkpoint_name`).
# An elementwise op whose other inputs are scalars (0-d), or a conversion to a narrower dtype, is redone when its one
# array input comes from an all-gather whose input is smaller than the op's result: FP8's quantisation of an
# all-gathered block input (`jaxpar.parallel.fp8`: convert, divide by the scale, clip, convert to FP8) is then
# redone in W from the s/t-row slice and the scale, instead of keeping the gathered s rows in FP8 (t/2 times the
# bf16 slice's bytes).
_REDO_IN_W = frozenset({"all_gather"})
_REDO_IF_NOT_SMALLER = frozenset(
    {"reshape", "transpose", "convert_element_type", "squeeze", "expand_dims", "copy", "name"}
)
_REDO_WITH_SCALARS = frozenset({"convert_element_type", "div", "mul", "clamp", "max", "min", "neg", "abs"})


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _redone_in_w(op) -> bool:
    if not isinstance(op, _Eqn):
        return False
    name = op.eqn.primitive.name
    if name in _REDO_IN_W:
        return True
    ins = [a for a in op.ins if _is_var(a)]
    return (
        name in _REDO_IF_NOT_SMALLER
        and len(ins) == 1
        and len(op.outs) == 1
        and _nbytes(ins[0].aval) <= _nbytes(op.outs[0].aval)
    )


class _Part:
    """The split of one flattened level (the top, or a scan body) into B and W (module docstring).

    `b_outs` are the atoms B must produce, `w_outs` those W must. After construction: `b_ops` (ops B runs, a
    scan as its B scan), `w_ops` (ops W runs; a scan that B also runs appears in both, each running its own
    part), `boundary` (vars W reads that it does not compute: B's results or the level's inputs), and per scan
    op its split (`scans[id(op)]`)."""

    def __init__(self, ops: list, b_outs: Sequence, w_outs: Sequence):
        self.ops = ops
        producer = {id(v): op for op in ops for v in op.outs}
        self.producer = producer
        # B: every op (for a scan, which of its outputs) the B outputs depend on.
        self.b_need: dict[int, set[int]] = {}  # id(op) -> indices of its outputs B computes
        self.scans: dict[int, _ScanSplit] = {}
        self.conds: dict[int, _CondSplit] = {}
        self._demand(b_outs, self.b_need, side="B")
        b_vars = {
            id(v) for op in ops if id(op) in self.b_need for k, v in enumerate(op.outs) if self._computed_by_b(op, k)
        }
        # W: what the W outputs depend on, stopping at values B computes or the level's inputs.
        self.w_need: dict[int, set[int]] = {}
        self.boundary: list = []
        seen_boundary: set[int] = set()
        stack = [a for a in w_outs if _is_var(a)]
        while stack:
            v = stack.pop()
            op = producer.get(id(v))
            if op is not None and id(v) in b_vars and (_redone_in_w(op) or self._redone_from_redone(op)):
                if id(op) not in self.w_need:
                    self.w_need[id(op)] = set(range(len(op.outs)))
                    stack += [a for a in op.ins if _is_var(a)]
                continue
            if op is None or id(v) in b_vars:
                if id(v) not in seen_boundary:
                    seen_boundary.add(id(v))
                    self.boundary.append(v)
                continue
            k = next(k for k, o in enumerate(op.outs) if o is v)
            need = self.w_need.setdefault(id(op), set())
            if k in need:
                continue
            need.add(k)
            stack += [a for a in self._inputs_for(op, {k}, side="W") if _is_var(a)]
        self.b_ops = [op for op in ops if id(op) in self.b_need]
        self.w_ops = [op for op in ops if id(op) in self.w_need]

    def _redone_from_redone(self, op) -> bool:
        """Whether `op` is an elementwise op of one array and scalars (`_REDO_WITH_SCALARS`) computed, through
        more such ops or those of `_REDO_IF_NOT_SMALLER`, from an all-gather whose input is smaller than `op`'s
        result (module comment at `_REDO_IN_W`): W then redoes the chain from the gather's input."""
        if not (isinstance(op, _Eqn) and op.eqn.primitive.name in _REDO_WITH_SCALARS):
            return False
        kept = _nbytes(op.outs[0].aval)  # what W would keep instead
        while isinstance(op, _Eqn) and len(op.outs) == 1:
            name = op.eqn.primitive.name
            if name in _REDO_IN_W:
                return sum(_nbytes(a.aval) for a in op.ins if _is_var(a)) < kept
            if name not in _REDO_WITH_SCALARS | _REDO_IF_NOT_SMALLER:
                return False
            arrays = [a for a in op.ins if _is_var(a) and a.aval.shape != ()]
            if len(arrays) != 1:
                return False
            op = self.producer.get(id(arrays[0]))
        return False

    def _computed_by_b(self, op, k: int) -> bool:
        if isinstance(op, _Scan):
            return k in self.scans[id(op)].b_outputs
        if isinstance(op, _Cond):
            return k in self.conds[id(op)].b_outputs
        return True

    def _demand(self, outs: Sequence, need: dict, side: str) -> None:
        stack = [a for a in outs if _is_var(a)]
        while stack:
            v = stack.pop()
            op = self.producer.get(id(v))
            if op is None:
                continue
            k = next(k for k, o in enumerate(op.outs) if o is v)
            got = need.setdefault(id(op), set())
            if k in got:
                continue
            got.add(k)
            stack += [a for a in self._inputs_for(op, got, side) if _is_var(a)]

    def _inputs_for(self, op, outputs: set[int], side: str) -> list:
        """The inputs `op` reads to produce `outputs` (all of them for a kept-whole op; for a split cond's W
        side also the values its B side returns for W, `_Cond.extras`)."""
        if isinstance(op, _Cond):
            if side == "B":
                cond_b = self.conds[id(op)] = _CondSplit(op, outputs)
                return [op.ins[0]] + [op.ins[1 + i] for i in sorted(cond_b.b_operands)]
            cond = self.conds.get(id(op))
            if cond is None:  # a cond B never touches: all of it is W's
                cond = self.conds[id(op)] = _CondSplit(op, set())
            cond.add_w(outputs)
            return [op.ins[0]] + [op.ins[1 + i] for i in sorted(cond.w_operands)] + cond.extra_outer()
        if not isinstance(op, _Scan):
            return op.ins
        if side == "B":
            split = _ScanSplit(op, outputs, set())
            self.scans[id(op)] = split
            return [op.ins[k] for k in sorted(split.b_inputs)]
        found = self.scans.get(id(op))
        if found is None:  # a scan B never touches: all of it is W's
            found = self.scans[id(op)] = _ScanSplit(op, set(), set())
        found.add_w(outputs)
        return [op.ins[k] for k in sorted(found.w_inputs)]


class _ScanSplit:
    """A scan's B scan (the outputs `b_outputs`, with the carries they need, plus the per-iteration boundary
    values as extra stacked outputs) and W scan (the other outputs W asks for)."""

    def __init__(self, op: _Scan, b_outputs: set[int], w_outputs: set[int]):
        self.op = op
        nc, nk = op.num_consts, op.num_carry
        # B's outputs grow to a fixed point: a carry B reads must be a carry B computes.
        b_out = set(b_outputs)
        while True:
            part = _Part(op.body, [op.body_outs[k] for k in sorted(b_out)], [])
            read = self._invars_read(part.b_ops, [op.body_outs[k] for k in sorted(b_out)])
            carries = {k for k in range(nk) if id(op.body_ins[nc + k]) in read}
            if carries <= b_out:
                break
            b_out |= carries
        self.b_outputs = b_out
        self.b_body = part
        self.b_inputs = {k for k, v in enumerate(op.body_ins) if id(v) in read} | {nc + k for k in b_out if k < nk}
        self.w_outputs: set[int] = set()
        self.w_inputs: set[int] = set()
        self.w_body: _Part | None = None
        self.add_w(w_outputs)

    def add_w(self, outputs: set[int]) -> None:
        op, nc, nk = self.op, self.op.num_consts, self.op.num_carry
        want = (set(outputs) | self.w_outputs) - self.b_outputs
        if not want or want == self.w_outputs:
            return
        while True:  # W's carries to a fixed point, as B's
            part = _Part(
                op.body, [op.body_outs[k] for k in sorted(self.b_outputs)], [op.body_outs[k] for k in sorted(want)]
            )
            carries = {k for k in range(nk) if any(v is op.body_ins[nc + k] for v in part.boundary)}
            w_carries = carries - self.b_outputs
            if w_carries <= want:
                break
            want |= w_carries
        self.w_outputs, self.w_body = want, part
        boundary = {id(v) for v in part.boundary}
        # W reads the scan's consts and xs from outside, its own carries' initial values, and B's boundary ys.
        self.w_inputs = {
            k for k, v in enumerate(op.body_ins) if id(v) in boundary and (k < nc or k >= nc + nk or (k - nc) in want)
        } | {nc + k for k in range(nk) if k in want}

    @staticmethod
    def _invars_read(ops: list, outs: list) -> set[int]:
        read = {id(a) for op in ops for a in op.ins if _is_var(a)}
        return read | {id(a) for a in outs if _is_var(a)}

    def per_iteration_boundary(self) -> list:
        """Body vars W's body reads that B's body computes or that are B carries' values: emitted by B per
        iteration (stacked), read by W as xs."""
        if self.w_body is None:
            return []
        op, nc, nk = self.op, self.op.num_consts, self.op.num_carry
        outside = {id(v) for k, v in enumerate(op.body_ins) if k < nc or k >= nc + nk or (k - nc) in self.w_outputs}
        return [v for v in self.w_body.boundary if id(v) not in outside]


class _CondSplit:
    """A cond's B cond (the outputs `b_outputs`, each branch running its own B part, plus the values each
    branch's W part reads from its B part as extra outputs, zeros from the other branches) and W cond (the other
    outputs W asks for, each branch running its W part on those values and the operands it reads).

    Used for the skip of an uneven pipeline split's padding rows (`jaxpar.model.stack.active_rows`): inside the
    layer scan, one branch is the layer's backward and the other the identity, so the boundary per row is the
    layer's (the identity's branch adds nothing)."""

    def __init__(self, op: _Cond, b_outputs: set[int]):
        self.op = op
        self.b_outputs = set(b_outputs)
        self.b_parts = [_Part(br.ops, [br.outs[k] for k in sorted(self.b_outputs)], []) for br in op.branches]
        self.b_operands = set()
        for br, part in zip(op.branches, self.b_parts):
            read = _ScanSplit._invars_read(part.b_ops, [br.outs[k] for k in sorted(self.b_outputs)])
            self.b_operands |= {i for i, v in enumerate(br.ins) if id(v) in read}
        self.w_outputs: set[int] = set()
        self.w_operands: set[int] = set()
        self.w_parts: list[_Part] = []
        self.w_extras: list[tuple[int, Any]] = []  # (branch, value inside it) that W reads from B

    def add_w(self, outputs: set[int]) -> None:
        want = (set(outputs) | self.w_outputs) - self.b_outputs
        if not want or want == self.w_outputs:
            return
        self.w_outputs = want
        b_outs = sorted(self.b_outputs)
        self.w_parts, self.w_operands, self.w_extras = [], set(), []
        for k, br in enumerate(self.op.branches):
            part = _Part(br.ops, [br.outs[j] for j in b_outs], [br.outs[j] for j in sorted(want)])
            if any(isinstance(o, (_Scan, _Cond)) for o in part.w_ops if id(o) in part.b_need):
                raise ValueError("a scan or cond split into B and W inside a cond's branch is not supported")
            position = {id(v): i for i, v in enumerate(br.ins)}
            for v in part.boundary:
                if id(v) in position:
                    self.w_operands.add(position[id(v)])
                else:
                    self.w_extras.append((k, v))
                    self.op.extra(k, v)
            self.w_parts.append(part)

    def extra_outer(self) -> list:
        """The outer values of `w_extras`, in their order."""
        return [self.op.extra(k, v) for k, v in self.w_extras]


def _run_cond(split: _CondSplit, env: dict, side: str) -> None:
    """One side of a split cond as a `jax.lax.switch`: B's (its outputs and every value `_Cond.extras` names)
    or W's (its outputs, from the operands it reads and B's extra values)."""
    op = split.op
    # the cond's innermost name scope (e.g. `jaxpar.model.stack`'s "active_rows") on the switch too: readers of
    # the compiled program tell the conds apart by it (`jaxpar.analysis.bench.report.skipped_rows_weights`)
    scope = str(op.eqn.source_info.name_stack).rsplit("/", 1)[-1]
    with jax.named_scope(scope) if scope else contextlib.nullcontext():
        _run_cond_side(split, env, side)


def _run_cond_side(split: _CondSplit, env: dict, side: str) -> None:
    op = split.op
    index = _read(env, op.ins[0])
    if side == "B":
        # every split of the enclosing level registers its extras on the op; the B cond returns them all (W reads
        # those of the last split; XLA drops the rest)
        extras = list(op.extras.items())
        operands = sorted(split.b_operands)
        outputs = sorted(split.b_outputs)

        def b_branch(k: int):
            br, part = op.branches[k], split.b_parts[k]

            def run(*xs):
                benv = {id(br.ins[i]): x for i, x in zip(operands, xs)}
                _run_b(part, benv, {})
                zero = lambda v: jnp.zeros(v.aval.shape, v.aval.dtype)  # noqa: E731
                mine = [
                    _read(benv, inner) if kk == k and id(inner) in benv else zero(inner)
                    for (kk, _), (inner, _) in extras
                ]
                return [_read(benv, br.outs[j]) for j in outputs], mine

            return run

        outs, extra_vals = jax.lax.switch(
            index, [b_branch(k) for k in range(len(op.branches))], *[_read(env, op.ins[1 + i]) for i in operands]
        )
        for j, x in zip(outputs, outs):
            env[id(op.outs[j])] = x
        for (_, (_, outer)), x in zip(extras, extra_vals):
            env[id(outer)] = x
        return
    operands = sorted(split.w_operands)
    outputs = sorted(split.w_outputs)
    outer = split.extra_outer()

    def w_branch(k: int):
        br, part = op.branches[k], split.w_parts[k]

        def run(*xs):
            benv = {id(br.ins[i]): x for i, x in zip(operands, xs[: len(operands)])}
            benv.update({id(v): x for (kk, v), x in zip(split.w_extras, xs[len(operands) :]) if kk == k})
            _run_w(part, benv, {})
            return [_read(benv, br.outs[j]) for j in outputs]

        return run

    args = [_read(env, op.ins[1 + i]) for i in operands] + [_read(env, v) for v in outer]
    outs = jax.lax.switch(index, [w_branch(k) for k in range(len(op.branches))], *args)
    for j, x in zip(outputs, outs):
        env[id(op.outs[j])] = x


def _read(env: dict, atom):
    """The value of an atom of the flattened backward (literals became `_Const`s in `_flatten`)."""
    return atom.val if isinstance(atom, _Const) else env[id(atom)]


def _run_eqn(op: _Eqn, env: dict) -> None:
    eqn = op.eqn
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*[_read(env, a) for a in op.ins], **params)
    out = out if eqn.primitive.multiple_results else [out]
    for v, x in zip(op.outs, out):
        env[id(v)] = x


def _run_b(part: _Part, env: dict, extra: dict) -> None:
    """B's ops of `part` on `env`; a split scan also stores its per-iteration boundary in `extra[id(op)]`."""
    for op in part.b_ops:
        if isinstance(op, _Eqn):
            _run_eqn(op, env)
        elif isinstance(op, _Cond):
            _run_cond(part.conds[id(op)], env, "B")
        else:
            _run_scan(part.scans[id(op)], env, extra, "B")


def _run_w(part: _Part, env: dict, extra: dict) -> None:
    """W's ops of `part` on `env`; a split scan reads its per-iteration boundary from `extra[id(op)]`."""
    for op in part.w_ops:
        if isinstance(op, _Eqn):
            _run_eqn(op, env)
        elif isinstance(op, _Cond):
            _run_cond(part.conds[id(op)], env, "W")
        else:
            _run_scan(part.scans[id(op)], env, extra, "W")


def _run_scan(split: _ScanSplit, env: dict, extra: dict, side: str) -> None:
    """One side of a split scan as a `jax.lax.scan`: B's (`side` "B": its outputs, and per iteration the boundary
    W's body reads, stacked into `extra[id(op)]`) or W's (`side` "W": its outputs, reading that boundary as xs)."""
    op, nc, nk = split.op, split.op.num_consts, split.op.num_carry
    ins = op.body_ins
    part: _Part | None
    if side == "B":
        outputs, inputs, part, run = split.b_outputs, split.b_inputs, split.b_body, _run_b
    else:
        outputs, inputs, part, run = split.w_outputs, split.w_inputs, split.w_body, _run_w
    assert part is not None  # a scan W runs has a W body (`_ScanSplit.add_w`)
    carry_ks = sorted(k for k in outputs if k < nk)
    y_ks = sorted(k for k in outputs if k >= nk)
    per_iter = split.per_iteration_boundary()
    consts = {id(ins[k]): _read(env, op.ins[k]) for k in range(nc) if k in inputs}
    xs_ks = [k for k in range(nc + nk, len(ins)) if k in inputs]
    xs = [_read(env, op.ins[k]) for k in xs_ks]
    init = [_read(env, op.ins[nc + k]) for k in carry_ks]

    def body(carry, x):
        outer_xs, bound = x
        benv = dict(consts)
        benv.update({id(ins[nc + k]): c for k, c in zip(carry_ks, carry)})
        benv.update({id(ins[k]): a for k, a in zip(xs_ks, outer_xs)})
        benv.update({id(v): a for v, a in zip(per_iter, bound)})  # W only: B's is empty
        run(part, benv, {})
        new = [_read(benv, op.body_outs[k]) for k in carry_ks]
        ys = [_read(benv, op.body_outs[k]) for k in y_ks]
        return new, (ys, [_read(benv, v) for v in per_iter] if side == "B" else [])

    bound_in = extra.get(id(op), []) if side == "W" else []
    carry, (ys, bound_out) = jax.lax.scan(
        body, init, (xs, bound_in), length=op.eqn.params["length"], reverse=op.eqn.params["reverse"]
    )
    for k, c in zip(carry_ks, carry):
        env[id(op.outs[k])] = c
    for k, y in zip(y_ks, ys):
        env[id(op.outs[k])] = y
    if side == "B":
        extra[id(op)] = bound_out


class SplitBackward:
    """A backward function split into B and W (module docstring).

    Args:
      backward: (*args) -> (input_grads, weight_grads), pytrees of arrays; traced once here with `args`.
      *args: example arguments (arrays or `jax.ShapeDtypeStruct`s) of the shapes and dtypes it will get.

    `b(*args)` returns (input_grads, boundary): the first as `backward` returns it, the second a list of arrays
    (shapes `boundary_avals`) to keep until `w(boundary)` returns weight_grads. Both run inside the trace that
    built the object (a shard_map's, when `backward` has collectives)."""

    def __init__(self, backward: Callable, *args):
        closed, out_shape = jax.make_jaxpr(backward, return_shape=True)(*args)
        x_tree, w_tree = out_shape
        self._x_tree, self._w_tree = jax.tree.structure(x_tree), jax.tree.structure(w_tree)
        n_x = len(jax.tree.leaves(x_tree))
        jaxpr = closed.jaxpr
        sub = dict(zip(jaxpr.constvars, map(_Const, closed.consts)))
        self._invars = _fresh(jaxpr.invars, sub)
        self._ops = _flatten(jaxpr, sub)
        outs = [_resolve(v, sub) for v in jaxpr.outvars]
        self._x_outs, self._w_outs = outs[:n_x], outs[n_x:]
        self._part = _Part(self._ops, self._x_outs, self._w_outs)
        self._scan_ids = [id(op) for op in self._part.b_ops if isinstance(op, _Scan) and id(op) in self._part.w_need]
        self.boundary_avals = [v.aval for v in self._part.boundary] + [
            jax.ShapeDtypeStruct((op.eqn.params["length"], *v.aval.shape), v.aval.dtype)
            for sid in self._scan_ids
            for op in [self._op(sid)]
            for v in self._part.scans[sid].per_iteration_boundary()
        ]

    def _op(self, sid: int):
        return next(op for op in self._ops if id(op) == sid)

    def b(self, *args) -> tuple[Any, list]:
        """B: (input gradients, boundary list)."""
        env = {id(v): x for v, x in zip(self._invars, jax.tree.leaves(args))}
        extra: dict = {}
        _run_b(self._part, env, extra)
        x = jax.tree.unflatten(self._x_tree, [_read(env, a) for a in self._x_outs])
        bound = [_read(env, v) for v in self._part.boundary]
        for sid in self._scan_ids:
            bound += list(extra[sid])
        return x, bound

    def w(self, boundary: Sequence) -> Any:
        """W: the weight gradients from B's boundary list."""
        n_top = len(self._part.boundary)
        env = {id(v): x for v, x in zip(self._part.boundary, boundary[:n_top])}
        extra, rest = {}, list(boundary[n_top:])
        for sid in self._scan_ids:
            n = len(self._part.scans[sid].per_iteration_boundary())
            extra[sid], rest = rest[:n], rest[n:]
        _run_w(self._part, env, extra)
        return jax.tree.unflatten(self._w_tree, [_read(env, a) for a in self._w_outs])


def boundary_bytes(split: SplitBackward) -> int:
    """Bytes of B's boundary for one call: what W's deferral keeps alive per stage-microbatch (module docstring)."""
    return int(sum(np.prod(a.shape, dtype=np.int64) * np.dtype(a.dtype).itemsize for a in split.boundary_avals))
