"""The hook protocol of the training loop: `Hook` (what a part of the loop implements), `RunContext` (what it
sees of the run) and `TrainResult` (what the run returns).

The loop (`jaxpar.training.loop.train`) runs, for hooks h1..hn in list order:

    h.on_start(run) for each hook          after the step is compiled, before the first step
    for each step (1-based, after the update):
        run.beat(step); state, metrics = train_step(state, batch)
        h.on_step(run, step, state, metrics) for each hook with h.due(run, step)
            a returned state replaces the run's state; if its step differs from `step` (a rollback), the
            remaining hooks of this step are skipped and the loop continues from that step
        if a hook called run.stop(): h.on_stop(run, step, state, metrics) for each hook, then stop
    every context the hooks entered on run.stack is closed (last entered, first closed), also on an error
    h.on_end(run, result) for each hook   (not after an error)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:  # the types of the run's parts; importing them here would load the whole training stack
    from jaxpar.checkpoint.store import Checkpointer
    from jaxpar.config.schema import Config
    from jaxpar.data.info import DataInfo
    from jaxpar.data.iterator import IteratorLoader
    from jaxpar.data.loader import DataLoader, EvalLoader
    from jaxpar.data.mixture import MixtureEvalLoader, MixtureLoader
    from jaxpar.training.metrics import MetricsWriter
    from jaxpar.training.plan import StepPlan

TrainState = dict[str, Any]  # {"params", "opt_state", "step", ...}: `jaxpar.training.state.init_state`
# eval_step(params, batch) -> (summed token loss in nats, valid tokens): `jaxpar.training.step.make_eval_step`
EvalStep = Callable[[dict, dict[str, jax.Array]], tuple[jax.Array, jax.Array]]

_LOGGER = logging.getLogger("jaxpar.training")


def log(msg: str) -> None:
    """Logs `msg` (info, logger `jaxpar.training`) from process 0 only (`jaxpar.log`)."""
    if jax.process_index() == 0:
        _LOGGER.info(msg)


@dataclasses.dataclass
class TrainResult:
    """What a run produced. Training losses are token means of the training loss (cross-entropy in nats, unless
    `train` was given a `loss_fn`); validation losses are always token-mean cross-entropy in nats."""

    losses: dict[int, float]  # step (1-based, after the update) -> training loss of that step
    val_loss: float | None
    initial_val_loss: float | None
    val_unigram_entropy: float  # of the target tokens val_loss covers
    val_tokens: int  # valid tokens every validation figure covers (train.eval_batches)
    tokens_per_s: float | None
    start_step: int
    sample: str
    preempted_at: int | None = None  # step saved and stopped at after a SIGTERM
    state: TrainState = dataclasses.field(repr=False, default_factory=dict)  # the final train state
    val_losses: dict[str, float] = dataclasses.field(default_factory=dict)  # a mixture's val_loss per source


@dataclasses.dataclass(eq=False)
class RunContext:
    """What hooks see of a run: its parts (fixed for the run) and the values hooks share (updated as it goes).

    Parts:
      cfg: the resolved config. plan: the `StepPlan`. mesh: the device mesh. compiled: the compiled train step
        (`jax.stages.Compiled`), `(state, batch) -> (state, metrics)`.
      train_loader: the training batches (`next_batch()`, Grain's `get_state()` / `set_state()`): a
        `jaxpar.data.DataLoader`, a `MixtureLoader` for `data.sources`, or an `IteratorLoader` over the caller's
        iterator.
      val_loader: the validation split (`jaxpar.data.EvalLoader`, a `MixtureEvalLoader` for `data.sources`);
        eval_step: `(params, batch) -> (loss sum in nats, valid tokens)`, see `jaxpar.training.hooks.evaluate`.
      data_info: the splits' token and sequence counts and `val_unigram_entropy` (`jaxpar.data.info.DataInfo`, from
        `jaxpar.data.build_loaders`).
      checkpointer: the run's `jaxpar.checkpoint.store.Checkpointer`, None with `checkpoint.every_steps=0`.
      writer: the run's `jaxpar.training.metrics.MetricsWriter` (metrics.jsonl and the configured trackers).
      stack: a `contextlib.ExitStack` closed when the loop ends, normally or by an error: a hook enters its
        contexts there (`run.stack.enter_context(...)`, `run.stack.callback(...)`).
      start_step: the step the run started (or resumed) at.
      memory: per-device `memory_peak_bytes` and `memory_step_bytes` (bytes; None where unknown).
      flops_per_token, hardware_flops_per_token: model and hardware training FLOPs per token (`jaxpar.model.flops`;
        the hardware count is None for a model family that registered no recompute count);
        peak_flops: the device's dense bf16 peak FLOP/s, None if unknown. peak_fp8_flops: its dense FP8 peak, set
        with `precision.fp8.enabled` (None otherwise or if unknown).

    Shared values:
      state: the current train state. host: this step's metrics as host floats once a hook fetched them with
        `host_metrics`, else None. losses: step -> training loss, for every step whose metrics were fetched.
      val_loss, val_tokens: this step's validation loss (nats/token) and the tokens it covers; None on steps
        without an evaluation. val_losses: with a data mixture, {source name: its validation loss} of this
        step's evaluation ({} otherwise, None on steps without one). initial_val_loss: the step-0 validation
        loss, None when resuming.
      step_time_s, tokens_per_s: seconds per step and tokens per second since the previous fetch, without the
        time spent in `untimed()` blocks (evaluation). rollbacks: divergence rollbacks so far.
      stop_requested: a hook called `stop()`; preempted_at: the step a preemption stopped the run at.
    """

    cfg: Config
    plan: StepPlan
    mesh: jax.sharding.Mesh
    compiled: jax.stages.Compiled
    train_loader: DataLoader | MixtureLoader | IteratorLoader
    val_loader: EvalLoader | MixtureEvalLoader
    eval_step: EvalStep
    data_info: DataInfo
    checkpointer: Checkpointer | None
    writer: MetricsWriter
    stack: contextlib.ExitStack
    start_step: int
    state: TrainState
    memory: dict[str, int | None] = dataclasses.field(default_factory=dict)
    flops_per_token: float = 0.0
    hardware_flops_per_token: float | None = None
    peak_flops: float | None = None
    peak_fp8_flops: float | None = None
    host: dict[str, float] | None = None
    losses: dict[int, float] = dataclasses.field(default_factory=dict)
    val_loss: float | None = None
    val_tokens: int | None = None
    val_losses: dict[str, float] | None = None
    initial_val_loss: float | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    rollbacks: int = 0
    stop_requested: bool = False
    preempted_at: int | None = None
    _beats: list[Callable[[int], None]] = dataclasses.field(default_factory=list, repr=False)
    _clock: tuple[float, int] = (0.0, 0)  # (perf_counter, step) of the last fetch
    _untimed_s: float = 0.0

    @property
    def run_dir(self) -> str:
        """The run directory (train.run_dir)."""
        return self.cfg.train.run_dir

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step: train.global_batch_size * data.seq_len."""
        return self.cfg.train.global_batch_size * self.cfg.data.seq_len

    @property
    def val_cover(self) -> str:
        """What each evaluation scores, in words (for log lines; `jaxpar.data.info.DataInfo.val_coverage`)."""
        return self.data_info.val_coverage()

    def log(self, msg: str) -> None:
        """Logs `msg` from process 0 (logger `jaxpar.training`)."""
        log(msg)

    def on_beat(self, fn: Callable[[int], None]) -> None:
        """Adds `fn(step)` to what `beat` calls (the hang watchdog's progress mark)."""
        self._beats.append(fn)

    def beat(self, step: int) -> None:
        """Marks progress at `step`: the loop calls it before each step; hooks call it after long work (each
        validation batch, a checkpoint save)."""
        for fn in self._beats:
            fn(step)

    def stop(self) -> None:
        """Asks the loop to end after the current step's hooks (those after the caller still run)."""
        self.stop_requested = True

    def host_metrics(self, step: int, metrics: dict) -> dict[str, float]:
        """This step's metrics as host floats; the first call in a step waits for the step (`jax.device_get`),
        measures `step_time_s` and `tokens_per_s` and records `losses[step]`; later calls return the same dict.
        """
        if self.host is None:
            self.host = {k: float(v) for k, v in jax.device_get(metrics).items()}  # waits for the step
            now = time.perf_counter()
            last_time, last_step = self._clock
            self.step_time_s = (now - last_time - self._untimed_s) / max(step - last_step, 1)
            self.tokens_per_s = self.tokens_per_step / self.step_time_s
            self.losses[step] = self.host["loss"]
            self._clock, self._untimed_s = (now, step), 0.0
        return self.host

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """Time spent inside is not counted as step time (evaluation)."""
        begin = time.perf_counter()
        try:
            yield
        finally:
            self._untimed_s += time.perf_counter() - begin

    def start_clock(self, step: int) -> None:
        """Starts step timing at `step` (the loop calls it before the first step)."""
        self._clock, self._untimed_s = (time.perf_counter(), step), 0.0

    def begin_step(self) -> None:
        """Clears the per-step values (the loop calls it at the start of each step)."""
        self.host = self.val_loss = self.val_tokens = self.val_losses = None


class Hook:
    """A part of the training loop. Subclass and override what you need; every method is a no-op here.

    `every` schedules `on_step`: it runs at the steps `due` accepts, by default every `every`-th step (0:
    never). Hooks run in list order at each event; one that needs another's values (`run.val_loss`,
    `run.host`) goes after it. A hook instance can serve several runs: `on_start` resets what it keeps.

        class PrintLoss(Hook):
            every = 10

            def on_step(self, run, step, state, metrics):
                run.log(f"step {step}: loss {run.host_metrics(step, metrics)['loss']:.3f}")

        train(cfg, hooks=[*default_hooks(cfg), PrintLoss()])
    """

    every: int = 1

    def due(self, run: RunContext, step: int) -> bool:
        """Whether `on_step` runs after step `step` (1-based)."""
        return self.every > 0 and step % self.every == 0

    def on_start(self, run: RunContext) -> None:
        """Called once the step is compiled, before the first step; enter contexts on `run.stack`."""

    def on_step(self, run: RunContext, step: int, state: dict, metrics: dict) -> dict | None:
        """Called after step `step` (1-based) when `due`: `state` is the state after the update, `metrics` the
        step's metrics as device arrays (`run.host_metrics` fetches them, waiting for the step). Return a state
        to replace the run's; one at another step (a restored checkpoint) rolls the loop back to that step."""
        return None

    def on_stop(self, run: RunContext, step: int, state: dict, metrics: dict) -> None:
        """Called for every hook (due or not) after the hooks of step `step` when one of them called
        `run.stop()`: the run ends after this step. `CheckpointHook` saves here if it has not yet, so a stop
        never loses the step, whichever hook asked for it."""

    def on_end(self, run: RunContext, result: TrainResult) -> None:
        """Called after the loop, once every context on `run.stack` is closed; may fill in `result`. Not called
        when the loop raised."""
