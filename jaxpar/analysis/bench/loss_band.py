"""Whether one run's loss curve stays within the seed-to-seed spread of another's: FP8 against bf16
(`benchmarks/fp8_loss.py`).

Runs of the same config with seeds s = 1..S differ in their initial weights and data order; at each logged step k
their training losses spread over band_k = max_s bf16[s][k] - min_s bf16[s][k], the measured range of what a run
of that config can give there. A treatment (FP8) run with seed s sees the same weights and batches as the
reference run with seed s, so its difference from that run, |fp8[s][k] - bf16[s][k]|, is the treatment's own
effect; the treatment stays within the band when that difference is at most band_k at every logged step and seed.
Losses are nats per token.
"""

from __future__ import annotations

import numpy as np


def compare_to_band(reference: dict[int, dict[int, float]], treatment: dict[int, dict[int, float]]) -> dict:
    """Per logged step (the steps every run logged), the reference's seed range and the treatment's largest
    difference from the reference run of the same seed (module docstring).

    Args:
      reference, treatment: {seed: {step: training loss}}; the same seeds in both, at least 2.

    Returns:
      {"steps": [k, ...], "band": [band_k, ...], "gap": [max_s |treatment - reference|, ...], "ratio":
       [gap / band, ...], "worst_ratio": the largest ratio, "worst_step": its step, "within": worst_ratio <= 1,
       "mean_gap": mean over steps and seeds of (treatment - reference), signed}.

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
    return {
        "steps": steps,
        "band": band.tolist(),
        "gap": gap.tolist(),
        "ratio": ratio.tolist(),
        "worst_ratio": float(ratio[worst]),
        "worst_step": steps[worst],
        "within": bool(ratio[worst] <= 1.0),
        "mean_gap": float(np.mean(trt - ref)),
    }
