"""Per-step metrics to trackers (`jaxpar.training.trackers`): RUN_DIR/metrics.jsonl (one JSON object per line),
TensorBoard and, optionally, Weights & Biases.

Only process 0 should write: the caller passes `enabled=jax.process_index() == 0`; a disabled writer creates no
files and its methods do nothing. Re-opening a run directory continues the same file; a writer opened with
`first_step` supersedes the rows at that step and later (`jaxpar.training.trackers` says how each tracker does),
so a resumed run holds each logged step once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from jaxpar.training.trackers import (  # noqa: F401 -- METRICS_FILE, TENSORBOARD_DIR: where the default trackers write
    METRICS_FILE,
    TENSORBOARD_DIR,
    JsonlTracker,
    TensorBoardTracker,
    Tracker,
    WandbTracker,
    to_json_value,
)


def default_trackers(
    run_dir: str,
    *,
    tensorboard: bool = True,
    wandb: bool = False,
    wandb_project: str = "jaxpar",
    wandb_mode: str = "offline",
    config: dict | None = None,
) -> list[Tracker]:
    """The trackers a run writes to: JSONL always, TensorBoard and W&B as asked (`MetricsConfig`).

    Raises:
      ImportError: W&B asked for but not installed; ValueError: an unknown W&B mode.
    """
    out: list[Tracker] = [JsonlTracker(run_dir)]
    if tensorboard:
        out.append(TensorBoardTracker(run_dir))
    if wandb:
        out.append(WandbTracker(run_dir, wandb_project, wandb_mode, config))
    return out


class MetricsWriter:
    """Sends `{"step": step, **metrics}` records to trackers (`jaxpar.training.trackers`).

    Args:
      run_dir: run directory; created if missing (only when enabled).
      enabled: False on every process but 0; then nothing is created or written.
      trackers: where records go; default `default_trackers(run_dir)` (metrics.jsonl and TensorBoard). Built
        only when enabled, so pass a callable `run_dir -> list[Tracker]` to build them on process 0 only.
      first_step: the first step this writer will write, if the run directory may hold rows of an earlier
        attempt: those at `first_step` and later are purged when it opens (`purge`). The training loop passes
        the restored step + 1 on a resume and 0 on a fresh start. None: nothing is purged.
    """

    def __init__(
        self,
        run_dir: str,
        *,
        enabled: bool = True,
        trackers: Sequence[Tracker] | Any | None = None,
        first_step: int | None = None,
    ):
        self.enabled = enabled
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.trackers: list[Tracker] = []
        if not enabled:
            return
        if trackers is None:
            trackers = default_trackers(run_dir)
        elif callable(trackers):
            trackers = trackers(run_dir)
        self.trackers = list(trackers)
        if first_step is not None:
            self.purge(first_step)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Write one record to every tracker. None stays JSON null (and is skipped by plotting trackers), as are
        NaN/inf.

        Raises:
          TypeError: a value is a non-scalar array or not JSON-serialisable.
        """
        if not self.enabled:
            return
        record = {k: to_json_value(v) for k, v in metrics.items()}
        for tracker in self.trackers:
            tracker.log(int(step), record)

    def purge(self, step: int) -> None:
        """Supersedes the rows at `step` and later in every tracker that implements `purge` (a divergence
        rollback calls it with the restored step + 1: the steps after it are run again)."""
        for tracker in self.trackers:
            if hasattr(tracker, "purge"):
                tracker.purge(int(step))

    def flush(self) -> None:
        """Puts every row logged so far on disk, for the trackers that implement `flush` (after each checkpoint
        save: a killed process then loses only rows that its resumed run writes again)."""
        for tracker in self.trackers:
            if hasattr(tracker, "flush"):
                tracker.flush()

    def close(self) -> None:
        """Flush and close every tracker; safe to call twice."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()
