"""Where per-step metrics go: trackers with one `log(step, metrics)` / `close()` interface.

`MetricsWriter` (jaxpar.training.metrics) sends every record to its trackers. Shipped:
  JsonlTracker        RUN_DIR/metrics.jsonl, one JSON object per line (always on).
  TensorBoardTracker  RUN_DIR/tensorboard/ event files (tensorboardX); numeric finite scalars only.
  WandbTracker        Weights & Biases, the optional `wandb` extra (`pip install 'jaxpar[wandb]'`). Mode "offline"
                      writes the run under RUN_DIR/wandb/ with no network (`wandb sync` uploads it later);
                      "online" streams; "" leaves the choice to wandb (its WANDB_MODE environment variable). The
                      run id is kept in RUN_DIR/wandb_run_id (and the last step it was given in
                      RUN_DIR/wandb_last_step), so a resumed run continues the same W&B run.
A script may pass its own: any object with `log(step: int, metrics: dict[str, int | float | bool | str | None])`
and `close()`. Values arrive as Python scalars (`to_json_value`); None means "not measured".

Exactly once across resumes. A resumed run replays the steps after its checkpoint, and a divergence rollback the
steps after the checkpoint it restores; the rows the first attempt wrote for those steps are superseded, never kept
beside the new ones. A tracker may implement two optional methods for it:
  purge(step)   rows at `step` and later are superseded (called when the writer opens, with the first step the run
                will write, and at a rollback). metrics.jsonl drops them from the file; TensorBoard writes a
                purge_step marker (a SessionLog START at `step`), after which TensorBoard hides the earlier files'
                events at `step` and later; W&B online rewinds its run to `step`, offline it drops the rows at
                steps it already holds (a replayed step is logged once, the first time; `WandbTracker`).
  flush()       everything logged so far is on disk (called after each checkpoint save): a killed process loses
                at most the rows after its last checkpoint, which the resumed run writes again.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import secrets
import time
from typing import Any, Protocol, TextIO

import numpy as np

from jaxpar.config.choices import WANDB_MODES
from jaxpar.config.extras import WANDB_FEATURE, require

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"
WANDB_STEP_FILE = "wandb_last_step"  # the highest step logged to the W&B run

_LOGGER = logging.getLogger("jaxpar.training")


class Tracker(Protocol):
    """A metrics destination (module docstring). `purge(step)` and `flush()` are optional."""

    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def to_json_value(value: Any) -> Any:
    """numpy/jax scalars and 0-d arrays -> Python int/float/bool; None and other JSON values unchanged.

    Raises:
      TypeError: a non-scalar array (metrics are scalars).
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # np.ndarray, np.generic, jax.Array
        arr = np.asarray(value)
        if arr.ndim != 0:
            raise TypeError(f"metric values must be scalars, got an array of shape {arr.shape}")
        return arr.item()
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def numeric_scalars(metrics: dict[str, Any]) -> dict[str, float | int]:
    """The finite int/float entries of a record (no bools, None, strings, NaN or inf): what plotting trackers
    take."""
    return {
        k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def _row_step(line: str) -> int | None:
    """The step of one metrics.jsonl line; None for a line that is not a JSON object with an integer "step" (e.g.
    the torn last line of a process killed mid-write)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


class JsonlTracker:
    """Appends `{"step": step, **metrics}` to `run_dir/metrics.jsonl` (created with the directory), one line per
    record, flushed at once. `purge(step)` rewrites the file without its rows at `step` and later, and without lines
    that are not rows (a torn last line), atomically: a temporary file renamed over it, so a kill mid-purge leaves
    the old file or the new one."""

    def __init__(self, run_dir: str):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, METRICS_FILE)
        self._file: TextIO | None = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self._file is None:
            raise ValueError(f"{self.path}: log after close")
        self._file.write(json.dumps({"step": int(step)} | metrics) + "\n")
        self._file.flush()

    def purge(self, step: int) -> None:
        if self._file is None:
            raise ValueError(f"{self.path}: purge after close")
        self._file.close()
        with open(self.path, encoding="utf-8") as f:
            lines = f.readlines()
        steps = [_row_step(line) for line in lines]
        kept = [line for line, s in zip(lines, steps, strict=True) if s is not None and s < step]
        if len(kept) != len(lines):
            tmp = self.path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(line if line.endswith("\n") else line + "\n" for line in kept)
            os.replace(tmp, self.path)
            later, torn = sum(s is not None and s >= step for s in steps), steps.count(None)
            _LOGGER.info(
                f"{self.path}: dropped {later} rows of step {step} and later, which this run writes again"
                + (f", and {torn} lines that are not metrics rows (a write cut short)" if torn else "")
            )
        self._file = open(self.path, "a", encoding="utf-8")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardTracker:
    """Numeric finite scalars to TensorBoard event files under `run_dir/tensorboard`.

    `purge(step)` closes the event file and opens a new one with tensorboardX's `purge_step`: its first events are
    a SessionLog START at `step`, on which TensorBoard drops what earlier files hold at `step` and later.
    """

    def __init__(self, run_dir: str):
        self._dir = os.path.join(run_dir, TENSORBOARD_DIR)
        self._tb: Any = None  # opened at the first event, so a purge at the start leaves no empty file behind
        self._purge_step: int | None = None

    def _writer(self) -> Any:
        if self._tb is None:
            from tensorboardX import SummaryWriter

            # Event files are named by the second they open in; the nanoseconds after the host name keep two
            # opened within one second (a purge soon after the start) apart, in the order TensorBoard reads them.
            self._tb = SummaryWriter(self._dir, purge_step=self._purge_step, filename_suffix=f".{time.time_ns()}")
        return self._tb

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in numeric_scalars(metrics).items():
            self._writer().add_scalar(key, value, global_step=int(step))

    def purge(self, step: int) -> None:
        self.close()
        self._purge_step = int(step)

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class WandbTracker:
    """Numeric finite scalars to a Weights & Biases run (module docstring).

    The run id is kept in run_dir/wandb_run_id and the highest step W&B was given in run_dir/wandb_last_step, so
    a resumed run (a new process) continues the same W&B run and knows which steps W&B holds. `purge(step)`
    supersedes the rows at `step` and later that W&B holds:

      online   the run is rewound: `wandb.init(resume_from=f"{run_id}?_step={step}")` truncates its history to
               the steps before `step` (W&B's "rewind a run", a preview feature of W&B's service; where the
               service refuses it, a warning says so and the replayed steps are dropped as offline);
      offline  (and "" resolving to offline) an offline run cannot be rewound: rows at steps W&B already holds
               are dropped, so each step is logged once, the first time. After a resume these are bitwise the
               rows the replay computes (a resume is exact); after a divergence rollback W&B keeps the first
               attempt's rows of the steps run again (metrics.jsonl and TensorBoard hold the new ones).

    The W&B run starts at the first `purge` or `log`.

    Args:
      run_dir: the run directory (W&B's files go under run_dir/wandb).
      project: W&B project name.
      mode: one of `WANDB_MODES`.
      config: the run's settings, shown by W&B (e.g. `Config.to_dict()`).

    Raises:
      ValueError: an unknown mode.
      jaxpar.config.extras.MissingExtra: wandb is not installed (the message names the extra).
    """

    def __init__(self, run_dir: str, project: str, mode: str = "offline", config: dict | None = None):
        if mode not in WANDB_MODES:
            raise ValueError(f"W&B mode {mode!r} is not one of {', '.join(repr(m) for m in WANDB_MODES)}")
        self._wandb = require("wandb", WANDB_FEATURE)
        os.makedirs(run_dir, exist_ok=True)
        self._project, self._dir, self._mode, self._config = project, run_dir, mode, config or {}
        id_path = os.path.join(run_dir, WANDB_ID_FILE)
        if os.path.exists(id_path):
            with open(id_path, encoding="utf-8") as f:
                run_id = f.read().strip()
        else:
            run_id = secrets.token_hex(8)
            with open(id_path, "w", encoding="utf-8") as f:
                f.write(run_id + "\n")
        self.run_id = run_id
        self._step_path = os.path.join(run_dir, WANDB_STEP_FILE)
        self.held_step = _read_step(self._step_path)  # the highest step W&B holds (None: no row)
        self._run: Any = None

    @property
    def online(self) -> bool:
        """Whether the run streams to W&B's service (mode "online", or "" with WANDB_MODE unset or online)."""
        return (self._mode or os.environ.get("WANDB_MODE", "online")) in ("online", "run")

    def _start(self, rewind_to: int | None = None) -> None:
        """Starts (resumes) the W&B run; with `rewind_to`, rewinds it to that step (online only)."""
        common = dict(project=self._project, dir=self._dir, config=self._config, mode=self._mode or None)
        if rewind_to is not None:
            try:
                self._run = self._wandb.init(resume_from=f"{self.run_id}?_step={rewind_to}", **common)
                self.held_step = rewind_to - 1
                return
            except self._wandb.Error as e:
                _LOGGER.warning(
                    f"W&B refused to rewind run {self.run_id} to step {rewind_to} ({e}); its rows of steps "
                    f"{rewind_to}-{self.held_step} are kept and the replayed ones dropped"
                )
        self._run = self._wandb.init(id=self.run_id, resume="allow", **common)

    def purge(self, step: int) -> None:
        if self._run is None and (self.held_step is None or self.held_step < step or not self.online):
            self._start()  # nothing to rewind, or offline: steps up to held_step are dropped in `log`
        elif self.online and self.held_step is not None and self.held_step >= step:
            self.close()
            self._start(rewind_to=int(step))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self._run is None:
            self._start()
        if self.held_step is not None and step <= self.held_step:  # W&B holds this step (module docstring)
            return
        self._run.log(numeric_scalars(metrics), step=int(step))
        self.held_step = int(step)
        _write_step(self._step_path, self.held_step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def _read_step(path: str) -> int | None:
    """The step in `path` (`WANDB_STEP_FILE`), or None when there is none or it is unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _write_step(path: str, step: int) -> None:
    """Writes `step` to `path` atomically (a temporary file renamed over it)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"{step}\n")
    os.replace(tmp, path)
