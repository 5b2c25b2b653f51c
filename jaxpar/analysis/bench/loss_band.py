"""Whether one run's loss curve stays within the seed-to-seed spread of another's: FP8 against bf16
(`benchmarks/fp8_loss.py`).

Runs of the same config with seeds s = 1..S (`train.seed`: the initial weights; the batches are the same) spread at
each logged step k over band_k = max_s bf16[s][k] - min_s bf16[s][k], the measured range of what a run of that
config can give there. A treatment (FP8) run with seed s starts from the same weights and sees the same batches as
the reference run with seed s, so its difference from that run, |fp8[s][k] - bf16[s][k]|, is the treatment's own
effect. With few seeds the range at one step is a noisy measure (3 seeds span 1.69 standard deviations on average,
and at some step far less), so the claim is made against the pooled band: Z = 2 times the reference's seed-to-seed
standard deviation, its per-step sample variances averaged over the logged steps (about 95% of a normal spread).
The treatment is within the band when its largest same-seed difference at every logged step is at most that.
Losses are nats per token.
"""

from __future__ import annotations

import numpy as np

Z = 2.0  # the pooled band's width in standard deviations


def compare_to_band(reference: dict[int, dict[int, float]], treatment: dict[int, dict[int, float]]) -> dict:
    """Per logged step (the steps every run logged), the reference's seed range and the treatment's largest
    difference from the reference run of the same seed (module docstring).

    Args:
      reference, treatment: {seed: {step: training loss}}; the same seeds in both, at least 2.

    Returns:
      {"steps": [k, ...], "band": [the reference's seed range at k, ...], "gap": [max_s |treatment - reference|,
       ...], "ratio": [gap / range, ...], "worst_ratio": the largest ratio, "worst_step": its step, "std": the
       pooled seed-to-seed standard deviation, "pooled_band": Z * std, "within": every gap <= pooled_band,
       "within_range": the steps whose gap is at most their range, "mean_gap": mean over steps and seeds of
       (treatment - reference), signed}.

    Raises:
      ValueError: fewer than 2 seeds, different seeds, or no step that every run logged.
    """
    seeds = sorted(reference)
    if len(seeds) < 2 or sorted(treatment) != seeds:
        raise ValueError(f"need the same >= 2 seeds in both: reference {seeds}, treatment {sorted(treatment)}")
    steps = sorted(set.intersection(*(set(r) for r in (*reference.values(), *treatment.values()))))
    if not steps:
        raise ValueError("no step that every run logged")
    ref = np.array([[reference[s][k] for k in steps] for s in seeds])
    trt = np.array([[treatment[s][k] for k in steps] for s in seeds])
    band = ref.max(axis=0) - ref.min(axis=0)
    gap = np.abs(trt - ref).max(axis=0)
    ratio = gap / np.maximum(band, np.finfo(np.float64).tiny)
    worst = int(np.argmax(ratio))
    std = float(np.sqrt(np.mean(np.var(ref, axis=0, ddof=1))))
    return {
        "steps": steps,
        "band": band.tolist(),
        "gap": gap.tolist(),
        "ratio": ratio.tolist(),
        "worst_ratio": float(ratio[worst]),
        "worst_step": steps[worst],
        "std": std,
        "pooled_band": Z * std,
        "within": bool(np.all(gap <= Z * std)),
        "within_range": int(np.sum(gap <= band)),
        "mean_gap": float(np.mean(trt - ref)),
    }
