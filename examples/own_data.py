"""jaxpar as a library with your own data: a Grain pipeline of your own feeds `train(cfg, data=...)`, its state
is checkpointed with the model, and the run resumes exactly.

    python examples/own_data.py --steps 6

Builds a Grain iterator over the Python standard library's text (byte tokens, windows of data.seq_len + 1,
shuffled, batched), trains the tiny config on 8 simulated CPU devices for half the steps, stops, resumes from the
checkpoint with a fresh iterator (the data position comes from the checkpoint) to the last step, and compares
every loss with an uninterrupted run of the same steps: they are equal, bitwise. Prints the losses of both.
Extra `key=value` arguments override the config; the run directories are temporary.

The iterator yields this process's rows of each global batch, {"inputs", "targets": int [R, T], "loss_mask":
float [R, T]} (R = global batch / processes), and has Grain's get_state / set_state (`jaxpar.data.IteratorLoader`).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before jax is imported: 8 simulated CPU devices

import argparse
import glob
import sysconfig
import tempfile

import grain
import jax
import numpy as np

from jaxpar.config import load_config
from jaxpar.log import configure_logging
from jaxpar.training.loop import train

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs", "tiny.yaml")
# A constant learning rate, so that a run stopped early is the same run as a longer one up to that step.
QUICK = [
    "data.max_bytes=1000000",
    "train.eval_batches=1",
    "train.eval_every=0",
    "train.log_every=1",
    "train.sample_tokens=0",
    "train.progress_bar=false",
    "optimizer.decay=constant",
    "optimizer.warmup_steps=0",
    "checkpoint.async_save=false",
]


def stdlib_windows(seq_len: int, max_bytes: int = 2_000_000) -> np.ndarray:
    """[N, seq_len + 1] byte tokens: the standard library's .py files, concatenated and cut into windows."""
    text = bytearray()
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, "rb") as f:
            text += f.read()
        if len(text) >= max_bytes:
            break
    tokens = np.frombuffer(bytes(text[:max_bytes]), np.uint8).astype(np.int32)
    n = len(tokens) // (seq_len + 1)
    return tokens[: n * (seq_len + 1)].reshape(n, seq_len + 1)


def batches(windows: np.ndarray, global_batch: int, seed: int = 0):
    """Grain: shuffled windows, each process taking its own share of every global batch, batched."""
    rows = global_batch // jax.process_count()
    ds = (
        grain.MapDataset.source(list(windows))
        .shuffle(seed=seed)
        .repeat()[jax.process_index() :: jax.process_count()]
        .map(lambda w: {"inputs": w[:-1], "targets": w[1:], "loss_mask": np.ones(len(w) - 1, np.float32)})
    )
    return iter(ds.to_iter_dataset().batch(rows))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps (default 6; the run stops at half)")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = ap.parse_args(argv)
    configure_logging()  # jaxpar's log lines (jaxpar.log), as jaxpar-train prints them
    half = max(args.steps // 2, 1)
    with tempfile.TemporaryDirectory(prefix="jaxpar-own-data-") as tmp:

        def cfg(run: str, steps: int):
            return load_config(
                CONFIG,
                [
                    *QUICK,
                    f"train.steps={steps}",
                    f"checkpoint.every_steps={half}",
                    f"train.run_dir={os.path.join(tmp, run)}",
                    *args.overrides,
                ],
            )

        base = cfg("whole", args.steps)
        windows = stdlib_windows(base.data.seq_len)
        whole = train(base, data=batches(windows, base.train.global_batch_size))
        train(cfg("split", half), data=batches(windows, base.train.global_batch_size))
        rest = train(cfg("split", args.steps), data=batches(windows, base.train.global_batch_size))
    same = all(rest.losses[s] == whole.losses[s] for s in rest.losses)
    print(f"uninterrupted: {[round(whole.losses[s], 6) for s in sorted(whole.losses)]}")
    print(f"resumed at step {rest.start_step}: {[round(rest.losses[s], 6) for s in sorted(rest.losses)]}")
    print(f"resumed losses equal the uninterrupted ones: {same}")
    return {"whole": whole.losses, "resumed": rest.losses, "start": rest.start_step, "same": same}


if __name__ == "__main__":
    main()
