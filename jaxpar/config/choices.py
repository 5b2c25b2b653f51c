"""The values a config key may take where each value names an implementation that lives above the config (a remat
policy in `jaxpar.model.stack`, a pipeline schedule in `jaxpar.parallel.pipeline`, a rotary scaling in
`jaxpar.model.rope`, a W&B mode in `jaxpar.training.trackers`).

The config owns these names: validation checks a key against them at load, before any device work, and the module
that implements them imports them from here and maps each to its implementation (so the config never imports
upward). No jax.
"""

from __future__ import annotations

REMAT_POLICIES = ("none", "dots", "names", "full")  # model.remat
PIPELINE_SCHEDULES = ("1f1b", "gpipe")  # pipeline.schedule
ROPE_SCALINGS = ("none", "linear", "llama3")  # model.rope_scaling
WANDB_MODES = ("", "offline", "online", "disabled")  # metrics.wandb_mode; "" leaves it to WANDB_MODE
