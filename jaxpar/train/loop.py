"""The training loop behind `jaxpar-train`: data, compiled step, validation, metrics, checkpoints, resume.

    result = train(load_config("configs/tiny.yaml", ["train.steps=50"]))
    result = train(cfg, loss_fn=cross_entropy_with_z_loss(1e-4), optimizer=skip_nonfinite(optax.lion(1e-4)))

(the last with a caller's own loss and optimizer, from `jaxpar.train.loss` and `jaxpar.train.optimizer`).

A run directory holds `config.yaml` (the resolved config), `metrics.jsonl`, `tensorboard/` and
`checkpoints/<step>/`. Starting in a directory that has complete checkpoints resumes from the latest one
(parameters, optimizer state, step and data position), so a resumed run reproduces the uninterrupted one.
The train step is lowered and compiled once, ahead of time, and that executable runs every step: a state whose
sharding drifted would raise instead of silently recompiling.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
import optax

from jaxpar import flops as flops_lib
from jaxpar.checkpoint import RUN_CHECKPOINT_DIR, Checkpointer, CheckpointMismatchError, restore_from_path
from jaxpar.compiled_memory import memory_analysis_bytes
from jaxpar.config import Config, ConfigError, resolve_config, save_config
from jaxpar.config.resume import check_resume_config, keep_previous_config
from jaxpar.data import EvalLoader, IteratorLoader, build_loaders
from jaxpar.distributed import describe_process
from jaxpar.generate import sample_text
from jaxpar.mesh import build_mesh, describe
from jaxpar.metrics import MetricsWriter, default_trackers
from jaxpar.model import model_family
from jaxpar.train.faults import FaultInjector
from jaxpar.train.loss import LossFn
from jaxpar.train.optimizer import nonfinite_state
from jaxpar.train.preemption import PreemptionWatch
from jaxpar.train.step import (
    StepPlan,
    abstract_state,
    build_plan,
    compute_dtype,
    init_state,
    make_eval_step,
    make_train_step,
)
from jaxpar.train.watchdog import Watchdog


class TrainingDiverged(RuntimeError):
    """`train.max_bad_steps` consecutive updates were skipped for non-finite gradients."""


@dataclasses.dataclass
class TrainResult:
    """What a run produced. Training losses are token means of the training loss (cross-entropy in nats, unless
    `train` was given a `loss_fn`); validation losses are always token-mean cross-entropy in nats."""

    losses: dict[int, float]           # step (1-based, after the update) -> training loss of that step
    val_loss: float | None
    initial_val_loss: float | None
    val_unigram_entropy: float         # of the target tokens val_loss covers
    val_tokens: int                    # valid tokens every validation figure covers (train.eval_batches)
    tokens_per_s: float | None
    start_step: int
    sample: str
    preempted_at: int | None = None    # step saved and stopped at after a SIGTERM
    state: Any = dataclasses.field(repr=False, default=None)


_LOGGER = logging.getLogger("jaxpar.train")


def _log(msg: str) -> None:
    """Logs `msg` (info) from process 0 only (`jaxpar.log`)."""
    if jax.process_index() == 0:
        _LOGGER.info(msg)


def evaluate(eval_step, params, loader: EvalLoader, beat=None, step: int = 0) -> tuple[float, int]:
    """Token-mean validation loss (nats) over one pass of `loader` (every scored sequence once, padding rows
    masked out), and the number of valid tokens it covers.

    `beat(step)`, if given, is called after every batch (the hang watchdog's progress mark).
    """
    total = count = 0.0
    for batch in loader.batches():
        loss_sum, n = eval_step(params, batch)
        total, count = total + float(loss_sum), count + float(n)
        if beat is not None:
            beat(step)
    return total / max(count, 1.0), int(round(count))


def _diverged_message(bad: int, step: int, t, ckpt: Checkpointer | None, rollbacks: int) -> str:
    last_good = ckpt.latest_step() if ckpt is not None else None
    where = (f"the last good checkpoint is step {last_good} in {ckpt.directory}" if last_good is not None
             else "no checkpoint was saved")
    return (f"{bad} consecutive updates up to step {step} had NaN or inf gradients and were skipped "
            f"(train.max_bad_steps={t.max_bad_steps}; {rollbacks} of {t.divergence_rollbacks} rollbacks allowed by "
            f"train.divergence_rollbacks used); {where}. Lower optimizer.learning_rate, raise "
            f"train.divergence_rollbacks, or restart from an earlier checkpoint with --restore-from")


def _roll_back(ckpt: Checkpointer, plan: StepPlan, bad: int, step: int, rollbacks: int, t):
    """Restores the latest complete checkpoint's state after a divergence; the data position is kept, so the
    batches since that checkpoint are skipped (PaLM, Chowdhery et al. 2022, section 5.1)."""
    ckpt.wait()
    state, _, _ = ckpt.restore(None, abstract_state(plan))
    _log(f"diverged: {bad} consecutive updates up to step {step} were skipped for NaN or inf gradients; rolled "
         f"back to step {int(state['step'])} ({rollbacks}/{t.divergence_rollbacks} train.divergence_rollbacks), "
         f"skipping the batches since")
    return state


def _memory_bytes(compiled) -> dict[str, int | None]:
    """Per-device memory: the allocator's peak where the backend reports it, and the compiled step's need."""
    stats = jax.local_devices()[0].memory_stats() or {}
    analysis = memory_analysis_bytes(compiled)
    return {"memory_peak_bytes": stats.get("peak_bytes_in_use"),
            "memory_step_bytes": None if analysis is None else analysis["peak_bytes"]}


def check_run_dir(run_dir: str) -> None:
    """Checks that `train.run_dir` is, or can be created as, a directory this process can write in, and leaves
    the file system as it found it (directories it creates to check are removed again).

    Raises:
      ConfigError: naming the path in the way (a file where a directory must be) or the OS error, and the fix.
    """
    fix = "give a directory you can write, e.g. train.run_dir=runs/tiny (it is created if missing)"
    path = os.path.abspath(run_dir)
    missing, probe = [], path
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        missing.append(probe)
        probe = os.path.dirname(probe)
    if os.path.exists(probe) and not os.path.isdir(probe):
        what = "is a file" if probe == path else f"cannot be created: {probe} is a file, not a directory"
        raise ConfigError(f"train.run_dir={run_dir!r} {what}; {fix}")
    try:
        os.makedirs(path, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".jaxpar-write-check-", dir=path)
        os.close(fd)
        os.remove(name)
    except OSError as e:
        raise ConfigError(f"train.run_dir={run_dir!r} cannot be created or written ({e.strerror}: {e.filename}); "
                          f"{fix}") from e
    finally:
        for created in missing:  # innermost first; another process may have put something there meanwhile
            try:
                os.rmdir(created)
            except OSError:
                break


def _restore(cfg: Config, plan: StepPlan, ckpt: Checkpointer | None):
    """Returns (state, data_state) from RUN_DIR's latest checkpoint, else from `checkpoint.restore_from`, else
    (None, None). A run's own checkpoints come first, so rerunning a command that seeded the run from another
    checkpoint resumes where it stopped.

    Raises:
      ConfigError: the path holds no complete checkpoint, or the checkpoint's arrays do not fit this config.
    """
    target = abstract_state(plan)
    own = ckpt is not None and ckpt.latest_step() is not None
    source = ckpt.directory if own else cfg.checkpoint.restore_from
    try:
        if own:  # the run's own progress wins over checkpoint.restore_from, which only seeds a fresh run
            if cfg.checkpoint.restore_from:
                _log(f"resuming from this run's own checkpoints in {ckpt.directory}; checkpoint.restore_from="
                     f"{cfg.checkpoint.restore_from} only starts a run that has none")
            state, data_state, _ = ckpt.restore(None, target)
            return state, data_state
        if cfg.checkpoint.restore_from:
            state, data_state, _ = restore_from_path(cfg.checkpoint.restore_from, target)
            _log(f"restored from {cfg.checkpoint.restore_from}")
            return state, data_state
    except FileNotFoundError as e:
        raise ConfigError(f"{e}; pass a run directory, its checkpoints/ directory or one of its step "
                          f"directories to --restore-from (checkpoint.restore_from)") from e
    except CheckpointMismatchError as e:
        raise ConfigError(
            f"the checkpoint in {source} does not fit this config ({e.summary()}); run with the config it was "
            f"saved with (config.yaml beside it) and, if it "
            f"was trained with an optimizer of your own, that optimizer, or start a fresh run in another "
            f"train.run_dir") from e
    return None, None


# Called once the train step is compiled, with (plan, compiled step, state, first batch); returns a report to
# log, or None. jaxpar-train passes `jaxpar.analysis.memory.state_memory_report` (the ZeRO table).
CompiledHook = Callable[[StepPlan, Any, dict, dict], "str | None"]


def train(cfg: Config, *, loss_fn: LossFn | None = None, optimizer: optax.GradientTransformation | None = None,
          learning_rate: optax.Schedule | float | None = None, data: Iterator | None = None,
          on_compiled: Sequence[CompiledHook] = ()) -> TrainResult:
    """Runs `cfg.train.steps` optimizer steps (resuming if RUN_DIR has checkpoints); returns a `TrainResult`.

    Args:
      cfg: the run config.
      loss_fn, optimizer, learning_rate: a caller's own training loss and optax optimizer, and what the
        `learning_rate` metric reports for it; see `jaxpar.train.step.build_plan` (defaults: cross-entropy, and
        the config's AdamW). Validation (`val_loss`) is the cross-entropy whatever the loss. Metrics the step
        does not report (`learning_rate` without `learning_rate`; `skipped_steps` without a
        `jaxpar.train.optimizer.skip_nonfinite` wrapper) are null in metrics.jsonl; without that wrapper a
        non-finite update is applied, and `train.max_bad_steps` and `train.divergence_rollbacks` cannot act.
        A run resumes only with the optimizer it was saved with (its state's arrays must match).
      data: a caller's own training data: an iterator of this process's rows of each global batch with Grain's
        `get_state` / `set_state` (`jaxpar.data.IteratorLoader` says what it yields); its state goes into the
        checkpoints, so the run resumes exactly. Default: the config's `data.*` corpus. Validation still scores
        the config's validation split.
      on_compiled: hooks run once after the train step compiles (`CompiledHook`); each report they return is
        logged.

    Raises:
      ConfigError: a data source or batch size that the corpus cannot serve (before any device work).
      ValueError / FileNotFoundError: a checkpoint that does not match the model, or a missing restore path.
      TypeError / ValueError: a `loss_fn`, `optimizer` or `learning_rate` that `build_plan` refuses.
    """
    cfg = resolve_config(cfg, jax.device_count())
    if cfg.precision.compute_dtype == "auto":
        cfg = dataclasses.replace(cfg, precision=dataclasses.replace(
            cfg.precision, compute_dtype=np.dtype(compute_dtype(cfg)).name))
    t, run_dir = cfg.train, cfg.train.run_dir
    check_run_dir(run_dir)
    if optimizer is None and cfg.optimizer.warmup_steps > t.steps:
        _log(f"warning: optimizer.warmup_steps={cfg.optimizer.warmup_steps} > train.steps={t.steps}: the learning "
             f"rate reaches only {t.steps / cfg.optimizer.warmup_steps:.0%} of optimizer.learning_rate and never "
             f"decays; lower optimizer.warmup_steps to reach the peak")
    mesh = build_mesh(cfg)
    plan = build_plan(cfg, mesh, loss_fn=loss_fn, optimizer=optimizer, learning_rate=learning_rate)
    _LOGGER.info(f"jaxpar: {describe_process()}")  # every process, once
    _log(f"jaxpar: mesh {describe(mesh)}, zero_stage {cfg.optimizer.zero_stage}, "
         f"compute {np.dtype(plan.compute_dtype).name}, layout {cfg.precision.layout}")
    if optimizer is not None:
        skips = nonfinite_state(abstract_state(plan)["opt_state"]) is not None
        _log("optimizer: the caller's optax transformation (optimizer.* keys other than zero_stage are not read)"
             + ("" if skips else "; it has no skip_nonfinite wrapper: a NaN or inf update is applied, and "
                "train.max_bad_steps and train.divergence_rollbacks cannot act"))
    train_loader, val_loader, info = build_loaders(cfg.data, t.global_batch_size, plan.batch_sharding,
                                                   cfg.model.vocab_size, t.eval_batches,
                                                   vocab_multiple=cfg.mesh.tensor)
    if data is not None:
        train_loader = IteratorLoader(data, t.global_batch_size, cfg.data.seq_len, plan.batch_sharding)
        _log(f"data: training batches from the caller's {type(data).__name__} ({train_loader.local_rows} rows of "
             f"{cfg.data.seq_len} tokens per process per step); validation from {cfg.data.source}")
    val_cover = (f"{info['val_scored_tokens']:,} validation tokens ({info['val_scored_sequences']:,} of "
                 f"{info['val_sequences']:,} validation sequences)")
    _log(f"data: {cfg.data.source}: {info['train_tokens']:,} train tokens ({info['train_sequences']:,} sequences "
         f"of {info['seq_len']}), {info['val_tokens']:,} validation tokens; each evaluation scores {val_cover}")

    ckpt = None
    if cfg.checkpoint.every_steps > 0:
        ckpt = Checkpointer(os.path.join(run_dir, RUN_CHECKPOINT_DIR), every_steps=cfg.checkpoint.every_steps,
                            keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
    resuming = ckpt is not None and ckpt.latest_step() is not None
    changes = check_resume_config(run_dir, cfg) if resuming else {}  # refuses other data before any write
    state, data_state = _restore(cfg, plan, ckpt)
    if state is None:
        state = init_state(plan, t.seed)
    else:
        try:
            train_loader.set_state(data_state)
        except ValueError as e:
            raise ValueError(f"the checkpoint's data position does not fit this run's data ({e}); resume with the "
                             f"data the run was saved with (the built-in corpus, or the same iterator), or start "
                             f"a fresh run in another train.run_dir") from e
    start = int(state["step"])
    if start > t.steps:
        raise ConfigError(f"the run in train.run_dir={run_dir!r} is already at step {start}, past train.steps="
                          f"{t.steps}; raise train.steps to train on, or give another train.run_dir")
    if jax.process_index() == 0:  # only once the state fits: a failed restore leaves the old config.yaml
        os.makedirs(run_dir, exist_ok=True)
        if changes:
            kept = keep_previous_config(run_dir, start)
            _log(f"resuming with changed settings ({'; '.join(f'{k}: {a!r} -> {b!r}' for k, (a, b) in changes.items())}"
                 f"); the previous config is kept as {kept}")
        save_config(cfg, os.path.join(run_dir, "config.yaml"))
    if start:
        position = data_state.get("next_sample", "the caller's iterator state")  # as restored, no re-gather
        _log(f"resumed at step {start} (data position {position})")

    n_params = flops_lib.param_count(state["params"])
    flops_per_token = flops_lib.flops_per_token(
        flops_lib.count_non_embedding_params(state["params"]), cfg.model.n_layers, cfg.model.d_model,
        cfg.data.seq_len)
    recompute = model_family(cfg.model.name).recompute_flops_per_token
    hardware_flops = None if recompute is None else flops_lib.hardware_flops_per_token(
        flops_per_token, recompute(cfg.model, cfg.data.seq_len),
        stage_recompute=cfg.mesh.pipeline > 1 and cfg.pipeline.schedule == "1f1b")
    peak = flops_lib.peak_flops(jax.devices()[0].device_kind, t.peak_flops_per_device)
    hardware = (f"{hardware_flops:,.0f} hardware FLOPs/token with recompute (remat {cfg.model.remat})"
                if hardware_flops is not None else
                f"hardware FLOPs unknown (model {cfg.model.name!r} registered no recompute count; HFU null)")
    _log(f"model {cfg.model.name}: {n_params:,} parameters; {flops_per_token:,.0f} model FLOPs/token (6N + 12*L*h*s, "
         f"PaLM app. B), {hardware}; "
         f"peak {'unknown, MFU null' if peak is None else f'{peak:.3g} FLOP/s per device'}")

    first_batch = train_loader.next_batch()
    compiled = make_train_step(plan).lower(state, first_batch).compile()
    eval_step = make_eval_step(plan)
    memory = _memory_bytes(compiled)
    for hook in on_compiled:
        report = hook(plan, compiled, state, first_batch)
        if report:
            _log(report + ("\n(the ZeRO formula counts AdamW's two moments, not this optimizer's state)"
                           if optimizer is not None else ""))
    mc = cfg.metrics
    writer = MetricsWriter(run_dir, enabled=jax.process_index() == 0, trackers=lambda d: default_trackers(
        d, tensorboard=mc.tensorboard, wandb=mc.wandb, wandb_project=mc.wandb_project, wandb_mode=mc.wandb_mode,
        config=cfg.to_dict()))
    tokens_per_step = t.global_batch_size * cfg.data.seq_len

    initial_val = evaluate(eval_step, state["params"], val_loader)[0] if start == 0 else None
    if initial_val is not None:
        _log(f"step 0: val_loss {initial_val:.4f} over {val_cover}")

    losses: dict[int, float] = {}
    tokens_per_s = None
    bar = None
    if t.progress_bar and jax.process_index() == 0:
        from tqdm import tqdm
        bar = tqdm(total=t.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    batch, last_time, last_step = first_batch, time.perf_counter(), start
    val_loss = val_tokens = preempted_at = previous = None
    rollbacks = 0
    faults = FaultInjector()
    watch, watchdog = PreemptionWatch(), Watchdog(t.watchdog_s)
    step = start
    try:
        watch.__enter__()
        watchdog.__enter__()
        while step < t.steps:
            step += 1
            watchdog.beat(step)
            state = faults.before_step(step, state)
            if batch is None:
                batch = train_loader.next_batch()
            state, metrics = compiled(state, batch)
            batch = None
            if previous is not None and "bad_steps_in_a_row" in previous:
                # the previous step's counter: reading it does not wait for this step
                bad = int(previous["bad_steps_in_a_row"])
                if bad >= t.max_bad_steps:
                    if rollbacks >= t.divergence_rollbacks or ckpt is None or not ckpt.all_steps():
                        raise TrainingDiverged(_diverged_message(bad, step - 1, t, ckpt, rollbacks))
                    rollbacks += 1
                    state = _roll_back(ckpt, plan, bad, step - 1, rollbacks, t)
                    step, previous = int(state["step"]), None
                    continue
            previous = metrics
            evaluate_now = bool(t.eval_every and step % t.eval_every == 0) or step == t.steps
            if step % t.log_every == 0 or evaluate_now:
                m = {k: float(v) for k, v in jax.device_get(metrics).items()}  # waits for the step
                step_time = (time.perf_counter() - last_time) / max(step - last_step, 1)
                tokens_per_s = tokens_per_step / step_time
                losses[step] = m["loss"]
                val_loss, val_tokens = (evaluate(eval_step, state["params"], val_loader, watchdog.beat, step)
                                        if evaluate_now else (None, None))
                skipped = int(m["skipped_steps"]) if "skipped_steps" in m else None
                writer.write(step, {"loss": m["loss"], "val_loss": val_loss, "val_tokens": val_tokens,
                                    "learning_rate": m.get("learning_rate"),
                                    "grad_norm": m["grad_norm"], "skipped_steps": skipped,
                                    "rollbacks": rollbacks, "tokens_per_s": tokens_per_s,
                                    "step_time_s": step_time, "tokens": m["tokens"],
                                    "mfu": flops_lib.mfu(tokens_per_s, flops_per_token, mesh.size, peak),
                                    "hfu": None if hardware_flops is None else
                                    flops_lib.mfu(tokens_per_s, hardware_flops, mesh.size, peak), **memory})
                if bar is not None:
                    bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{tokens_per_s:,.0f}",
                                    **({"val": f"{val_loss:.3f}"} if val_loss is not None else {}))
                last_time, last_step = time.perf_counter(), step  # evaluation time is not step time
            if bar is not None:
                bar.update(1)
            if watch.reached(step):
                preempted_at = step
            if ckpt is not None and (ckpt.should_save(step) or step == t.steps or preempted_at):
                if int(metrics.get("bad_steps_in_a_row", 0)):  # never make a diverging state the one to resume from
                    _log(f"step {step}: no checkpoint saved, its update was skipped for non-finite gradients")
                else:
                    ckpt.save(step, state, data_state=train_loader.get_state(), config=cfg.to_dict(), force=True)
                watchdog.beat(step)
            if preempted_at:
                break
    finally:
        watchdog.__exit__(None, None, None)
        watch.__exit__(None, None, None)
        if bar is not None:
            bar.close()
        writer.close()
        if ckpt is not None:
            ckpt.close()

    if preempted_at:
        _log(f"preempted: saved step {preempted_at} and stopped; run the same command to resume")
        return TrainResult(losses=losses, val_loss=None, initial_val_loss=initial_val,
                           val_unigram_entropy=info["val_unigram_entropy"], val_tokens=info["val_scored_tokens"],
                           tokens_per_s=tokens_per_s, start_step=start, sample="", state=state,
                           preempted_at=preempted_at)
    final_val = val_loss if val_loss is not None else evaluate(eval_step, state["params"], val_loader)[0]
    entropy = info["val_unigram_entropy"]
    _log(f"final val_loss {final_val:.4f} nats/token over {val_cover} vs their unigram entropy {entropy:.4f} "
         f"(ratio {final_val / entropy:.3f})")
    sample = ""
    if t.sample_tokens > 0:
        sample = sample_text(plan, state["params"], prompt="def ", num_tokens=t.sample_tokens, seed=t.seed)
        _log("sample:\n" + sample)
    return TrainResult(losses=losses, val_loss=final_val, initial_val_loss=initial_val,
                       val_unigram_entropy=entropy, val_tokens=info["val_scored_tokens"], tokens_per_s=tokens_per_s,
                       start_step=start, sample=sample, state=state)
