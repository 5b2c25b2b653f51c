"""FP8 against bf16 over a training run on real text: is FP8's loss within bf16's seed-to-seed band at every
logged step? (`jaxpar.analysis.bench.loss_band` says how the band is measured.)

    python benchmarks/fp8_loss.py [--config configs/tiny.yaml] [--steps 300] [--seeds 1 2 3] [--log-every 10]
        [--out runs/fp8_loss] [key=value ...]

Trains the config on one device (the standard library's sources, as the README's run) with
`precision.compute_dtype=bfloat16`, once per seed with `precision.fp8.enabled` off and once on, and prints per
logged step the bf16 band, FP8's largest difference from the bf16 run of its seed, and their ratio; writes
results.json and, with the plot extra (matplotlib), loss.png under --out. On CPU the FP8 GEMMs run at reference
speed: this measures the numerics, not the speed.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1")  # before jax is imported

import argparse
import json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(config: str, overrides: list[str], run_dir: str) -> dict[int, float]:
    from jaxpar.config import load_config
    from jaxpar.training.loop import train

    cfg = load_config(config, [*overrides, f"train.run_dir={run_dir}"], num_devices=1)
    train(cfg)
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in rows if r["step"] > 0 and r["loss"] is not None}


def _plot(results: dict, out: str) -> str | None:
    from jaxpar.config.extras import MissingExtra, require

    try:
        matplotlib = require("matplotlib", "benchmarks/fp8_loss.py's loss.png")
    except MissingExtra as e:
        print(f"fp8_loss: {e}; skipping loss.png")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    for name, label, style in (
        ("bf16", "bf16", dict(color="tab:blue")),
        ("fp8", "FP8", dict(color="tab:red", ls="--")),
    ):
        for i, losses in enumerate(results[name].values()):
            steps = sorted(losses)
            top.plot(steps, [losses[k] for k in steps], lw=1, label=None if i else label, **style)
    top.set_ylabel("training loss (nats/token)")
    top.legend()
    band = results["band"]
    bottom.fill_between(band["steps"], 0, band["band"], color="tab:blue", alpha=0.25, label="bf16 seed range")
    bottom.axhline(band["pooled_band"], color="tab:blue", ls=":", label="band: 2 x bf16 seed std")
    bottom.plot(band["steps"], band["gap"], color="tab:red", label="max |FP8 - bf16|, same seed")
    bottom.set_xlabel("step")
    bottom.set_ylabel("nats/token")
    bottom.legend()
    path = os.path.join(out, "loss.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny.yaml"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--out", default="runs/fp8_loss")
    ap.add_argument("overrides", nargs="*", help="section.key=value, applied to every run")
    args = ap.parse_args(argv)
    from jaxpar.analysis.bench.loss_band import compare_to_band
    from jaxpar.log import configure_logging

    configure_logging()
    common = [
        "mesh.data=1",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "precision.compute_dtype=bfloat16",
        f"train.steps={args.steps}",
        f"train.log_every={args.log_every}",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "train.progress_bar=false",
        "checkpoint.every_steps=0",
        *args.overrides,
    ]
    results: dict = {"bf16": {}, "fp8": {}}
    for seed in args.seeds:
        for name, fp8 in (("bf16", "false"), ("fp8", "true")):
            run_dir = os.path.join(args.out, f"{name}_seed{seed}")
            overrides = [*common, f"train.seed={seed}", f"precision.fp8.enabled={fp8}"]
            results[name][seed] = _train(args.config, overrides, run_dir)
    band = compare_to_band(results["bf16"], results["fp8"])
    results["band"] = band
    print("| step | bf16 seed range | max abs(FP8 - bf16), same seed | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    for k, b, g, r in zip(band["steps"], band["band"], band["gap"], band["ratio"]):
        print(f"| {k} | {b:.4f} | {g:.4f} | {r:.2f} |")
    print(
        f"band: {band['pooled_band']:.4f} nats (2 x bf16's pooled seed-to-seed standard deviation, "
        f"{band['std']:.4f}); largest FP8 - bf16 difference {max(band['gap']):.4f}; within the band at every "
        f"logged step: {band['within']}; within that step's seed range at {band['within_range']} of "
        f"{len(band['steps'])} steps (worst ratio {band['worst_ratio']:.2f} at step {band['worst_step']}); mean "
        f"FP8 - bf16 {band['mean_gap']:+.4f} nats"
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    plot = _plot(results, args.out)
    print(f"results: {os.path.join(args.out, 'results.json')}" + (f"; plot: {plot}" if plot else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
