"""Model-state memory per device: the ZeRO formula and what XLA's compiled train step actually holds.

Symbols: P parameters, N size of the `data` axis (the group ZeRO partitions over), F size of the `fsdp` axis.

Formula (ZeRO, Rajbhandari et al. 2019, arXiv 1910.02054, section 3 and Figure 1). Bytes per parameter of
each state kind, as the layout defines them (`jaxpar.config.precision.LAYOUTS`):

    layout   params   grads   opt_state
    fp32     4        4       8  (Adam m, v)
    16p      2        2       12 (fp32 master, m, v)

Every kind is divided by F (the `fsdp` axis always partitions all three, see `jaxpar.parallel.sharding`) and also by N
when the ZeRO stage partitions it over `data` (1: opt_state; 2: + grads; 3: + params). With F = 1 this is
the ZeRO paper's Figure 1: 16p DDP 16P, ZeRO-1 4P + 12P/N, ZeRO-2 2P + 14P/N, ZeRO-3 16P/N; fp32 DDP 16P,
ZeRO-1 8P + 8P/N, ZeRO-2 4P + 12P/N, ZeRO-3 16P/N.

Expert parallelism (`model.moe.expert_axes`; `expert_state_bytes_formula`): the routed experts' weights, P_e per
tensor/pipeline rank after their split over the ep expert-parallel devices (E/ep experts each), take the same
bytes per parameter, divided by F only if fsdp is not an expert axis and by N (for the kinds the ZeRO stage
partitions) only if data is not one: state of kind k is b_k * P / (F * N_k) + b_k * P_e / (F_e * N_e,k).

Measurement (`measured_state_bytes`) comes from XLA's buffer assignment of the compiled programs
(`Compiled.memory_analysis()`, which for an SPMD program reports the per-device module's buffers); nothing is
executed. Two things are in those numbers that the formula does not count, and both are accounted for
explicitly rather than hidden in a tolerance:

  * scalars: the state's 0-d leaves (the `step` counter and optax's int32 `count`s of the schedule and of Adam,
    12 bytes here), reported as their own kind "scalars";
  * XLA's tuple index table: a program with n > 1 outputs reports n pointers (8 bytes each) on top of the
    output buffers in `output_size_in_bytes` (verified on CPU: an n-output jit reports n*8 extra bytes).
    Arguments are passed flattened, so `argument_size_in_bytes` has no such table.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from jaxpar.analysis.planner.dims import rank_params_split
from jaxpar.config.mesh_axes import DATA, FSDP
from jaxpar.config.precision import precision_layout
from jaxpar.parallel.sharding import STATE_KINDS, partitioned_over_data
from jaxpar.training.compiled_memory import MemoryBytes, memory_analysis_bytes
from jaxpar.training.plan import StepPlan
from jaxpar.training.step import make_grad_fn, make_train_step

_STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
POINTER_BYTES = 8  # one entry of XLA's tuple index table


def _bytes_per_param(layout: str, zero_stage: int) -> dict[str, int]:
    """Bytes per parameter of each state kind of `layout` (`jaxpar.config.precision.PrecisionLayout`); raises
    ValueError for an unknown layout or zero stage."""
    if zero_stage not in _STAGE_NAMES:
        raise ValueError(f"zero_stage {zero_stage!r} is not one of 0, 1, 2, 3")
    return precision_layout(layout).bytes_per_param


def state_bytes_formula(n_params: float, layout: str, zero_stage: int, data: int, fsdp: int) -> dict:
    """Model-state bytes per device predicted by the ZeRO formula (see the module docstring).

    Args:
      n_params: P, the number of parameters (a float such as 13e9 is taken as it is).
      layout: precision layout, `fp32` or `16p` (`PrecisionConfig.layout`).
      zero_stage: 0 (DDP) to 3.
      data: N, size of the `data` mesh axis.
      fsdp: F, size of the `fsdp` mesh axis.

    Returns:
      {"params", "grads", "opt_state" (incl. the fp32 master copy for 16p), "total"}: bytes per device (float).

    Raises:
      ValueError: unknown layout or zero stage, or a mesh axis size < 1.
    """
    per_param = _bytes_per_param(layout, zero_stage)
    if data < 1 or fsdp < 1:
        raise ValueError(f"mesh axis sizes must be >= 1, got data={data} fsdp={fsdp}")
    out = {}
    for kind in STATE_KINDS:
        divisor = fsdp * (data if partitioned_over_data(kind, zero_stage) else 1)
        out[kind] = per_param[kind] * n_params / divisor
    out["total"] = sum(out[k] for k in STATE_KINDS)
    return out


def expert_state_bytes_formula(
    dense_params: int,
    expert_params: int,
    layout: str,
    zero_stage: int,
    data: int,
    fsdp: int,
    expert_axes: tuple[str, ...] = (),
) -> dict:
    """Model-state bytes per device with expert parallelism (module docstring): `state_bytes_formula` of the
    dense P (`dense_params`) plus that of the experts' P_e (`expert_params`, per rank after the 1/ep split)
    with the storage axes that are not `expert_axes` (N_e = 1 when data is an expert axis, F_e = 1 when fsdp
    is). Equals `state_bytes_formula(dense_params + expert_params, ...)` without expert axes.

    Returns:
      {"params", "grads", "opt_state", "total", "experts" (the experts' part of the total)}: bytes per device
      (float).

    Raises:
      ValueError: as `state_bytes_formula`.
    """
    dense = state_bytes_formula(dense_params, layout, zero_stage, data, fsdp)
    expert = state_bytes_formula(
        expert_params,
        layout,
        zero_stage,
        1 if DATA in expert_axes else data,
        1 if FSDP in expert_axes else fsdp,
    )
    return {**{k: dense[k] + expert[k] for k in (*STATE_KINDS, "total")}, "experts": expert["total"]}


def formula_expression(layout: str, zero_stage: int, fsdp: int = 1) -> str:
    """The formula in use as text, e.g. `ZeRO-2 fp32: 4P + 12P/N` (`(...)/F` appended when fsdp > 1)."""
    per_param = _bytes_per_param(layout, zero_stage)
    whole = sum(b for k, b in per_param.items() if not partitioned_over_data(k, zero_stage))
    split = sum(b for k, b in per_param.items() if partitioned_over_data(k, zero_stage))
    terms = ([f"{whole}P"] if whole else []) + ([f"{split}P/N"] if split else [])
    expr = " + ".join(terms)
    if fsdp > 1:
        expr = f"({expr})/F"
    return f"{_STAGE_NAMES[zero_stage]} {layout}: {expr}"


def _kind_expression(layout: str, zero_stage: int, kind: str) -> str:
    b = _bytes_per_param(layout, zero_stage)[kind]
    return f"{b}P/N" if partitioned_over_data(kind, zero_stage) else f"{b}P"


def _shard_bytes(tree: Any, shardings: Any) -> int:
    """Per-device bytes of a pytree of arrays (or ShapeDtypeStructs) laid out with `shardings`."""
    per_leaf = jax.tree.map(
        lambda x, s: math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize, tree, shardings
    )
    return int(sum(jax.tree.leaves(per_leaf)))


def _scalar_bytes(tree: Any) -> int:
    return int(sum(np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree) if len(x.shape) == 0))


def _memory_analysis(compiled) -> MemoryBytes:
    memory = memory_analysis_bytes(compiled)
    if memory is None:
        raise RuntimeError(f"the {jax.default_backend()} backend returns no memory_analysis() for compiled code")
    return memory


def persistent_state_bytes(plan: StepPlan, compiled_step: Any, state: dict, batch: dict) -> dict:
    """Bytes per device of the train state held across steps, from an already compiled train step.

    Returns "persistent" (memory_analysis arguments minus the batch), "params" (shard bytes), "scalars",
    "fp8_history" (FP8 delayed scaling's amax history, shard bytes; 0 without), "opt_state" (persistent - params -
    scalars - fp8_history) and "temp"; see `measured_state_bytes`.
    """
    # every array the step takes as its batch (with packed documents, their segment_ids too)
    batch_bytes = _shard_bytes(dict(batch), {k: plan.batch_sharding for k in batch})
    analysis = _memory_analysis(compiled_step)
    persistent = analysis["argument_bytes"] - batch_bytes
    params = _shard_bytes(state["params"], plan.state_shardings["params"])
    scalars = _scalar_bytes(state)
    history = _shard_bytes(state["fp8"], plan.state_shardings["fp8"]) if "fp8" in state else 0
    return {
        "persistent": persistent,
        "params": params,
        "scalars": scalars,
        "fp8_history": history,
        "opt_state": persistent - params - scalars - history,
        "temp": analysis["temp_bytes"],
    }


def gradient_bytes_from_shardings(plan: StepPlan, params: Any) -> int:
    """Per-device bytes of the step's gradients from their shardings (`plan.specs["grads"]`), without compiling;
    `measured_state_bytes` measures the same number from the compiled gradient function."""
    shardings = jax.tree.map(
        lambda spec: jax.sharding.NamedSharding(plan.mesh, spec),
        plan.specs["grads"],
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )
    return _shard_bytes(jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, plan.param_dtype), params), shardings)


def measured_state_bytes(plan: StepPlan, state: dict, batch: dict, compiler_options: dict | None = None) -> dict:
    """Model-state bytes per device as XLA allocates them for the compiled train step and gradient function.

    Compiles (never runs) `make_train_step(plan)` on (state, batch) and `make_grad_fn(plan)` on
    (state["params"], batch).

    Args:
      plan: the step plan.
      state: train state from `init_state` (arrays or ShapeDtypeStructs); laid out as `plan.state_shardings`.
      batch: {"inputs", "targets": int32 [B, T], "loss_mask": float32 [B, T]} (arrays or ShapeDtypeStructs).
      compiler_options: passed to `Lowered.compile`. {"xla_backend_optimization_level": 0} compiles about
        3x faster on CPU and changes only code generation, not buffer assignment: every number below was
        identical with and without it for this step (checked on XLA:CPU).

    Returns:
      bytes per device (int):
        "persistent": step arguments minus the per-device batch (memory_analysis) = the whole train state;
        "params": shard bytes of state["params"] (from `shard_shape` of their shardings);
        "scalars": 0-d leaves of the state (step, optax counts), not in the formula;
        "opt_state": persistent - params - scalars (Adam m, v and, for 16p, the fp32 master copy);
        "grads": gradient-function outputs (memory_analysis) minus its tuple index table and the two fp32
          scalars (loss, token count); gradients exist only inside the step;
        "temp": the step's temporary buffers (activations, gathered weights, gradients, update scratch);
        "total": params + grads + opt_state (comparable with the formula's total).

    Raises:
      RuntimeError: the backend reports no memory analysis.
    """
    step = make_train_step(plan).lower(state, batch).compile(compiler_options)
    out = persistent_state_bytes(plan, step, state, batch)
    grad_compiled = jax.jit(make_grad_fn(plan)).lower(state["params"], batch).compile(compiler_options)
    n_outputs = len(jax.tree.leaves(grad_compiled.out_info))
    grad_out = _memory_analysis(grad_compiled)["output_bytes"]
    table = POINTER_BYTES * n_outputs if n_outputs > 1 else 0  # XLA's tuple index table
    out["grads"] = grad_out - table - 2 * 4  # and the fp32 loss and n_tokens
    out["total"] = out["params"] + out["grads"] + out["opt_state"]
    return out


def memory_table(
    plan: StepPlan, state: dict, batch: dict, measured: dict | None = None, compiler_options: dict | None = None
) -> list[dict]:
    """Measured (`measured_state_bytes`) against formula (`state_bytes_formula`) bytes per device.

    `measured` reuses an earlier `measured_state_bytes(plan, state, batch)` result instead of compiling again;
    `compiler_options` is passed on to it otherwise.

    Returns:
      rows {"kind", "measured_bytes", "formula_bytes", "ratio" (measured / formula), "formula" (per-kind
      term, e.g. "12P/N"), "expression" (the whole formula, e.g. "ZeRO-2 fp32: 4P + 12P/N")} for params,
      grads, opt_state, total, then scalars, fp8 (the amax history, with FP8 delayed scaling) and temp (formula_bytes
      and ratio None: the formula has no term).
    """
    cfg = plan.cfg
    layout, zero = cfg.precision.layout, cfg.optimizer.zero_stage
    shape = plan.mesh_shape
    experts = tuple(cfg.model.moe.expert_axes) if cfg.model.moe.enabled else ()
    dense, expert = rank_params_split(cfg.model, shape, experts)  # P per tensor/pipeline rank, experts 1/ep
    n_params = dense + expert
    formula = expert_state_bytes_formula(dense, expert, layout, zero, shape[DATA], shape[FSDP], experts)
    if measured is None:
        measured = measured_state_bytes(plan, state, batch, compiler_options)
    expression = formula_expression(layout, zero, shape[FSDP])
    if experts:
        expression += f" for the dense P={dense:,}, experts' P_e={expert:,} without the expert axes {experts}"
    rows = []
    # the state's "fp8" entry (FP8 delayed scaling's amax history) when it has one: outside the formula, as scalars
    extra = ("fp8",) if measured.get("fp8_history") else ()
    measured = {**measured, "fp8": measured.get("fp8_history", 0)}
    for kind in (*STATE_KINDS, "total", "scalars", *extra, "temp"):
        f = formula.get(kind)
        term = (
            _kind_expression(layout, zero, kind)
            if kind in STATE_KINDS
            else expression.split(": ", 1)[1]
            if kind == "total"
            else "-"
        )
        rows.append(
            {
                "kind": kind,
                "measured_bytes": measured[kind],
                "formula_bytes": f,
                "ratio": None if not f else measured[kind] / f,
                "formula": term,
                "expression": expression,
                "n_params": n_params,
                DATA: shape[DATA],
                FSDP: shape[FSDP],
            }
        )
    return rows


def state_memory_report(plan: StepPlan, compiled_step: Any, state: dict, batch: dict) -> str:
    """The model state per device of a compiled train step beside the ZeRO formula, as text: parameters and
    optimizer state measured from `compiled_step` (`persistent_state_bytes`), gradients from their shardings
    (`gradient_bytes_from_shardings`), formatted by `format_memory_table`. A `jaxpar.training.loop.CompiledHook`
    (jaxpar-train logs it at start)."""
    measured = persistent_state_bytes(plan, compiled_step, state, batch)
    measured["grads"] = gradient_bytes_from_shardings(plan, state["params"])
    measured["total"] = measured["params"] + measured["grads"] + measured["opt_state"]
    return (
        "model state per device (parameters and optimizer state measured from the compiled step, gradients "
        "from their shardings):\n" + format_memory_table(memory_table(plan, state, batch, measured))
    )


def format_memory_table(rows: list[dict]) -> str:
    """Plain-text table of `memory_table` rows: kind | measured bytes | formula bytes | ratio | term."""
    if not rows:
        return ""
    head = rows[0]
    lines = [
        f"{head['expression']}   (P={head['n_params']:,} per tensor/pipeline rank, N=data={head[DATA]}, "
        f"F=fsdp={head[FSDP]};"
        " bytes per device)",
        f"{'kind':<10} | {'measured':>14} | {'formula':>14} | {'ratio':>7} | term",
    ]
    for r in rows:
        f = "-" if r["formula_bytes"] is None else f"{r['formula_bytes']:,.0f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.4f}"
        lines.append(f"{r['kind']:<10} | {r['measured_bytes']:>14,} | {f:>14} | {ratio:>7} | {r['formula']}")
    return "\n".join(lines)
