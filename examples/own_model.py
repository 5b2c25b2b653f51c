"""Your own model, data and loss through jaxpar's public API, on data x tensor x pipeline, stopped and resumed.

    python examples/own_model.py
    jaxpar-launch -n 2 --devices-per-process 4 -- python examples/own_model.py

Trains the GPT-2 family of `examples/gpt2.py` (registered as model.name=gpt2, written only against
`jaxpar.model`) with a Grain iterator of its own and a label-smoothed cross-entropy of its own, on 8 devices laid
out as data=2 x tensor=2 (sequence parallel) x pipeline=2 (1F1B) with ZeRO-3 (parameters sharded over data).
Runs the steps once without a stop and once stopped at half and resumed from its checkpoint with a fresh
iterator, and checks that every loss is bitwise the same. Then restores the last checkpoint onto another mesh
(pure data parallelism over every device), evaluates it and samples from it. The second command runs the same
script as 2 processes x 4 devices (multi-host `jax.distributed` on 127.0.0.1); the losses match the first's
to fp32 rounding (the CPU collectives across processes may add in another order).

Extra `key=value` arguments override the config. Run directories: RUN_DIR/whole and RUN_DIR/split (--run-dir,
default runs/own_model), replaced on every start.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before jax is imported: 8 simulated CPU devices

import argparse
import shutil
import sys

import grain
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

import jaxpar

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpt2.py, own_data.py beside this file
import gpt2  # noqa: E402, F401  (registers model.name=gpt2)
from own_data import stdlib_windows  # noqa: E402  (the standard library's text in windows of byte tokens)

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs", "tiny.yaml")
SETTINGS = [
    "model.name=gpt2",
    "model.n_kv_heads=null",
    "model.tie_embeddings=true",
    "optimizer.weight_decay_exclude=['*.scale','*.b*']",  # no decay for GPT-2's norm scales and biases
    "model.d_model=128",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.d_ff=512",
    "mesh.data=2",
    "mesh.fsdp=1",
    "mesh.tensor=2",
    "mesh.pipeline=2",
    "tensor.sequence_parallel=true",
    "pipeline.microbatches=4",
    "pipeline.schedule=1f1b",
    "optimizer.zero_stage=3",
    "data.seq_len=64",
    "train.global_batch_size=16",
    "optimizer.learning_rate=1e-3",
    # a constant rate after warmup: a run stopped early is the same run as a longer one up to that step
    "optimizer.decay=constant",
    "optimizer.warmup_steps=2",
    "data.max_bytes=300000",
    "train.eval_batches=2",
    "train.eval_every=0",
    "train.log_every=1",
    "train.sample_tokens=0",
    "train.progress_bar=false",
    "checkpoint.async_save=false",
]
SMOOTHING = 0.1


def label_smoothed_cross_entropy(logits_BTV: jax.Array, batch: dict) -> jax.Array:
    """Summed (1 - e) * CE(target) + e * mean over the vocabulary of -log p (Szegedy et al. 2016, section 7),
    weighted by loss_mask: a plain loss of the full logits [b, T, V] (jaxpar gathers the vocabulary shards)."""
    logp = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    target = jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    per_token = -(1.0 - SMOOTHING) * target - SMOOTHING * jnp.mean(logp, axis=-1)
    return jnp.sum(per_token * batch["loss_mask"])


def batches(windows: np.ndarray, global_batch: int, seed: int = 0):
    """A Grain iterator (checkpointable: get_state / set_state) of this process's rows of each global batch:
    every process draws the same shuffled global batch and keeps its own contiguous block of rows, so the
    global batch is the same for any number of processes."""
    rows, first = global_batch // jax.process_count(), jax.process_index() * (global_batch // jax.process_count())
    ds = (
        grain.MapDataset.source(list(windows))
        .shuffle(seed=seed)
        .repeat()
        .map(lambda w: {"inputs": w[:-1], "targets": w[1:], "loss_mask": np.ones(len(w) - 1, np.float32)})
    )
    ds = ds.to_iter_dataset().batch(global_batch)
    return iter(ds.map(lambda b: {k: v[first : first + rows] for k, v in b.items()}))


def local_rows(global_rows: np.ndarray) -> np.ndarray:
    """This process's contiguous block of a global batch's rows."""
    rows = len(global_rows) // jax.process_count()
    return global_rows[jax.process_index() * rows : (jax.process_index() + 1) * rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps (default 8; the split run stops at half)")
    ap.add_argument("--run-dir", default="runs/own_model", help="where the two runs go (replaced)")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = ap.parse_args(argv)
    jaxpar.configure_logging()
    jaxpar.initialize()  # jax.distributed, when jaxpar-launch (or a cluster) started several processes
    half = max(args.steps // 2, 1)
    if jax.process_index() == 0:
        shutil.rmtree(args.run_dir, ignore_errors=True)
    multihost_utils.sync_global_devices("run directories cleared")

    def cfg(run: str, steps: int) -> jaxpar.Config:
        return jaxpar.load_config(
            CONFIG,
            [
                *SETTINGS,
                f"train.steps={steps}",
                f"checkpoint.every_steps={half}",
                f"train.run_dir={os.path.join(args.run_dir, run)}",
                *args.overrides,
            ],
        )

    base = cfg("whole", args.steps)
    windows = stdlib_windows(base.data.seq_len)

    def run(c: jaxpar.Config) -> jaxpar.TrainResult:
        return jaxpar.train(c, loss_fn=label_smoothed_cross_entropy, data=batches(windows, c.train.global_batch_size))

    whole = run(base)
    run(cfg("split", half))
    rest = run(cfg("split", args.steps))  # resumes at step `half` with the iterator's saved position

    restored = jaxpar.restore(
        os.path.join(args.run_dir, "split"),
        ["mesh.data=-1", "mesh.tensor=1", "mesh.pipeline=1", "pipeline.microbatches=1", "optimizer.zero_stage=1"],
    )
    rows = local_rows(windows[-base.train.global_batch_size :])  # the last windows, as one global batch
    batch = {"inputs": rows[:, :-1], "targets": rows[:, 1:], "loss_mask": np.ones(rows[:, 1:].shape, np.float32)}
    batch = {k: jax.make_array_from_process_local_data(restored.plan.batch_sharding, v) for k, v in batch.items()}
    loss_sum, tokens = jaxpar.make_eval_step(restored.plan)(restored.params, batch)
    sample = jaxpar.sample_text(restored.plan, restored.params, prompt="def ", num_tokens=40, seed=0)

    same = all(rest.losses[s] == whole.losses[s] for s in rest.losses)
    if jax.process_index() == 0:
        print(f"{'step':>4}  {'uninterrupted':>13}  {'stopped at ' + str(half) + ', resumed':>21}")
        for s in sorted(whole.losses):
            resumed = f"{rest.losses[s]:.6f}" if s in rest.losses else "(first half)"
            print(f"{s:>4}  {whole.losses[s]:>13.6f}  {resumed:>21}")
        print(f"resumed losses {'equal' if same else 'DIFFER from'} the uninterrupted run's, bitwise")
        print(
            f"restored step {restored.step} onto mesh {dict(restored.plan.mesh.shape)}: loss "
            f"{float(loss_sum) / float(tokens):.4f} nats/token on {int(tokens)} tokens; sample: {sample!r}"
        )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
