"""The training loop's parts as hooks (`Hook`): a script adds, removes or replaces them.

    from jaxpar.training.hooks import Hook, ProgressBarHook, default_hooks
    hooks = [h for h in default_hooks(cfg) if not isinstance(h, ProgressBarHook)]   # no progress bar
    result = train(cfg, hooks=[*hooks, MyHook()])

`default_hooks(cfg)` is what `train(cfg)` and `jaxpar-train` run; `base` documents the order of events.
"""

from __future__ import annotations

from jaxpar.training.hooks.base import Hook, RunContext, TrainResult
from jaxpar.training.hooks.checkpointing import CheckpointHook
from jaxpar.training.hooks.evaluation import EvalHook, evaluate, evaluate_sources
from jaxpar.training.hooks.reporting import MetricsHook, ProgressBarHook, ProgressLogHook, SampleHook
from jaxpar.training.hooks.resilience import DivergenceHook, PreemptionHook, TrainingDiverged, WatchdogHook

__all__ = [
    "CheckpointHook",
    "DivergenceHook",
    "EvalHook",
    "Hook",
    "MetricsHook",
    "PreemptionHook",
    "ProgressBarHook",
    "ProgressLogHook",
    "RunContext",
    "SampleHook",
    "TrainResult",
    "TrainingDiverged",
    "WatchdogHook",
    "default_hooks",
    "evaluate",
    "evaluate_sources",
]


def default_hooks(cfg) -> list[Hook]:
    """The hooks of a run of `cfg` (a `jaxpar.config.Config`), in the order they run:

    DivergenceHook(train.max_bad_steps, train.divergence_rollbacks)  first: it may undo the step
    EvalHook(train.eval_every)                                        before the metrics row it fills
    MetricsHook(train.log_every)
    ProgressBarHook()                                                 with train.progress_bar
    ProgressLogHook(train.log_every)                                  without it: a log line instead
    PreemptionHook()                                                  before the checkpoint it asks for
    CheckpointHook()
    WatchdogHook(train.watchdog_s)                                    entered last, closed first
    SampleHook(train.sample_tokens, seed=train.seed)                  with train.sample_tokens > 0
    """
    t = cfg.train
    hooks: list[Hook] = [
        DivergenceHook(t.max_bad_steps, t.divergence_rollbacks),
        EvalHook(t.eval_every),
        MetricsHook(t.log_every),
    ]
    hooks.append(ProgressBarHook() if t.progress_bar else ProgressLogHook(t.log_every))
    hooks += [PreemptionHook(), CheckpointHook(), WatchdogHook(t.watchdog_s)]
    if t.sample_tokens > 0:
        hooks.append(SampleHook(t.sample_tokens, seed=t.seed))
    return hooks
