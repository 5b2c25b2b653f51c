"""Fault handling as hooks: `WatchdogHook` (a stalled loop ends the process), `PreemptionHook` (SIGTERM: save and
stop) and `DivergenceHook` (too many non-finite updates in a row: roll back or stop with `TrainingDiverged`)."""

from __future__ import annotations

from jaxpar.training.hooks.base import Hook, RunContext, TrainResult
from jaxpar.training.preemption import PreemptionWatch
from jaxpar.training.state import abstract_state
from jaxpar.training.watchdog import Watchdog


class TrainingDiverged(RuntimeError):
    """`train.max_bad_steps` consecutive updates were skipped for non-finite gradients."""


class WatchdogHook(Hook):
    """Runs the hang watchdog (`jaxpar.training.watchdog.Watchdog`) from `on_start` until the loop ends: the
    process exits with status 124 after `timeout_s` seconds without a `run.beat` (each step, validation batch
    and checkpoint save), naming the processes that are missing.

    Args:
      timeout_s: seconds without progress (`train.watchdog_s`); 0 disables it.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def on_start(self, run: RunContext) -> None:
        run.on_beat(run.stack.enter_context(Watchdog(self.timeout_s)).beat)


class PreemptionHook(Hook):
    """SIGTERM on any process (`jaxpar.training.preemption.PreemptionWatch`): every process stops after the same
    step (`run.preempted_at`, `run.stop()`), which a `CheckpointHook` after it saves; the end of the run logs
    it and skips the final evaluation and sample."""

    def __init__(self) -> None:
        self._watch: PreemptionWatch | None = None

    def on_start(self, run: RunContext) -> None:
        self._watch = run.stack.enter_context(PreemptionWatch())

    def on_step(self, run: RunContext, step: int, state: dict, metrics: dict) -> None:
        if self._watch is not None and self._watch.reached(step):
            run.preempted_at = step
            run.stop()

    def on_end(self, run: RunContext, result: TrainResult) -> None:
        if result.preempted_at:
            run.log(f"preempted: saved step {result.preempted_at} and stopped; run the same command to resume")


class DivergenceHook(Hook):
    """Acts on updates skipped for NaN or inf gradients (the `bad_steps_in_a_row` metric of
    `jaxpar.training.optimizer.skip_nonfinite`; without it this hook does nothing).

    After `max_bad_steps` skipped updates in a row it restores the last complete checkpoint's state, keeping
    the data position so the batches since are skipped (PaLM, Chowdhery et al. 2022, section 5.1), up to
    `rollbacks` times (`run.rollbacks` counts them), and purges the metrics rows after the restored step (the
    steps run again, on other batches, and write new ones); then, or without a checkpoint, it raises
    `TrainingDiverged`. It reads the previous step's counter, so it never waits for the current step; put it
    first, so that no other hook acts on a step it undoes.

    Args:
      max_bad_steps: `train.max_bad_steps`. rollbacks: `train.divergence_rollbacks`.
    """

    def __init__(self, max_bad_steps: int, rollbacks: int = 0):
        self.max_bad_steps, self.rollbacks = max_bad_steps, rollbacks
        self._previous: dict | None = None

    def on_start(self, run: RunContext) -> None:
        self._previous = None

    def on_step(self, run: RunContext, step: int, state: dict, metrics: dict) -> dict | None:
        previous, self._previous = self._previous, metrics
        if previous is None or "bad_steps_in_a_row" not in previous:
            return None
        bad = int(previous["bad_steps_in_a_row"])  # the previous step's counter: no wait for this step
        if bad < self.max_bad_steps:
            return None
        ckpt = run.checkpointer
        if run.rollbacks >= self.rollbacks or ckpt is None or not ckpt.all_steps():
            raise TrainingDiverged(self._message(bad, step - 1, ckpt, run.rollbacks))
        run.rollbacks += 1
        ckpt.wait()
        restored, _, _ = ckpt.restore(None, abstract_state(run.plan))
        run.writer.purge(int(restored["step"]) + 1)  # the steps after it run again: their rows are superseded
        self._previous = None
        run.log(
            f"diverged: {bad} consecutive updates up to step {step - 1} were skipped for NaN or inf "
            f"gradients; rolled back to step {int(restored['step'])} ({run.rollbacks}/{self.rollbacks} "
            f"train.divergence_rollbacks), skipping the batches since"
        )
        return restored

    def _message(self, bad: int, step: int, ckpt, rollbacks: int) -> str:
        last_good = ckpt.latest_step() if ckpt is not None else None
        where = (
            f"the last good checkpoint is step {last_good} in {ckpt.directory}"
            if last_good is not None
            else "no checkpoint was saved"
        )
        return (
            f"{bad} consecutive updates up to step {step} had NaN or inf gradients and were skipped "
            f"(train.max_bad_steps={self.max_bad_steps}; {rollbacks} of {self.rollbacks} rollbacks allowed "
            f"by train.divergence_rollbacks used); {where}. Lower optimizer.learning_rate, raise "
            f"train.divergence_rollbacks, or restart from an earlier checkpoint with --restore-from"
        )
