"""jaxpar as a library with your own loss and optimizer: a few steps of the tiny config on 8 simulated CPU
devices (data=2 x fsdp=2 x tensor=2 with sequence parallelism, ZeRO-1) with cross-entropy + z-loss (PaLM,
Chowdhery et al. 2022, section 5) and Lion (Chen et al. 2023, arXiv 2302.06675) wrapped in jaxpar's non-finite skip,
with a warmup-cosine schedule.

    python examples/custom_loss_optimizer.py --steps 6

Prints each step's training loss (cross-entropy + z-loss, nats), learning rate and skipped-update count (the
metrics.jsonl columns), the validation cross-entropy before and after, and how Lion's momentum is sharded (split
over data x fsdp like the parameters' optimizer state under ZeRO-1). Extra `key=value` arguments override the
config; the run directory is temporary.

The calls it shows:

    train(cfg, loss_fn=cross_entropy_with_z_loss(1e-4), optimizer=skip_nonfinite(optax.lion(schedule)),
          learning_rate=schedule)

and `jaxpar.training.plan.build_plan(cfg, mesh, loss_fn=..., optimizer=..., learning_rate=...)` takes the same
keywords for a hand-written loop (`init_state`, `make_train_step`).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before jax is imported: 8 simulated CPU devices

import argparse
import json
import tempfile

import jax
import optax
from optax import tree_utils as otu

from jaxpar.config import load_config
from jaxpar.log import configure_logging
from jaxpar.training.loop import train
from jaxpar.training.loss import cross_entropy_with_z_loss
from jaxpar.training.optimizer import skip_nonfinite

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs", "tiny.yaml")
# Short and small, so that it runs in seconds: 1 MB of text, one validation batch, no checkpoints or sampling.
# Validation at step 0 and at the last step only: train.eval_every is set to the step count in main().
QUICK = [
    "data.max_bytes=1000000",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.sample_tokens=0",
    "train.progress_bar=false",
    "checkpoint.every_steps=0",
]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps (default 6)")
    ap.add_argument("--peak-lr", type=float, default=3e-4, help="Lion's peak learning rate (default 3e-4)")
    ap.add_argument("--z-loss", type=float, default=1e-4, help="z-loss weight (default 1e-4, PaLM's)")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = ap.parse_args(argv)
    configure_logging()  # jaxpar's log lines (jaxpar.log), as jaxpar-train prints them

    # Lion wants a learning rate 3-10x below AdamW's (Chen et al. 2023). The schedule is given to
    # the optimizer and to train(), which reports it as the learning_rate metric.
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=args.peak_lr / 10,
        peak_value=args.peak_lr,
        warmup_steps=max(args.steps // 3, 1),
        decay_steps=args.steps,
    )
    with tempfile.TemporaryDirectory(prefix="jaxpar-custom-") as run_dir:
        cfg = load_config(
            CONFIG,
            [
                *QUICK,
                f"train.steps={args.steps}",
                f"train.eval_every={args.steps}",
                f"train.run_dir={run_dir}",
                *args.overrides,
            ],
        )
        result = train(
            cfg,
            loss_fn=cross_entropy_with_z_loss(args.z_loss),
            optimizer=skip_nonfinite(optax.lion(schedule)),
            learning_rate=schedule,
        )
        with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
            rows = [row for row in map(json.loads, f) if row["step"] > 0]  # step 0: validation only
    print("step  loss (CE + z-loss)  learning rate  skipped")
    for row in rows:
        print(f"{row['step']:4d}  {row['loss']:18.4f}  {row['learning_rate']:13.3e}  {row['skipped_steps']:7d}")
    print(f"validation cross-entropy: {result.initial_val_loss:.4f} -> {result.val_loss:.4f} nats/token")
    mu = otu.tree_get(result.state["opt_state"], "mu")["blocks"]["mlp"]["w_up"]
    print(
        f"Lion momentum of blocks.mlp.w_up {tuple(mu.shape)}: spec {mu.sharding.spec}, "
        f"{tuple(mu.sharding.shard_shape(mu.shape))} per device on {len(mu.sharding.device_set)} devices"
    )
    return {
        "rows": rows,
        "losses": result.losses,
        "val_loss": result.val_loss,
        "initial_val_loss": result.initial_val_loss,
        "mu_sharding": mu.sharding,
        "devices": jax.device_count(),
    }


if __name__ == "__main__":
    main()
