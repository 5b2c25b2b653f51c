"""The training loop behind `jaxpar-train`: data, compiled step and resume here; validation, metrics,
checkpoints, progress bar, sample, watchdog, preemption and divergence rollback as hooks (`jaxpar.training.hooks`).

    result = train(load_config("configs/tiny.yaml", ["train.steps=50"]))
    result = train(cfg, loss_fn=cross_entropy_with_z_loss(1e-4), optimizer=skip_nonfinite(optax.lion(1e-4)))
    result = train(cfg, hooks=[*default_hooks(cfg), MyHook()])

(the second with a caller's own loss and optimizer, from `jaxpar.training.loss` and `jaxpar.training.optimizer`; the
last with a hook of the caller's own, `jaxpar.training.hooks.Hook`).

A run directory holds `config.yaml` (the resolved config), `metrics.jsonl`, `tensorboard/` and
`checkpoints/<step>/`. Starting in a directory that has complete checkpoints resumes from the latest one
(parameters, optimizer state, step and data position), so a resumed run reproduces the uninterrupted one.
The train step is lowered and compiled once, ahead of time, and that executable runs every step: a state whose
sharding drifted would raise instead of silently recompiling.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax

from jaxpar.checkpoint.store import RUN_CHECKPOINT_DIR, Checkpointer
from jaxpar.config import Config, ConfigError, resolve_config
from jaxpar.data import IteratorLoader, build_loaders
from jaxpar.data.iterator import StatefulIterator
from jaxpar.data.loader import serves_segment_ids
from jaxpar.model import flops as flops_lib
from jaxpar.model.params import fit_stack
from jaxpar.parallel import zero_bubble
from jaxpar.parallel.distributed import describe_process
from jaxpar.parallel.mesh import build_mesh, describe
from jaxpar.training.compiled_memory import memory_analysis_bytes
from jaxpar.training.faults import FaultInjector
from jaxpar.training.hooks import Hook, RunContext, TrainingDiverged, TrainResult, default_hooks, evaluate
from jaxpar.training.hooks.base import log as _log
from jaxpar.training.init_from import check_init_from, check_init_from_tokenizer, resumes
from jaxpar.training.loss import LossFn
from jaxpar.training.metrics import MetricsWriter, default_trackers
from jaxpar.training.optimizer import nonfinite_state
from jaxpar.training.pipelined import stage_layout
from jaxpar.training.plan import StepPlan, build_plan
from jaxpar.training.start_state import check_restore_from, check_run_dir, initial_state
from jaxpar.training.state import abstract_state
from jaxpar.training.step import make_eval_step, make_train_step

# TrainResult, TrainingDiverged and evaluate are defined in jaxpar.training.hooks; a run's callers may import them
# from here too.
__all__ = ["CompiledHook", "TrainResult", "TrainingDiverged", "evaluate", "train"]

_LOGGER = logging.getLogger("jaxpar.training")


def _memory_bytes(compiled) -> dict[str, int | None]:
    """Per-device memory: the allocator's peak where the backend reports it, and the compiled step's need."""
    stats = jax.local_devices()[0].memory_stats() or {}
    analysis = memory_analysis_bytes(compiled)
    return {
        "memory_peak_bytes": stats.get("peak_bytes_in_use"),
        "memory_step_bytes": None if analysis is None else analysis["peak_bytes"],
    }


# Called once the train step is compiled, with (plan, compiled step, state, first batch); returns a report to
# log, or None. jaxpar-train passes `jaxpar.analysis.planner.memory.state_memory_report` (the ZeRO table).
CompiledHook = Callable[[StepPlan, Any, dict, dict], "str | None"]


def _checked_hooks(hooks: Sequence[Hook]) -> list[Hook]:
    """`hooks` as a list, each a `Hook` instance with a whole `every` >= 0.

    Raises:
      TypeError / ValueError: naming the entry and the fix.
    """
    if isinstance(hooks, Hook) or not isinstance(hooks, Sequence):
        raise TypeError(
            f"hooks must be a list of Hook instances, e.g. hooks=[*default_hooks(cfg), MyHook()]; got "
            f"{type(hooks).__name__}"
        )
    out = list(hooks)
    for i, hook in enumerate(out):
        if not isinstance(hook, Hook):
            what = f"the class {hook.__name__}" if isinstance(hook, type) else repr(hook)
            raise TypeError(
                f"hooks[{i}] is {what}, not a jaxpar.training.hooks.Hook instance; subclass Hook and "
                f"pass an instance, e.g. hooks=[*default_hooks(cfg), MyHook()]"
            )
        every = hook.every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(
                f"hooks[{i}] ({type(hook).__name__}) has every={every!r}; give a whole number of "
                f"steps >= 1 (0: on_step never runs), or override its due()"
            )
    return out


def _loaders(cfg: Config, plan: StepPlan, data: StatefulIterator | None):
    """(train loader, validation loader, their counts): the config's corpus, or the caller's `data` iterator
    for training.

    Raises:
      ConfigError: the corpus is packed with segment ids (`data.document_masking`) but the model's `run_blocks`
        takes none, so its attention would cross documents.
    """
    t = cfg.train
    if serves_segment_ids(cfg.data) and not plan.mdef.takes_segment_ids:
        raise ConfigError(
            f"model.name={cfg.model.name!r} takes no segment ids (its run_blocks has no fourth parameter), but "
            f"data.document_masking=true packs documents that attention must not cross; set "
            f"data.document_masking=false, or give run_blocks a segment_ids_BT parameter and pass it to "
            f"jaxpar.model.attention.dot_product_attention"
        )
    train_loader, val_loader, info = build_loaders(
        cfg.data,
        t.global_batch_size,
        plan.batch_sharding,
        cfg.model.vocab_size,
        t.eval_batches,
        vocab_multiple=cfg.mesh.tensor,
    )
    what = "a mixture of " + ", ".join(s.name for s in cfg.data.sources) if cfg.data.sources else cfg.data.source
    if data is not None:
        train_loader = IteratorLoader(data, t.global_batch_size, cfg.data.seq_len, plan.batch_sharding)
        _log(
            f"data: training batches from the caller's {_public_name(data)} ({train_loader.local_rows} rows of "
            f"{cfg.data.seq_len} tokens per process per step); validation from {what}"
        )
    _log(
        f"data: {what}: {info.train_tokens:,} train tokens ({info.train_sequences:,} sequences of {info.seq_len}), "
        f"{info.val_tokens:,} validation tokens; each evaluation scores {info.val_coverage()}"
    )
    for name, one in info.sources.items():
        _log(
            f"data: source {name}: weight {one.weight:.4f}, {one.train_tokens:,} train tokens "
            f"({one.train_sequences:,} sequences), validation scores {one.val_scored_tokens:,} tokens "
            f"({one.val_scored_sequences:,} of {one.val_sequences:,} sequences), reported as val_loss/{name}"
        )
    return train_loader, val_loader, info


def _model_flops(cfg: Config, state: dict) -> tuple[float, float | None, float | None]:
    """(model FLOPs per token, hardware FLOPs per token or None, peak FLOP/s per device or None), logged
    (`jaxpar.model.flops.model_flops`)."""
    # the model's own layers: a stack stored with zero rows past them (jaxpar.parallel.layer_split) counts without
    depth = cfg.model.stack_depth
    params = jax.eval_shape(lambda p: fit_stack(p, depth, depth), state["params"])
    n_params = flops_lib.param_count(params)
    flops_per_token, hardware_flops = flops_lib.model_flops(cfg, params)
    peak = flops_lib.peak_flops(jax.devices()[0].device_kind, cfg.train.peak_flops_per_device)
    hardware = (
        f"{hardware_flops:,.0f} hardware FLOPs/token with recompute (remat {cfg.model.remat})"
        if hardware_flops is not None
        else f"hardware FLOPs unknown (model {cfg.model.name!r} registered no recompute count; HFU null)"
    )
    _log(
        f"model {cfg.model.name}: {n_params:,} parameters; {flops_per_token:,.0f} model FLOPs/token (6N + 12*L*h*s, "
        f"PaLM app. B), {hardware}; "
        f"peak {'unknown, MFU null' if peak is None else f'{peak:.3g} FLOP/s per device'}"
    )
    return flops_per_token, hardware_flops, peak


def _start_run(
    cfg: Config,
    stack: contextlib.ExitStack,
    *,
    loss_fn,
    optimizer,
    learning_rate,
    data,
    on_compiled: Sequence[CompiledHook],
) -> tuple[RunContext, dict]:
    """Builds the mesh, plan, data and state (restored or fresh), compiles the step and opens the checkpointer
    and the metrics writer on `stack`; returns the run's context and the first training batch."""
    _check_before_device_work(cfg, optimizer)
    mesh = build_mesh(cfg)
    plan = build_plan(cfg, mesh, loss_fn=loss_fn, optimizer=optimizer, learning_rate=learning_rate)
    cfg = plan.cfg  # `precision.compute_dtype` resolved for the mesh's devices: the config the run saves
    _log_setup(plan, caller_optimizer=optimizer is not None)
    train_loader, val_loader, info = _loaders(cfg, plan, data)
    ckpt = _checkpointer(cfg, stack)
    state = initial_state(cfg, plan, ckpt, train_loader)
    flops_per_token, hardware_flops, peak = _model_flops(cfg, state)
    first_batch = train_loader.next_batch()
    compiled, memory = _compiled_step(plan, state, first_batch, on_compiled, caller_optimizer=optimizer is not None)
    writer = _metrics_writer(cfg, stack, first_step=int(state["step"]) + 1 if int(state["step"]) else 0)
    run = RunContext(
        cfg=cfg,
        plan=plan,
        mesh=mesh,
        compiled=compiled,
        train_loader=train_loader,
        val_loader=val_loader,
        eval_step=make_eval_step(plan),
        data_info=info,
        checkpointer=ckpt,
        writer=writer,
        stack=stack,
        start_step=int(state["step"]),
        state=state,
        memory=memory,
        flops_per_token=flops_per_token,
        hardware_flops_per_token=hardware_flops,
        peak_flops=peak,
        peak_fp8_flops=(
            flops_lib.peak_flops(
                jax.devices()[0].device_kind, cfg.train.peak_fp8_flops_per_device, table=flops_lib.PEAK_FP8_FLOPS
            )
            if cfg.precision.fp8.enabled
            else None
        ),
    )
    return run, first_batch


def _check_before_device_work(cfg: Config, optimizer) -> None:
    """What a run can refuse or warn about before any device work: a warm-up longer than the run (the default
    optimizer), `model.init_from` weights that do not fit (read from config files and headers only), and a
    `checkpoint.restore_from` that cannot seed the run.

    Raises:
      ConfigError: from `jaxpar.training.init_from.check_init_from` / `check_init_from_tokenizer`, and
        `jaxpar.training.start_state.check_restore_from`.
    """
    t = cfg.train
    if optimizer is None and cfg.optimizer.warmup_steps > t.steps:
        _log(
            f"warning: optimizer.warmup_steps={cfg.optimizer.warmup_steps} > train.steps={t.steps}: the learning "
            f"rate reaches only {t.steps / cfg.optimizer.warmup_steps:.0%} of optimizer.learning_rate and never "
            f"decays; lower optimizer.warmup_steps to reach the peak"
        )
    if cfg.model.init_from and not resumes(t.run_dir):  # reads only config files and headers: before device work
        check_init_from(cfg.model)
        check_init_from_tokenizer(cfg)
    check_restore_from(cfg)  # reads the checkpoint's format and config items only


def _log_setup(plan: StepPlan, *, caller_optimizer: bool) -> None:
    """Logs this process, and (from process 0) the mesh, precision and attention the plan resolved, the
    pipeline schedule, and what a caller's own optimizer leaves out."""
    cfg = plan.cfg
    _LOGGER.info(f"jaxpar: {describe_process()}")  # every process, once
    _log(
        f"jaxpar: mesh {describe(plan.mesh)}, zero_stage {cfg.optimizer.zero_stage}, "
        f"compute {np.dtype(plan.compute_dtype).name}"
        f"{f' with FP8 GEMMs ({cfg.precision.fp8.scaling} scaling)' if cfg.precision.fp8.enabled else ''}, layout "
        f"{cfg.precision.layout}, attention {plan.attention} (model.attention {cfg.model.attention})"
    )
    if cfg.mesh.pipeline > 1:
        pipe = cfg.pipeline
        layout = stage_layout(plan)
        every = cfg.model.moe.every if cfg.model.moe.enabled else 1
        chunks = cfg.mesh.pipeline * pipe.virtual_stages
        counts = layout.counts if layout is not None else (cfg.model.stack_depth // chunks,) * chunks
        split = [c * every for c in counts]
        chosen = " (pipeline.balance_stages)" if pipe.balance_stages else ""
        _log(
            "pipeline: "
            + zero_bubble.describe(
                pipe.schedule, cfg.mesh.pipeline, pipe.virtual_stages, pipe.microbatches, pipe.recompute
            )
            + f"; layers per model chunk: {split}{chosen}"
            + ("; head split over the stages by vocabulary" if pipe.vocab_parallel else "")
        )
    if caller_optimizer:
        skips = nonfinite_state(abstract_state(plan)["opt_state"]) is not None
        _log(
            "optimizer: the caller's optax transformation (optimizer.* keys other than zero_stage are not read)"
            + (
                ""
                if skips
                else "; it has no skip_nonfinite wrapper: a NaN or inf update is applied, and "
                "train.max_bad_steps and train.divergence_rollbacks cannot act"
            )
        )


def _checkpointer(cfg: Config, stack: contextlib.ExitStack) -> Checkpointer | None:
    """The run's checkpointer of RUN_DIR/checkpoints, closed with `stack`; None with `checkpoint.every_steps=0`."""
    if cfg.checkpoint.every_steps == 0:
        return None
    ckpt = Checkpointer(
        os.path.join(cfg.train.run_dir, RUN_CHECKPOINT_DIR),
        every_steps=cfg.checkpoint.every_steps,
        keep=cfg.checkpoint.keep,
        async_save=cfg.checkpoint.async_save,
    )
    stack.callback(ckpt.close)
    return ckpt


def _compiled_step(
    plan: StepPlan, state: dict, first_batch: dict, on_compiled: Sequence[CompiledHook], *, caller_optimizer: bool
):
    """(the train step lowered and compiled once, ahead of time, for `state` and `first_batch`, its memory
    `_memory_bytes` read right after compiling); logs each report the `on_compiled` hooks return."""
    compiled = make_train_step(plan).lower(state, first_batch).compile()
    memory = _memory_bytes(compiled)
    for hook in on_compiled:
        report = hook(plan, compiled, state, first_batch)
        if report:
            note = "\n(the ZeRO formula counts AdamW's two moments, not this optimizer's state)"
            _log(report + (note if caller_optimizer else ""))
    return compiled, memory


def _metrics_writer(cfg: Config, stack: contextlib.ExitStack, *, first_step: int) -> MetricsWriter:
    """The run's metrics writer (metrics.jsonl and the configured trackers, process 0 only), closed with `stack`;
    rows an earlier attempt wrote at `first_step` and later are purged (this run writes them again)."""
    mc = cfg.metrics
    writer = MetricsWriter(
        cfg.train.run_dir,
        enabled=jax.process_index() == 0,
        trackers=lambda d: default_trackers(
            d,
            tensorboard=mc.tensorboard,
            wandb=mc.wandb,
            wandb_project=mc.wandb_project,
            wandb_mode=mc.wandb_mode,
            config=cfg.to_dict(),
        ),
        first_step=first_step,
    )
    stack.callback(writer.close)
    return writer


def _run_steps(run: RunContext, hooks: list[Hook], batch: dict | None) -> None:
    """Runs steps from `run.start_step` to `train.steps` (or until a hook calls `run.stop()`), calling each
    due hook after each step in order; a hook's returned state replaces the run's, and one at another step
    (a rollback) skips the step's remaining hooks and continues from there."""
    faults = FaultInjector()  # JAXPAR_INJECT_FAULT: off unless set (fire drills and tests)
    run.start_clock(run.start_step)
    state, step = run.state, run.start_step
    while step < run.cfg.train.steps and not run.stop_requested:
        step += 1
        run.begin_step()
        run.beat(step)
        state = faults.before_step(step, state)
        if batch is None:
            batch = run.train_loader.next_batch()
        state, metrics = run.compiled(state, batch)
        run.state, batch = state, None
        for hook in hooks:
            if not hook.due(run, step):
                continue
            replaced = hook.on_step(run, step, state, metrics)
            if replaced is not None:
                if not isinstance(replaced, dict) or "step" not in replaced:
                    raise TypeError(
                        f"{type(hook).__name__}.on_step returned {type(replaced).__name__}; return None, or a "
                        f"train state to replace the run's (a dict with 'step', 'params', 'opt_state', like the "
                        f"state it was given)"
                    )
                state = run.state = replaced
                if int(replaced["step"]) != step:  # undone (a rollback): the loop goes on from that step
                    step = int(replaced["step"])
                    break
        if run.stop_requested:
            for hook in hooks:
                hook.on_stop(run, step, state, metrics)


def train(
    cfg: Config,
    *,
    loss_fn: LossFn | None = None,
    optimizer: optax.GradientTransformation | None = None,
    learning_rate: optax.Schedule | float | None = None,
    data: StatefulIterator | None = None,
    on_compiled: Sequence[CompiledHook] = (),
    hooks: Sequence[Hook] | None = None,
) -> TrainResult:
    """Runs `cfg.train.steps` optimizer steps (resuming if RUN_DIR has checkpoints); returns a `TrainResult`.

    Args:
      cfg: the run config.
      loss_fn, optimizer, learning_rate: a caller's own training loss and optax optimizer, and what the
        `learning_rate` metric reports for it; see `jaxpar.training.plan.build_plan` (defaults: cross-entropy, and
        the config's AdamW). Validation (`val_loss`) is the cross-entropy whatever the loss. Metrics the step
        does not report (`learning_rate` without `learning_rate`; `skipped_steps` without a
        `jaxpar.training.optimizer.skip_nonfinite` wrapper) are null in metrics.jsonl; without that wrapper a
        non-finite update is applied, and `train.max_bad_steps` and `train.divergence_rollbacks` cannot act.
        A run resumes only with the optimizer it was saved with (its state's arrays must match).
      data: a caller's own training data: an iterator of this process's rows of each global batch with Grain's
        `get_state` / `set_state` (`jaxpar.data.IteratorLoader` says what it yields); its state goes into the
        checkpoints, so the run resumes exactly. Default: the config's `data.*` corpus. Validation still scores
        the config's validation split.
      on_compiled: hooks run once after the train step compiles (`CompiledHook`); each report they return is
        logged.
      hooks: the loop's parts (`jaxpar.training.hooks.Hook` instances), run in this order; None:
        `jaxpar.training.hooks.default_hooks(cfg)` (evaluation, metrics, progress bar, checkpoints, watchdog,
        preemption, divergence rollback, sample). Add, remove or replace entries of that list to change them.

    Raises:
      ConfigError: a data source or batch size that the corpus cannot serve (before any device work).
      TypeError / ValueError: a `hooks` entry that is not a `Hook` instance or has a bad `every` (before any
        device work); a `loss_fn`, `optimizer` or `learning_rate` that `build_plan` refuses.
      ValueError / FileNotFoundError: a checkpoint that does not match the model, or a missing restore path.
      TrainingDiverged: too many non-finite updates in a row, or a run about to end diverged (`DivergenceHook`).
    """
    hooks = None if hooks is None else _checked_hooks(hooks)
    cfg = resolve_config(cfg, jax.device_count())  # the mesh sizes; the plan resolves the precision
    hooks = default_hooks(cfg) if hooks is None else hooks
    check_run_dir(cfg.train.run_dir)
    with contextlib.ExitStack() as stack:  # closes the hooks' contexts, the writer and the checkpointer
        run, first_batch = _start_run(
            cfg,
            stack,
            loss_fn=loss_fn,
            optimizer=optimizer,
            learning_rate=learning_rate,
            data=data,
            on_compiled=on_compiled,
        )
        for hook in hooks:
            hook.on_start(run)
        _run_steps(run, hooks, first_batch)
    info = run.data_info
    result = TrainResult(
        losses=run.losses,
        val_loss=None,
        initial_val_loss=run.initial_val_loss,
        val_unigram_entropy=info.val_unigram_entropy,
        val_tokens=info.val_scored_tokens,
        tokens_per_s=run.tokens_per_s,
        start_step=run.start_step,
        sample="",
        state=run.state,
        preempted_at=run.preempted_at,
    )
    for hook in hooks:
        hook.on_end(run, result)
    return result


def _public_name(obj) -> str:
    """`obj`'s class name for a log line, or "iterator" where the class is private to its library (a leading
    underscore, e.g. grain's dataset iterators)."""
    name = type(obj).__name__
    return "iterator" if name.startswith("_") else name
