"""Validation: `evaluate` (one pass over the validation split) and `EvalHook` (at step 0, every N steps, at the
last step, and the final figure of the run)."""

from __future__ import annotations

from collections.abc import Callable

from jaxpar.data import EvalLoader
from jaxpar.training.hooks.base import Hook, RunContext, TrainResult


def evaluate(
    eval_step, params, loader: EvalLoader, beat: Callable[[int], None] | None = None, step: int = 0
) -> tuple[float, int]:
    """Token-mean validation loss (nats) over one pass of `loader` (every scored sequence once, padding rows
    masked out), and the number of valid tokens it covers.

    `eval_step(params, batch)` returns (summed loss in nats, valid tokens) of one global batch
    (`jaxpar.training.step.make_eval_step`). `beat(step)`, if given, is called after every batch (the hang
    watchdog's progress mark).
    """
    total = count = 0.0
    for batch in loader.batches():
        loss_sum, n = eval_step(params, batch)
        total, count = total + float(loss_sum), count + float(n)
        if beat is not None:
            beat(step)
    return total / max(count, 1.0), int(round(count))


def evaluate_sources(
    eval_step, params, loader, beat: Callable[[int], None] | None = None, step: int = 0
) -> tuple[float, int, dict[str, float]]:
    """`evaluate` for a validation loader of several sources (`jaxpar.data.MixtureEvalLoader`, whose `loaders`
    maps each source's name to its `EvalLoader`): (token-mean loss over all sources' valid tokens, those tokens,
    {name: the source's own token-mean loss}). For a single `EvalLoader` the dict is empty.

    The overall figure is sum(loss sums) / sum(tokens) over the sources: each source weighs by its validation
    tokens, not by its mixture weight; it equals `evaluate` over the whole mixed pass.
    """
    loaders = getattr(loader, "loaders", None)
    if not loaders:
        loss, tokens = evaluate(eval_step, params, loader, beat, step)
        return loss, tokens, {}
    total = count = 0.0
    by_source = {}
    for name, one in loaders.items():
        loss, tokens = evaluate(eval_step, params, one, beat, step)
        by_source[name] = loss
        total, count = total + loss * tokens, count + tokens
    return total / max(count, 1.0), int(round(count)), by_source


def source_losses_text(losses: dict[str, float]) -> str:
    """ " (web 2.3141, code 1.9876)" for the log lines; "" without sources."""
    return f" ({', '.join(f'{n} {v:.4f}' for n, v in losses.items())})" if losses else ""


class EvalHook(Hook):
    """Validation loss (token-mean cross-entropy, nats) of the run's validation split.

    Evaluates before the first step of a fresh run (`run.initial_val_loss`, logged as step 0 and set as
    `run.val_loss` until the first step, for `MetricsHook`'s step-0 row), every `every` steps and at the last
    step (`run.val_loss`, `run.val_tokens` and, for a mixture, `run.val_losses` with each source's loss, for the
    hooks after it, e.g. `MetricsHook`), and at the end sets `result.val_loss` and logs it against the unigram
    entropy of the same tokens (reusing the last step's evaluation; skipped after a preemption). Evaluation time
    is not step time.

    Args:
      every: steps between evaluations (`train.eval_every`); 0: no periodic evaluation and none at step 0, only
        the final one at the last step.
    """

    def __init__(self, every: int):
        self.every = every

    def due(self, run: RunContext, step: int) -> bool:
        return super().due(run, step) or step == run.cfg.train.steps

    def on_start(self, run: RunContext) -> None:
        if run.start_step == 0 and self.every > 0:
            run.val_loss, run.val_tokens, run.val_losses = evaluate_sources(
                run.eval_step, run.state["params"], run.val_loader, run.beat
            )
            run.initial_val_loss = run.val_loss
            run.log(f"step 0: val_loss {run.val_loss:.4f}{source_losses_text(run.val_losses)} over {run.val_cover}")

    def on_step(self, run: RunContext, step: int, state: dict, metrics: dict) -> None:
        run.host_metrics(step, metrics)  # waits for the step first, so its time is measured without evaluation
        with run.untimed():
            run.val_loss, run.val_tokens, run.val_losses = evaluate_sources(
                run.eval_step, state["params"], run.val_loader, run.beat, step
            )

    def on_end(self, run: RunContext, result: TrainResult) -> None:
        if result.preempted_at:
            return
        if run.val_loss is not None:
            final, by_source = run.val_loss, run.val_losses or {}
        else:
            final, _, by_source = evaluate_sources(run.eval_step, result.state["params"], run.val_loader)
        result.val_loss, result.val_losses = final, dict(by_source)
        entropy = result.val_unigram_entropy
        run.log(
            f"final val_loss {final:.4f} nats/token{source_losses_text(by_source)} over {run.val_cover} vs "
            f"their unigram entropy {entropy:.4f} (ratio {final / entropy:.3f})"
        )
