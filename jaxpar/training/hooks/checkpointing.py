"""`CheckpointHook`: saves the train state and the data position to the run's checkpointer."""

from __future__ import annotations

from jaxpar.training.hooks.base import Hook, RunContext
from jaxpar.training.hooks.resilience import all_finite


class CheckpointHook(Hook):
    """Saves the state, the data position and the config to `run.checkpointer` (nothing without one, i.e. with
    `checkpoint.every_steps=0`) at the checkpointer's steps (`checkpoint.every_steps`), at the last step and
    at a step after which the run stops (a preemption's `run.stop()`, so it goes after `PreemptionHook`).

    A state whose update was skipped for non-finite gradients, or whose parameters hold a NaN or inf (an update
    that overflowed), is never saved: resuming, or a divergence rollback, must not start from a diverging state.
    Each save is a progress mark for the hang watchdog (`run.beat`) and flushes the metrics
    trackers (`run.writer.flush()`), so a killed process loses only rows after its last checkpoint, which the
    resumed run writes again.
    """

    def on_start(self, run: RunContext) -> None:
        self._saved: int | None = None  # the step this hook last saved (or decided not to)

    def on_stop(self, run: RunContext, step: int, state: dict, metrics: dict) -> None:
        """A stop requested by a hook after this one in the list still saves the step."""
        if self._saved != step:
            self._save(run, step, state, metrics)

    def on_step(self, run: RunContext, step: int, state: dict, metrics: dict) -> None:
        ckpt = run.checkpointer
        if ckpt is None or not (ckpt.should_save(step) or step == run.cfg.train.steps or run.stop_requested):
            return
        self._save(run, step, state, metrics)

    def _save(self, run: RunContext, step: int, state: dict, metrics: dict) -> None:
        if run.checkpointer is None:
            return
        ckpt = run.checkpointer
        self._saved = step
        if int(metrics.get("bad_steps_in_a_row", 0)):
            run.log(f"step {step}: no checkpoint saved, its update was skipped for non-finite gradients")
        elif not bool(all_finite(state["params"])):
            run.log(f"step {step}: no checkpoint saved, its parameters are NaN or inf (an update overflowed)")
        else:
            ckpt.save(step, state, data_state=run.train_loader.get_state(), config=run.cfg.to_dict(), force=True)
            run.writer.flush()
        run.beat(step)
