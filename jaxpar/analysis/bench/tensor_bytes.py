"""Activation-collective bytes of jaxpar's explicit tensor parallelism against the compiler-chosen partitioning of
the same model, read from the compiled programs' HLO (bytes per device per step, loop trip counts included).

    row = compare_steps(cfg, devices)      # compiles both programs for `devices` (CPU or compile-only GPU)
    print(format_table([row]))

The explicit program is `jaxpar.training.step.make_train_step` (collectives written out in shard_map,
`jaxpar.parallel.tensor`); the compiler-chosen one is `jaxpar.analysis.bench.baselines.compiler_chosen_step` (one
jit over global arrays, parameters placed by the same shardings, the XLA partitioner inserts every collective).
Both run the model with the config's `model.remat` policy.

Activation collectives are those whose replica groups are the `tensor` axis alone (`jaxpar.analysis.hlo.collectives
.classify_groups`): the Megatron enters and exits of every block, the embedding's and head's, the cross-entropy's
[b, T] statistics and, with sequence parallelism, the norm-scale gradient sum. Gradient reductions and weight
gathers run over the batch and storage axes (data, fsdp) and are reported apart (`gradient_dtypes`: jaxpar keeps
them in `precision.reduce_dtype`, fp32 by default; the compiler-chosen program reduces the bf16 gradients of the
16p layout in bf16). Bytes are ring bytes sent per device (`jaxpar.analysis.hlo.ring.ring_bytes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxpar.analysis.hlo.collectives import classify_groups, parse_collectives
from jaxpar.analysis.hlo.text import compiled_hlo_text
from jaxpar.config.mesh_axes import DATA_PARALLEL_AXES, TENSOR
from jaxpar.log import human_bytes

ACTIVATION_AXES = (TENSOR,)
_REDUCTIONS = ("all-reduce", "reduce-scatter")


@dataclasses.dataclass(frozen=True)
class ProgramBytes:
    """What one compiled step moves, per device per step.

    Attributes:
      activation_bytes: ring bytes of the collectives over `tensor` alone (module docstring).
      activation_by_kind: {kind: {"count", "bytes"}} of those.
      total_bytes: ring bytes of every collective of the program (all axes).
      gradient_dtypes: sorted dtypes of the non-scalar floating-point reductions over the batch-splitting axes
        (data, fsdp): the gradient reductions.
      temp_bytes: XLA's temporary buffer bytes of the compiled program (`memory_analysis`), None if absent.
    """

    activation_bytes: float
    activation_by_kind: dict
    total_bytes: float
    gradient_dtypes: tuple[str, ...]
    temp_bytes: int | None


def program_bytes(hlo_text: str, mesh, temp_bytes: int | None = None) -> ProgramBytes:
    """Reads a compiled step's HLO text (`compiled.as_text()`) on `mesh` into a `ProgramBytes`.

    Raises:
      ValueError: replica groups in a form `jaxpar.analysis.hlo.collectives.parse_replica_groups` does not understand.
    """
    by_kind: dict = {}
    activation = total = 0.0
    grad_dtypes: set[str] = set()
    for c in parse_collectives(hlo_text):
        moved = c.times_per_step * c.bytes_per_device
        total += moved
        axes = classify_groups(c.groups, mesh)
        if axes == ACTIVATION_AXES:
            activation += moved
            entry = by_kind.setdefault(c.kind, {"count": 0, "bytes": 0.0})
            entry["count"] += c.times_per_step
            entry["bytes"] += moved
        elif axes and set(axes) <= set(DATA_PARALLEL_AXES) and c.kind in _REDUCTIONS:
            grad_dtypes |= {a.dtype for a in c.operands if a.shape and a.dtype.startswith(("f", "bf"))}
    return ProgramBytes(activation, by_kind, total, tuple(sorted(grad_dtypes)), temp_bytes)


def compile_steps(cfg, devices: Sequence) -> dict:
    """Compiles the explicit and the compiler-chosen step of a resolved `cfg` on a mesh over `devices` (simulated
    CPU devices, or the compile-only GPU devices of `jaxpar.analysis.gpu.deviceless.compile_devices`) with abstract
    state and batch; nothing runs.

    Returns:
      {"mesh": the jax Mesh, "explicit": `ProgramBytes`, "compiler": `ProgramBytes`}.

    Raises:
      ConfigError: the config does not fit the devices (`jaxpar.parallel.mesh.build_mesh`).
    """
    from jaxpar.analysis.bench.baselines import compiler_chosen_step
    from jaxpar.data.batch import abstract_batch
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.training.compiled_memory import memory_analysis_bytes
    from jaxpar.training.plan import build_plan
    from jaxpar.training.state import abstract_state
    from jaxpar.training.step import make_train_step

    mesh = build_mesh(cfg, devices)
    plan = build_plan(cfg, mesh)
    state = abstract_state(plan)
    batch = abstract_batch(cfg.train.global_batch_size, cfg.data.seq_len, plan.batch_sharding)
    out: dict[str, Any] = {"mesh": mesh}
    for name, step in (("explicit", make_train_step(plan)), ("compiler", compiler_chosen_step(plan))):
        compiled = step.lower(state, batch).compile()
        memory = memory_analysis_bytes(compiled)
        out[name] = program_bytes(compiled_hlo_text(compiled), mesh, memory["temp_bytes"] if memory else None)
    return out


def ratio(explicit: float, compiler: float) -> float | None:
    """explicit / compiler bytes; 1.0 when both are 0, None when only the compiler's is 0."""
    if compiler:
        return explicit / compiler
    return 1.0 if not explicit else None


def format_table(rows: Sequence[dict]) -> str:
    """Text table of rows {"layout", "remat", "explicit": ProgramBytes, "compiler": ProgramBytes}: activation
    bytes (tensor axis) of each and their ratio, all collectives' bytes of each, the gradient-reduction dtypes
    and the temporary memory of each compiled program."""
    head = (
        f"{'layout':<22}{'remat':<7}{'act. explicit':>14}{'act. compiler':>14}{'ratio':>7}"
        f"{'all explicit':>14}{'all compiler':>14}{'grad dtype expl./comp.':>24}{'temp expl.':>12}{'temp comp.':>12}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        e, c = r["explicit"], r["compiler"]
        q = ratio(e.activation_bytes, c.activation_bytes)
        dtypes = f"{','.join(e.gradient_dtypes) or '-'} / {','.join(c.gradient_dtypes) or '-'}"
        lines.append(
            f"{r['layout']:<22}{r['remat']:<7}{human_bytes(e.activation_bytes):>14}{human_bytes(c.activation_bytes):>14}"
            f"{'-' if q is None else f'{q:.3f}':>7}{human_bytes(e.total_bytes):>14}{human_bytes(c.total_bytes):>14}"
            f"{dtypes:>24}{human_bytes(e.temp_bytes):>12}{human_bytes(c.temp_bytes):>12}"
        )
    return "\n".join(lines)
