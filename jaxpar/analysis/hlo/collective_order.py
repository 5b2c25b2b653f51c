"""Collectives that devices may start in different orders on XLA:CPU, read from a compiled program's HLO text.

    compiled = jax.jit(step).lower(*args).compile()
    assert unordered_collectives(compiled.as_text()) == []

XLA:CPU runs a device's program as a dataflow graph and orders collectives only by when they *start*: a
collective scheduled after a while loop (or call) that holds collectives may start as soon as the loop has
started, unless it consumes the loop's results. Devices then issue the loop's later collectives and that one in
different orders. Each in-process collective blocks a thread of one pool shared by all devices until its peers
arrive, so such a program can deadlock (jaxpar's 1F1B step did, on 16 simulated devices, until its ticks
ordered their collectives by data dependencies: `jaxpar.parallel.pipeline`). GPUs run each device's program in
schedule order and are not affected; a program free of such pairs is safe on both.

`unordered_collectives` lists every pair of collective users in one computation of the schedule, at least one of
them a loop, where the later one does not depend on the earlier through its operands: a loop may start before an
earlier collective it does not consume has finished, just as a later collective may start while a loop runs. A
collective user is a collective op or a while/call/conditional whose computations (transitively) hold one.
Across processes (jax.distributed on CPU) XLA:CPU's collectives also mixed up the messages of such a pair: a
2-process data x tensor x pipeline step updated some weights wrongly in about one step of 40 under load.
"""

from __future__ import annotations

from jaxpar.analysis.hlo.collectives import NESTING_OPCODES, parse_module, through_calls

_COLLECTIVE_OPCODES = {
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
    "all-reduce-start",
    "all-gather-start",
    "collective-permute-start",
}


def unordered_collectives(hlo_text: str, *, after_loops_only: bool = False) -> list[tuple[str, str, str, str]]:
    """(computation, earlier collective user, later collective user, the later one's opcode) for each pair in
    one computation, at least one of them a loop (a while, call or conditional holding collectives), where the
    later one does not consume the earlier. Empty for a program every device issues in one order. The text must
    be a scheduled module (a compiled executable's `as_text()`). With `after_loops_only` only the pairs whose
    earlier member is a loop (a collective free to start while a loop runs; the deadlock on 16 devices)."""
    comps, _, _ = parse_module(hlo_text)
    uses_collectives = through_calls(comps, lambda ins: ins.opcode in _COLLECTIVE_OPCODES)

    out: list[tuple[str, str, str, str]] = []
    for comp, instrs in comps.items():
        operands = {ins.name: ins.operands for ins in instrs}
        ancestors: dict[str, frozenset[str]] = {}

        def upstream(name: str, operands=operands, ancestors=ancestors) -> frozenset[str]:
            if name not in ancestors:
                stack, seen = list(operands.get(name, ())), set()
                while stack:
                    n = stack.pop()
                    if n not in seen:
                        seen.add(n)
                        stack.extend(operands.get(n, ()))
                ancestors[name] = frozenset(seen)
            return ancestors[name]

        users: list[tuple[str, bool]] = []  # (name, is a loop) of the collective users scheduled so far
        for ins in instrs:
            nested = ins.opcode in NESTING_OPCODES and uses_collectives(ins)
            if ins.opcode in _COLLECTIVE_OPCODES or nested:
                out.extend(
                    (comp, earlier, ins.name, ins.opcode)
                    for earlier, loop in users
                    if (loop or (nested and not after_loops_only)) and earlier not in upstream(ins.name)
                )
                users.append((ins.name, nested))
    return out
