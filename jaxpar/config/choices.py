"""The values a config key may take where each value names an implementation that lives above the config (a remat
policy in `jaxpar.model.stack`, a pipeline schedule in `jaxpar.parallel.pipeline`, a rotary scaling in
`jaxpar.model.rope`, a learning-rate decay in `jaxpar.training.optimizer`, a W&B mode in
`jaxpar.training.trackers`).

The config owns these names: validation checks a key against them at load, before any device work, and the module
that implements them imports them from here and maps each to its implementation (so the config never imports
upward). No jax.
"""

from __future__ import annotations

REMAT_POLICIES = ("none", "dots", "names", "full")  # model.remat
# The remat policies that keep, of the tensor and expert collectives' outputs, only the block exits' (the reduced
# outputs and the MoE combine): their backward re-runs the sequence-parallel all-gathers and the MoE dispatch
# all-to-all. The others keep every collective's output. `jaxpar.model.stack` builds its policies from this split
# and the planner counts bytes by it (`jaxpar.model.stack` gives the measurements behind the choice).
REMAT_KEEPING_EXITS_ONLY = ("names", "full")
# Of those, the policies that keep no expert all-to-all output either: the backward re-runs the whole MoE block,
# dispatch, experts and combine. The combine's output is k * capacity_factor (capacity routing) or k (dropless)
# times the block input per MoE block, which `full`, whose point is to keep only block inputs, does not keep
# (DeepSeek-V3's shape at 1F1B depth 31: 72.8 GB per device kept against 7.3 GB of block inputs).
REMAT_RECOMPUTING_EXPERTS = ("full",)
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "zb-h1", "zb-v")  # pipeline.schedule
CONTEXT_STRATEGIES = ("all_gather", "ring")  # context.strategy
ROPE_SCALINGS = ("none", "linear", "llama3")  # model.rope_scaling
LR_DECAYS = ("cosine", "linear", "constant")  # optimizer.decay
WANDB_MODES = ("", "offline", "online", "disabled")  # metrics.wandb_mode; "" leaves it to WANDB_MODE
