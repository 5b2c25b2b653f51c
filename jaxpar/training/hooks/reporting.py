"""What a run reports: `MetricsHook` (a metrics row every N steps), `ProgressBarHook` (tqdm), `ProgressLogHook`
(a log line every N steps, instead of the bar) and `SampleHook` (generated text at the end)."""

from __future__ import annotations

import jax

from jaxpar.model import flops as flops_lib
from jaxpar.training.hooks.base import Hook, RunContext, TrainResult
from jaxpar.training.moe_loss import MOE_METRICS
from jaxpar.training.sample import MAX_SAMPLE_PARAMS, SamplingUnavailable, sample_text


class MetricsHook(Hook):
    """Writes one row to `run.writer` (metrics.jsonl and the configured trackers) every `every` steps and at
    every step that evaluated (`run.val_loss` set by an `EvalHook` before it):

      step, loss, val_loss, val_tokens, learning_rate, grad_norm, skipped_steps, rollbacks, tokens_per_s,
      step_time_s, tokens, mfu, hfu, memory_peak_bytes, memory_step_bytes

    and, for a data mixture (`data.sources`), `val_loss/<name>` for each source on the rows that evaluated; with
    `model.moe` also moe_aux_loss, moe_z_loss, moe_dropped_fraction, moe_load_max_mean
    (`jaxpar.training.moe_loss.moe_metrics`) and, with sigmoid gating, moe_router_bias_spread. A fresh run that
    evaluated before its first step also gets a step-0 row: its validation figures, `tokens` 0, `rollbacks` 0 and
    the memory figures, the training ones null. (docs/configuration.md, "The run directory", says what each
    means.) Fetching the metrics waits for the step, so other steps run ahead of the host.

    Args:
      every: steps between rows (`train.log_every`).
    """

    def __init__(self, every: int):
        self.every = every

    def due(self, run: RunContext, step: int) -> bool:
        return super().due(run, step) or run.val_loss is not None

    def on_start(self, run: RunContext) -> None:
        if run.start_step == 0 and run.val_loss is not None:
            run.writer.write(0, _row(run, None) | {"tokens": 0})

    def on_step(self, run: RunContext, step: int, state: dict, metrics: dict) -> None:
        run.writer.write(step, _row(run, run.host_metrics(step, metrics)))


def _row(run: RunContext, m: dict[str, float] | None) -> dict:
    """A metrics row from `run`'s shared values and this step's host metrics `m` (None: no step ran, the
    step-0 row; its training figures are null)."""
    m = m or {}
    tokens_per_s = run.tokens_per_s if m else None  # measured by host_metrics
    mfu = (
        None
        if tokens_per_s is None
        else flops_lib.mfu(tokens_per_s, run.flops_per_token, run.mesh.size, run.peak_flops)
    )
    hfu = (
        None
        if run.hardware_flops_per_token is None or tokens_per_s is None
        else flops_lib.mfu(tokens_per_s, run.hardware_flops_per_token, run.mesh.size, run.peak_flops)
    )
    return {
        "loss": m.get("loss"),
        "val_loss": run.val_loss,
        "val_tokens": run.val_tokens,
        "learning_rate": m.get("learning_rate"),
        "grad_norm": m.get("grad_norm"),
        "skipped_steps": int(m["skipped_steps"]) if "skipped_steps" in m else None,
        "rollbacks": run.rollbacks,
        "tokens_per_s": tokens_per_s,
        "step_time_s": run.step_time_s if m else None,
        "tokens": m.get("tokens"),
        "mfu": mfu,
        "hfu": hfu,
        **run.memory,
        **{f"val_loss/{name}": value for name, value in (run.val_losses or {}).items()},
        **{k: m[k] for k in MOE_METRICS if k in m},
        **(_fp8_mfu(run, tokens_per_s) if run.cfg.precision.fp8.enabled else {}),
    }


def _fp8_mfu(run: RunContext, tokens_per_s: float | None) -> dict:
    """With FP8 GEMMs, `mfu_fp8_peak`: the same model FLOPs against the device's dense FP8 peak (`mfu` stays
    against bf16's, as the anchors report; null where the FP8 peak is unknown)."""
    value = (
        None
        if tokens_per_s is None
        else flops_lib.mfu(tokens_per_s, run.flops_per_token, run.mesh.size, run.peak_fp8_flops)
    )
    return {"mfu_fp8_peak": value}


class ProgressBarHook(Hook):
    """A tqdm progress bar on process 0, advanced every step; it shows the loss, tokens/s and validation loss
    of the steps whose metrics a hook before it fetched (`MetricsHook`, `EvalHook`)."""

    def __init__(self):
        self._bar = None

    def on_start(self, run: RunContext) -> None:
        self._bar = None
        if jax.process_index() == 0:
            from tqdm import tqdm

            self._bar = tqdm(
                total=run.cfg.train.steps, initial=run.start_step, desc="train", unit="step", dynamic_ncols=True
            )
            run.stack.callback(self._bar.close)

    def on_step(self, run: RunContext, step: int, state: dict, metrics: dict) -> None:
        if self._bar is None:
            return
        if run.host is not None:
            self._bar.set_postfix(
                loss=f"{run.host['loss']:.3f}",
                tok_s=f"{run.tokens_per_s:,.0f}",
                **({"val": f"{run.val_loss:.3f}"} if run.val_loss is not None else {}),
            )
        self._bar.update(1)


class ProgressLogHook(Hook):
    """A log line every `every` steps, for runs without a progress bar (`train.progress_bar=false`, e.g. a batch
    job's log file): "step 20/200: loss 2.4512, val_loss 2.4790, grad_norm 0.812, lr 3.0e-04, 41,233 tokens/s,
    0.099 s/step" (val_loss only on steps that evaluated; lr only when the step reports it).

    Args:
      every: steps between lines (`train.log_every`).
    """

    def __init__(self, every: int):
        self.every = every

    def on_step(self, run: RunContext, step: int, state: dict, metrics: dict) -> None:
        m = run.host_metrics(step, metrics)
        parts = [f"loss {m['loss']:.4f}"]
        if run.val_loss is not None:
            parts.append(f"val_loss {run.val_loss:.4f}")
        parts.append(f"grad_norm {m['grad_norm']:.3f}")
        if "learning_rate" in m:
            parts.append(f"lr {m['learning_rate']:.2e}")
        parts.append(f"{run.tokens_per_s:,.0f} tokens/s, {run.step_time_s:.3f} s/step")
        run.log(f"step {step}/{run.cfg.train.steps}: {', '.join(parts)}")


class SampleHook(Hook):
    """At the end of a run (not after a preemption), continues `prompt` by `num_tokens` sampled tokens
    (`jaxpar.training.sample.sample_text`, temperature 0.8, top-k 40) decoded with the run's tokenizer, logs the text
    and sets `result.sample`. When the run has no usable tokenizer (a flat `tokens` file, a shard set whose
    tokenizer cannot be rebuilt) or more than `max_params` parameters (sampling gathers them onto every host), it
    logs why and skips (`result.sample` stays "").

    Args:
      num_tokens: tokens to generate (`train.sample_tokens`). prompt: the text to continue.
      seed: the sampling seed (`train.seed`).
      tokenizer: the `TextTokenizer` to use instead of the run's (`jaxpar.training.sample.run_tokenizer`).
      max_params: the largest model sampled (`jaxpar.training.sample.MAX_SAMPLE_PARAMS`).
    """

    def __init__(
        self,
        num_tokens: int,
        *,
        prompt: str = "def ",
        seed: int = 0,
        tokenizer=None,
        max_params: int = MAX_SAMPLE_PARAMS,
    ):
        self.num_tokens, self.prompt, self.seed = num_tokens, prompt, seed
        self.tokenizer, self.max_params = tokenizer, max_params

    def on_end(self, run: RunContext, result: TrainResult) -> None:
        if result.preempted_at or self.num_tokens <= 0:
            return
        try:
            result.sample = sample_text(
                run.plan,
                result.state["params"],
                prompt=self.prompt,
                num_tokens=self.num_tokens,
                seed=self.seed,
                tokenizer=self.tokenizer,
                max_params=self.max_params,
            )
        except SamplingUnavailable as e:
            run.log(f"sample: skipped ({e})")
            return
        run.log("sample:\n" + printable(result.sample))


def printable(text: str) -> str:
    """`text` with control characters (other than newline and tab) written as escapes (\\x1b, \\u2028), so that
    a sample of an early model cannot move the cursor or recolour the terminal it is logged to."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)
