"""Fault handling as hooks: `WatchdogHook` (a stalled loop ends the process), `PreemptionHook` (SIGTERM: save and
stop) and `DivergenceHook` (too many non-finite updates in a row, or a run about to end diverged: roll back or stop
with `TrainingDiverged`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxpar.training.hooks.base import Hook, RunContext, TrainResult
from jaxpar.training.preemption import PreemptionWatch
from jaxpar.training.state import abstract_state
from jaxpar.training.watchdog import Watchdog


class TrainingDiverged(RuntimeError):
    """`train.max_bad_steps` consecutive updates were skipped for non-finite gradients, or the run reached its last
    step with a non-finite loss or parameters, with no divergence rollback left (`DivergenceHook`)."""


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
    `jaxpar.training.optimizer.skip_nonfinite`), and on a run that would end diverged.

    After `max_bad_steps` skipped updates in a row it restores the last complete checkpoint's state, keeping
    the data position so the batches since are skipped (PaLM, Chowdhery et al. 2022, section 5.1), up to
    `rollbacks` times (`run.rollbacks` counts them), and purges the metrics rows after the restored step (the
    steps run again, on other batches, and write new ones); then, or without a checkpoint, it raises
    `TrainingDiverged`. It reads the previous step's counter, so it never waits for the current step; put it
    first, so that no other hook acts on a step it undoes.

    A run never ends diverged, whatever the count: after the last step (`train.steps`), before anything saves
    it, a NaN or inf loss of that step, its update skipped for NaN or inf gradients, or NaN or inf parameters
    after its update (an update that overflowed) count as divergence too: rolled back while rollbacks remain,
    else `TrainingDiverged`, naming the step the loss or its gradients became non-finite. This check waits for
    the last step and reduces the parameters on device once.

    Args:
      max_bad_steps: `train.max_bad_steps`. rollbacks: `train.divergence_rollbacks`.
    """

    def __init__(self, max_bad_steps: int, rollbacks: int = 0):
        self.max_bad_steps, self.rollbacks = max_bad_steps, rollbacks
        self._previous: dict | None = None
        self._nonfinite_since: int | None = None  # first step of the current run of non-finite losses or grads

    def on_start(self, run: RunContext) -> None:
        self._previous, self._nonfinite_since = None, None

    def on_step(self, run: RunContext, step: int, state: dict, metrics: dict) -> dict | None:
        previous, self._previous = self._previous, metrics
        if previous is not None:
            self._track(step - 1, previous)  # the previous step's values: no wait for this step
            bad = int(previous.get("bad_steps_in_a_row", 0))
            if bad >= self.max_bad_steps:
                return self._roll_back(
                    run,
                    f"{bad} consecutive updates up to step {step - 1} had NaN or inf gradients and were skipped "
                    f"(train.max_bad_steps={self.max_bad_steps})",
                )
        if step == run.cfg.train.steps:  # the last step: the run must not end (nor save) a diverged state
            reason = self._diverged_at_end(step, state, metrics)
            if reason is not None:
                return self._roll_back(run, reason)
        return None

    def _track(self, step: int, metrics: dict) -> None:
        """Notes whether step `step`'s loss or gradients were NaN or inf (its update skipped)."""
        finite = math.isfinite(float(metrics["loss"])) and not int(metrics.get("bad_steps_in_a_row", 0))
        if finite:
            self._nonfinite_since = None
        elif self._nonfinite_since is None:
            self._nonfinite_since = step

    def _diverged_at_end(self, step: int, state: dict, metrics: dict) -> str | None:
        """Why the state after the last step `step` is diverged, or None: a NaN or inf loss or gradients (the
        update skipped), or NaN or inf parameters after the update."""
        self._track(step, metrics)
        if self._nonfinite_since is not None:
            what = (
                "its loss has been NaN or inf"
                if not math.isfinite(float(metrics["loss"]))
                else "its gradients have been NaN or inf (updates skipped)"
            )
            return (
                f"the run reached its last step, {step}, diverged: {what} since step {self._nonfinite_since} "
                f"(train.max_bad_steps={self.max_bad_steps} skipped updates in a row not reached)"
            )
        if not bool(all_finite(state["params"])):
            return (
                f"the run reached its last step, {step}, diverged: the parameters are NaN or inf after its update "
                f"(an update overflowed)"
            )
        return None

    def _roll_back(self, run: RunContext, reason: str) -> dict:
        """Restores the last complete checkpoint (see the class docstring), or raises `TrainingDiverged`."""
        ckpt = run.checkpointer
        if run.rollbacks >= self.rollbacks or ckpt is None or not ckpt.all_steps():
            raise TrainingDiverged(self._message(reason, ckpt, run.rollbacks))
        run.rollbacks += 1
        ckpt.wait()
        restored, _, _ = ckpt.restore(None, abstract_state(run.plan))
        run.writer.purge(int(restored["step"]) + 1)  # the steps after it run again: their rows are superseded
        self._previous, self._nonfinite_since = None, None
        run.log(
            f"diverged: {reason}; rolled back to step {int(restored['step'])} ({run.rollbacks}/{self.rollbacks} "
            f"train.divergence_rollbacks), skipping the batches since"
        )
        return restored

    def _message(self, reason: str, ckpt, rollbacks: int) -> str:
        if ckpt is not None:
            ckpt.wait()  # a save still in flight counts
        last_good = ckpt.latest_step() if ckpt is not None else None
        where = (
            f"the last good checkpoint is step {last_good} in {ckpt.directory}"
            if last_good is not None
            else "no checkpoint was saved"
        )
        return (
            f"{reason}; {rollbacks} of {self.rollbacks} rollbacks allowed by train.divergence_rollbacks used; "
            f"{where}. Lower optimizer.learning_rate, raise train.divergence_rollbacks, or restart from an "
            f"earlier checkpoint with --restore-from"
        )


@jax.jit
def all_finite(params: dict) -> jax.Array:
    """Whether every parameter is finite (a bool scalar; one global reduction, the same on every process)."""
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(params)]))
