"""Golden losses: five layouts of a small Llama trained for 20 steps on a fixed token stream, on 8 simulated CPU
devices, and the training loss of every step. Shared by tests/system/test_golden_losses.py (a run against the
committed table), tools/golden_losses.py (writes the table and measures the spread across XLA CPU instruction
sets) and tools/compare_losses.py (the same runs at two commits, compared bitwise).

Only jaxpar's public API is used here (`jaxpar.load_config`, `jaxpar.train`, `jaxpar.Hook`), so the runs also work
with an older commit's jaxpar on PYTHONPATH (tools/compare_losses.py).

The data: `token_stream`, a first-order Markov chain over 64 of the 264 token ids drawn from numpy's PCG64 bit
generator's raw 64-bit output (`random_raw`, the same on every numpy version and platform) with integer
arithmetic only, written to a `data.source: tokens` file for each run. The loss falls from ln(264) = 5.58 towards
the chain's conditional entropy (about 1.5 nats), so every step's update matters.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from importlib import metadata

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "golden_losses.py")  # `run` in a process of its own
STEPS = 20
TOKENS = 1 << 15  # the stream's length; 95% of it (31,130) train tokens, of which 20 steps read at most 5,440
SEED = 0
ALPHABET = 64  # token ids used, out of model.vocab_size = 264
SUCCESSORS = 4  # each token's possible next tokens


@dataclasses.dataclass(frozen=True)
class GoldenConfig:
    """One golden run: `base` (a file of configs/) with `COMMON` and then `overrides` applied; `what` says it."""

    base: str
    overrides: tuple[str, ...]
    what: str


# Every run: the tiny model shrunk until compiling, which dominates, is a few seconds per layout; a warm-up of 5
# steps so most steps run at the peak rate; nothing written but the run directory's config and metrics; evaluation,
# sampling and the watchdog off.
COMMON = (
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=128",
    "data.seq_len=16",
    "data.source=tokens",
    "data.token_dtype=uint16",
    "train.global_batch_size=8",
    f"train.steps={STEPS}",
    "train.eval_every=0",
    "train.progress_bar=false",
    "train.sample_tokens=0",
    "train.watchdog_s=0",
    "optimizer.warmup_steps=5",
    "checkpoint.every_steps=0",
    "metrics.tensorboard=false",
)
PIPELINE = ("mesh.fsdp=1", "mesh.pipeline=2", "pipeline.microbatches=4")
CONFIGS = {
    "default": GoldenConfig(
        "tiny.yaml", (), "tiny.yaml's layout: data=2 fsdp=2 tensor=2, sequence parallel, ZeRO-1, 2 layers"
    ),
    "1f1b": GoldenConfig("tiny.yaml", PIPELINE, "data=2 pipeline=2 tensor=2, 1F1B over 4 microbatches, 2 layers"),
    "interleaved_1f1b": GoldenConfig(
        "tiny.yaml",
        (*PIPELINE, "pipeline.virtual_stages=2", "model.n_layers=4"),
        "data=2 pipeline=2 tensor=2, interleaved 1F1B with 2 virtual stages over 4 microbatches, 4 layers",
    ),
    "zero3_accum": GoldenConfig(
        "tiny.yaml",
        (
            "mesh.data=4",
            "mesh.fsdp=2",
            "mesh.tensor=1",
            "optimizer.zero_stage=3",
            "train.grad_accum_steps=2",
            "train.global_batch_size=16",
        ),
        "data=4 fsdp=2, ZeRO-3, 2 accumulation microbatches of 8 rows, 2 layers",
    ),
    "moe": GoldenConfig(
        "tiny_moe.yaml",
        ("model.moe.d_expert=32",),
        "tiny_moe.yaml's layout: data=2 fsdp=2 tensor=2, sequence parallel, ZeRO-1, 8 experts of width 32 over "
        "data x fsdp (expert parallel), top-2 dropless, 1 shared expert, the second of 2 blocks MoE",
    ),
}


def token_stream(n: int = TOKENS, seed: int = SEED) -> np.ndarray:
    """`n` uint16 token ids in [0, ALPHABET): a Markov chain in which token a is followed by one of its
    SUCCESSORS fixed successors (probabilities 1/2, 1/4, 1/8, 1/8) or, one time in 16, by any id.

    Only PCG64's raw 64-bit words (`np.random.PCG64(seed).random_raw`) and integer arithmetic are used, so the
    stream is the same on every numpy version, Python version and platform (numpy's Generator methods such as
    `integers` carry no such promise across numpy versions).
    """
    raw = np.random.PCG64(seed).random_raw(ALPHABET * SUCCESSORS + n)
    successor = (raw[: ALPHABET * SUCCESSORS] % ALPHABET).astype(np.int64).reshape(ALPHABET, SUCCESSORS)
    words = raw[ALPHABET * SUCCESSORS :]
    which = np.array([0, 0, 0, 0, 1, 1, 2, 3])[(words % 8).astype(np.int64)]
    jump = (words >> np.uint64(3)) % 16 == 0
    anywhere = ((words >> np.uint64(7)) % ALPHABET).astype(np.int64)
    out = np.empty(n, np.uint16)
    token = 0
    for i in range(n):
        token = anywhere[i] if jump[i] else successor[token, which[i]]
        out[i] = token
    return out


def config_overrides(name: str, tokens_path: str, run_dir: str) -> list[str]:
    """The overrides of golden config `name` on its base file, reading `tokens_path`, writing into `run_dir`."""
    golden = CONFIGS[name]
    return [*COMMON, *golden.overrides, f"data.path={tokens_path}", f"train.run_dir={run_dir}"]


def run(
    names: Sequence[str], workdir: str, *, steps: int = STEPS, root: str = ROOT, extra: Sequence[str] = ()
) -> dict[str, list[float]]:
    """Trains each golden config of `names` for `steps` steps in this process; returns {name: the training loss
    of steps 1..steps (token-mean cross-entropy in nats, the fp32 metric as a float)}.

    `steps` is also `train.steps`, over which the learning rate decays: fewer steps are not the first steps of a
    longer run. `root` is the checkout whose configs/ are read; `workdir` (an existing directory) takes the token
    file and the run directories; `extra` overrides go after a config's own (a perturbed run). Every compile skips
    LLVM optimisation (`jax_disable_most_optimizations`, as `step_helpers.quick_compile`: the program's HLO passes all
    run, only its machine code is less optimised), the mode the table was made in. Needs 8 jax devices
    (JAX_NUM_CPU_DEVICES=8 set before jax starts).

    Raises:
      KeyError: an unknown name. ConfigError: a config the checkout's jaxpar refuses.
    """
    import jax

    import jaxpar

    class Losses(jaxpar.Hook):  # every step's metrics fetched: TrainResult.losses
        every = 1

        def on_step(self, run, step, state, metrics):
            run.host_metrics(step, metrics)

    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise KeyError(f"no golden config {', '.join(unknown)}; they are {', '.join(CONFIGS)}")
    tokens_path = os.path.join(workdir, "tokens.bin")
    token_stream().tofile(tokens_path)
    logger = logging.getLogger("jaxpar")
    level, before = logger.level, jax.config.values["jax_disable_most_optimizations"]
    out = {}
    try:
        logger.setLevel(logging.WARNING)
        jax.config.update("jax_disable_most_optimizations", True)
        for name in names:
            overrides = [*config_overrides(name, tokens_path, os.path.join(workdir, name)), f"train.steps={steps}"]
            cfg = jaxpar.load_config(os.path.join(root, "configs", CONFIGS[name].base), [*overrides, *extra])
            result = jaxpar.train(cfg, hooks=[Losses()])
            out[name] = [result.losses[s] for s in range(1, steps + 1)]
    finally:
        jax.config.update("jax_disable_most_optimizations", before)
        logger.setLevel(level)
    return out


def run_in_subprocess(
    names: Sequence[str],
    *,
    steps: int = STEPS,
    root: str = ROOT,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
) -> dict:
    """`run` in a fresh process of this Python (`tools/golden_losses.py run`): 8 CPU devices, no persistent
    compilation cache, `root`'s jaxpar first on PYTHONPATH (so another checkout's code runs), `env` (the whole
    environment, default this process's) and `prefix` (e.g. taskset -c 0) before the command.

    Returns what the tool writes: {"losses": {name: [loss per step]}, "errors": {name: message} for the configs
    that failed, "jaxpar": the imported package's directory}.

    Raises:
      RuntimeError: the process failed before writing its result (its stderr's tail in the message).
    """
    env = dict(os.environ if env is None else env)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # a pipelined step is refused with the persistent cache on
    env.update(JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu", PYTHONPATH=root)
    with tempfile.TemporaryDirectory(prefix="jaxpar-golden-") as tmp:
        out = os.path.join(tmp, "losses.json")
        cmd = [*prefix, sys.executable, TOOL, "run", "--out", out, "--root", root, "--steps", str(steps)]
        cmd += ["--configs", ",".join(names), *(f"--override={o}" for o in extra)]
        proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def versions() -> dict[str, str]:
    """The versions of what the losses depend on: Python and the numeric libraries."""
    out = {"python": platform.python_version()}
    for package in ("jax", "jaxlib", "numpy", "flax", "optax", "grain"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "absent"
    return out


def relative_differences(got: Sequence[float], want: Sequence[float]) -> list[float]:
    """|got - want| / |want| per step (float64); inf where a value is not finite or the lengths differ."""
    if len(got) != len(want):
        return [float("inf")]
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    with np.errstate(invalid="ignore"):
        rel = np.abs(a - b) / np.abs(b)
    return [float(r) if np.isfinite(r) else float("inf") for r in rel]
