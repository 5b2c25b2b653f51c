"""Per-step metrics to `RUN_DIR/metrics.jsonl` (one JSON object per line) and to TensorBoard.

Only process 0 should write: the caller passes `enabled=jax.process_index() == 0`; a disabled writer creates no
files and its methods do nothing. Re-opening a run directory appends, so a resumed run continues the same file.
"""
from __future__ import annotations

import json
import math
import numbers
import os
from typing import Any

import numpy as np

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _to_json_value(value: Any) -> Any:
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


class MetricsWriter:
    """Append `{"step": step, **metrics}` lines to `run_dir/metrics.jsonl` and numeric scalars to TensorBoard.

    Args:
      run_dir: run directory; created if missing (only when enabled).
      enabled: False on every process but 0; then nothing is written.
    """

    def __init__(self, run_dir: str, *, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(run_dir, METRICS_FILE)
        self._file = None
        self._tb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        from tensorboardX import SummaryWriter  # imported only where used: process 0

        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = SummaryWriter(os.path.join(run_dir, TENSORBOARD_DIR))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Write one record. None stays JSON null (and is skipped in TensorBoard), as are NaN/inf in TensorBoard.

        Raises:
          TypeError: a value is a non-scalar array or not JSON-serialisable.
        """
        if not self.enabled:
            return
        record = {"step": int(step)} | {k: _to_json_value(v) for k, v in metrics.items()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for key, value in record.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                self._tb.add_scalar(key, value, global_step=int(step))

    def close(self) -> None:
        """Flush and close both outputs; safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
