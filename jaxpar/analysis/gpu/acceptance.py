"""The one-GPU acceptance run (`benchmarks/gpu_acceptance.py`): what a maintainer with one NVIDIA GPU checks in one
command, in a few minutes including compilation.

1. Device: name, memory, dense bf16 peak FLOP/s (`jaxpar.model.flops.PEAK_FLOPS`, vendor datasheets).
2. Attention parity (`attention_parity`): cuDNN's fused kernel against XLA's path, forward and the gradients of
   q, k and v, in bf16, with and without packed-document segment ids, with and without a sliding window of T/4
   keys (`model.sliding_window`), grouped-query heads; both against an fp32 XLA reference on the same bf16 inputs.
3. Speed (`measure_step`): the train step of a ~1B Llama (`configs/llama_1b.yaml`'s shape: d_model 2048, 16
   layers, 32 heads, 8 key/value heads, d_ff 8192, 32,000-token vocabulary; bf16 compute, fp32 parameters and
   AdamW state, sequence 4096) on one device, for each remat policy of a short list whose planned peak fits the
   GPU; tokens/s over timed steps after warm-up, MFU (model FLOPs: 6N + 12*L*h*s per token, PaLM appendix B,
   the attention term not halved for the causal mask) and HFU (plus what the remat policy recomputes,
   `jaxpar.model.flops.hardware_flops_per_token`), the compiler's peak bytes beside the planner's
   (`jaxpar.analysis.planner.plan`). The fastest policy is the one kept.
4. Learning (`train_on_text`): the kept step for `train_steps` steps on real text (the standard library's Python
   sources, byte-tokenised and packed, `jaxpar.data`), loss per step; it must fall.
5. Pipeline schedules (`pipeline_schedules`, 2 or more devices): the step time of ZB-V against interleaved 1F1B,
   both with 2 chunks per device, and of plain 1F1B with the vocabulary-parallel head against the head on the last
   stage, on mesh pipeline = every device (up to 8). On a GPU the bubble is idle time, which ZB-V's table removes,
   and the busiest stage sets the pace, which the vocabulary-parallel head relieves; on CPU the simulated devices
   share cores and neither is (docs/parallelism.md).
6. Context parallelism's fused-kernel path (`jaxpar.analysis.gpu.context_kernels`): a query chunk of the
   load-balanced layout as two cuDNN calls against the same path on the XLA kernel in fp32, forward and gradients,
   with and without packed documents, and cuDNN's log-sum-exps; then the forward + backward time of every chunk at
   64k tokens, c = 8, and the busiest device (chunks i and 2c - 1 - i) over the mean.

7. FP8 (`fp8_check`): the kept step with `precision.fp8.enabled` (the dense layers' GEMMs in FP8,
   `jaxpar.parallel.fp8`): tokens/s against the bf16 step, MFU against the bf16 peak and `mfu_fp8_peak` against
   the FP8 peak (`jaxpar.model.flops.PEAK_FP8_FLOPS`), the GEMM kernels the GPU compiler chose
   (`jaxpar.analysis.hlo.gemms.gemm_kernels`: cuBLASLt's FP8 call or a Triton fusion over FP8 operands), and the
   same learning run as 4 in FP8: its losses against bf16's, step by step.

8. Dropless MoE (`dropless_moe`, 2 or more devices): the settings' model with E = 4 ep SwiGLU experts, top-2,
   dropless routing, the experts split over data = ep = every device (up to 8): tokens/s of the step whose dispatch
   and combine are ragged all-to-alls (`jax.lax.ragged_all_to_all`, `model.moe.all_to_all: ragged`) against the
   emulated transport's padded dense all-to-alls, and their first losses (the same up to the order of sums). On CPU
   the ragged transport does not exist: only the emulation is timed.

`--cpu-smoke` runs the same code on CPU with tiny shapes (the test suite runs it); cuDNN is then reported as not
run. Bytes are per device, FLOP/s per device, times in seconds.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.analysis.gpu import context_kernels
from jaxpar.analysis.planner.plan import plan as analytic_plan
from jaxpar.config import load_config
from jaxpar.config.choices import REMAT_POLICIES
from jaxpar.config.schema import Config
from jaxpar.config.validate import resolve_config
from jaxpar.data.batch import BATCH_KEYS, random_batch
from jaxpar.log import human_bytes
from jaxpar.model import flops as flops_lib
from jaxpar.model.attention import dot_product_attention
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.compiled_memory import memory_analysis_bytes
from jaxpar.training.plan import build_plan
from jaxpar.training.state import abstract_state, init_state
from jaxpar.training.step import make_train_step

_LOGGER = logging.getLogger("jaxpar.analysis.gpu.acceptance")

# The remat policies (`jaxpar.config.choices.REMAT_POLICIES`) in the order they are tried: the first
# `max_candidates` that fit are measured. Likely fastest first: none recomputes nothing; names keeps the attention
# context, so unlike dots (whose saved matmuls exclude the batched attention products) its backward does not re-run
# the attention, the largest recompute at 4096 tokens; full recomputes every block.
REMAT_CANDIDATES = ("none", "names", "dots", "full")
if sorted(REMAT_CANDIDATES) != sorted(REMAT_POLICIES):
    raise ImportError(f"REMAT_CANDIDATES {REMAT_CANDIDATES} is not an order of REMAT_POLICIES {REMAT_POLICIES}")
MEMORY_FRACTION = 0.90  # a candidate fits when its planned peak is at most this share of the device's memory
ATTENTION_TOLERANCE = 2e-2  # max |cuDNN - fp32| / max |fp32| per tensor: a few bf16 roundings (2^-8 each)

GPU_OVERRIDES = [
    "data.seq_len=4096",
    "train.global_batch_size=8",
    "train.grad_accum_steps=1",
    "mesh.data=1",
    "mesh.fsdp=1",
    "optimizer.zero_stage=0",
    "precision.layout=fp32",
    "precision.compute_dtype=bfloat16",
    "model.attention=auto",
]
SMOKE_OVERRIDES = [
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=128",
    "model.vocab_size=512",
    "data.seq_len=64",
    "train.global_batch_size=4",
    "train.grad_accum_steps=1",
    "mesh.data=1",
    "mesh.fsdp=1",
    "optimizer.zero_stage=0",
    "precision.layout=fp32",
    "precision.compute_dtype=float32",
]


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one acceptance run does.

    Attributes:
      config: base config path (its model shape is the one measured).
      overrides: applied on top (shape, batch, precision).
      train_steps: steps of the learning check; warmup_steps: untimed steps before timing; timed_steps: timed.
      max_candidates: remat policies measured (the first that fit, in `REMAT_CANDIDATES` order).
      attention_shape: (B, T, H, G, K) of the attention parity check.
      learning_rate, warmup: AdamW schedule of the learning check (cosine to 10% over `train_steps`).
    """

    config: str
    overrides: tuple[str, ...]
    train_steps: int
    warmup_steps: int
    timed_steps: int
    max_candidates: int
    attention_shape: tuple[int, int, int, int, int]
    learning_rate: float = 3e-4
    warmup: int = 10


def gpu_settings(config: str) -> Settings:
    """The run on one GPU: ~1B Llama, 8 sequences of 4096 tokens per step, 100 learning steps."""
    return Settings(config, tuple(GPU_OVERRIDES), 100, 2, 5, 3, (2, 4096, 32, 8, 128))


def smoke_settings(config: str) -> Settings:
    """The same code path on CPU in seconds: a 2-layer, 64-wide model, 4 x 64 tokens per step."""
    return Settings(config, tuple(SMOKE_OVERRIDES), 30, 1, 2, 2, (2, 128, 4, 2, 16), 3e-3, 3)


def device_info() -> dict:
    """{"device_kind", "platform", "memory_bytes" (None where the backend does not say), "peak_flops" (dense
    bf16, None when unknown), "peak_fp8_flops" (dense FP8, None when unknown or absent)} of the first device."""
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    return {
        "device_kind": dev.device_kind,
        "platform": dev.platform,
        "memory_bytes": stats.get("bytes_limit"),
        "peak_flops": flops_lib.peak_flops(dev.device_kind),
        "peak_fp8_flops": flops_lib.peak_flops(dev.device_kind, table=flops_lib.PEAK_FP8_FLOPS),
    }


def _documents(b: int, t: int, seed: int) -> np.ndarray:
    """Segment ids [b, t]: documents of random lengths (8 to t/4 tokens), numbered from 1 in each row."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((b, t), np.int32)
    for row in range(b):
        pos, doc = 0, 1
        while pos < t:
            n = int(rng.integers(8, max(9, t // 4)))
            ids[row, pos : pos + n] = doc
            pos, doc = pos + n, doc + 1
    return ids


def attention_parity(shape: tuple[int, int, int, int, int], implementations: tuple[str, ...], seed: int = 0) -> dict:
    """Forward and input gradients of causal attention in bf16 against an fp32 XLA reference on the same inputs.

    Args:
      shape: (B, T, H, G, K).
      implementations: which to check (`xla`, `cudnn`).

    Returns:
      {"segments" / "no_segments" / "window_segments" / "window_no_segments": {implementation: {"out", "dq",
      "dk", "dv": max |x - ref| / max |ref|}}} (the window: T/4 keys); the cotangent of the output is a fixed random
      bf16 tensor.
    """
    b, t, h, g, k = shape
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, h, k), jnp.bfloat16)
    kk = jax.random.normal(keys[1], (b, t, g, k), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, g, k), jnp.bfloat16)
    cot = jax.random.normal(keys[3], (b, t, h, k), jnp.bfloat16)
    seg = jnp.asarray(_documents(b, t, seed))
    out = {}
    cases = [(window, docs) for window in (None, t // 4) for docs in ("no_segments", "segments")]
    for window, docs in cases:
        segment_ids = None if docs == "no_segments" else seg
        name = docs if window is None else f"window_{docs}"

        def run(q, kk, v, cot, segment_ids, impl, dtype, window):
            def f(q, kk, v):
                return dot_product_attention(q, kk, v, implementation=impl, segment_ids_BT=segment_ids, window=window)

            args = [x.astype(dtype) for x in (q, kk, v)]
            o, vjp = jax.vjp(f, *args)
            return (o, *vjp(cot.astype(dtype)))

        # the inputs are arguments, not constants the compiler would fold
        run = jax.jit(run, static_argnames=("impl", "dtype", "window"))
        ref = run(q, kk, v, cot, segment_ids, impl="xla", dtype=jnp.float32, window=window)
        row = {}
        for impl in implementations:
            got = run(q, kk, v, cot, segment_ids, impl=impl, dtype=jnp.bfloat16, window=window)
            row[impl] = {
                part: float(jnp.max(jnp.abs(x.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
                for part, x, r in zip(("out", "dq", "dk", "dv"), got, ref)
            }
        out[name] = row
    return out


def resolved(settings: Settings, extra: list[str] | None = None) -> Config:
    """The config of the run with `extra` overrides, resolved for one device."""
    cfg = load_config(settings.config, [*settings.overrides, *(extra or [])], validate=False)
    return resolve_config(cfg, 1)


def planned_peak(cfg: Config, platform: str) -> int:
    """The planner's per-device peak bytes (`jaxpar.analysis.planner.plan`)."""
    return int(analytic_plan(cfg, platform)["memory"]["peak_estimate"])


def _timed_step(plan, warmup_steps: int, timed_steps: int) -> tuple[object, float, float]:
    """(the compiled train step of `plan`, its compile seconds, the median seconds of `timed_steps` steps after
    `warmup_steps` untimed ones) on a random batch and a fresh state (freed before returning)."""
    cfg = plan.cfg
    state = init_state(plan, cfg.train.seed)
    batch = random_batch(
        cfg.train.global_batch_size, cfg.data.seq_len, cfg.model.vocab_size, plan.batch_sharding, cfg.train.seed
    )
    t0 = time.perf_counter()
    compiled = make_train_step(plan).lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(warmup_steps):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(timed_steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    del state
    return compiled, compile_s, float(np.median(times))


def measure_step(cfg: Config, warmup_steps: int, timed_steps: int, peak: float | None) -> tuple[dict, tuple]:
    """Compiles and times the train step of `cfg` on one device with a random batch.

    Returns:
      (record, compiled step): record {"remat", "compile_seconds", "step_seconds" (median of the timed steps),
      "tokens_per_s", "mfu", "hfu" (None without a known peak), "model_flops_per_token",
      "hardware_flops_per_token", "compiled_peak_bytes" (XLA's), "planned_peak_bytes", "planned_ratio" (compiled /
      planned)}.
    """
    plan = build_plan(cfg, build_mesh(cfg, jax.devices()[:1]))
    model_flops, hardware_flops = flops_lib.model_flops(cfg, abstract_state(plan)["params"])
    compiled, compile_s, step_s = _timed_step(plan, warmup_steps, timed_steps)
    tokens_per_s = cfg.train.global_batch_size * cfg.data.seq_len / step_s
    analysis = memory_analysis_bytes(compiled)
    compiled_peak = None if analysis is None else analysis["xla_peak_bytes"] or analysis["peak_bytes"]
    platform = jax.devices()[0].platform
    planned = planned_peak(cfg, "gpu" if platform == "gpu" else "cpu")
    record = {
        "remat": cfg.model.remat,
        "compile_seconds": compile_s,
        "step_seconds": step_s,
        "tokens_per_s": tokens_per_s,
        "mfu": flops_lib.mfu(tokens_per_s, model_flops, 1, peak),
        "hfu": None if hardware_flops is None else flops_lib.mfu(tokens_per_s, hardware_flops, 1, peak),
        "model_flops_per_token": model_flops,
        "hardware_flops_per_token": hardware_flops,
        "compiled_peak_bytes": compiled_peak,
        "planned_peak_bytes": planned,
        "planned_ratio": compiled_peak / planned if compiled_peak and planned else None,
    }
    return record, (plan, compiled)


def text_batches(cfg: Config, steps: int) -> list[dict]:
    """`steps` global batches of real text: the standard library's Python sources, byte-tokenised and packed
    into [global_batch_size, seq_len] windows, in order (`jaxpar.data`); numpy arrays."""
    from jaxpar.data.packing import pack
    from jaxpar.data.sources import load_tokens

    rows = cfg.train.global_batch_size * steps
    need = rows * cfg.data.seq_len + 1
    data = dataclasses.replace(cfg.data, source="stdlib", max_bytes=int(need * 1.2) + 65536)
    train, _ = load_tokens(data)
    windows = pack(train, cfg.data.seq_len)
    n = len(windows["inputs"])
    if n < rows:
        raise RuntimeError(f"the standard library gave {n} windows of {cfg.data.seq_len} tokens, {rows} needed")
    g = cfg.train.global_batch_size
    return [{k: windows[k][i * g : (i + 1) * g] for k in BATCH_KEYS} for i in range(steps)]


def train_on_text(cfg: Config, steps: int) -> dict:
    """Trains `cfg` from its seed for `steps` steps on `text_batches` (one device) and returns {"losses" (per
    step, nats), "first10", "last10" (means), "falls" (last10 < first10 - 0.5 nats), "seconds"}."""
    plan = build_plan(cfg, build_mesh(cfg, jax.devices()[:1]))
    state = init_state(plan, cfg.train.seed)
    step = make_train_step(plan)
    batches = text_batches(cfg, steps)
    losses = []
    t0 = time.perf_counter()
    for batch in batches:
        state, metrics = step(state, {k: jax.device_put(v, plan.batch_sharding) for k, v in batch.items()})
        losses.append(metrics["loss"])
    losses = [float(x) for x in jax.device_get(losses)]
    seconds = time.perf_counter() - t0
    first, last = float(np.mean(losses[:10])), float(np.mean(losses[-10:]))
    return {"losses": losses, "first10": first, "last10": last, "falls": last < first - 0.5, "seconds": seconds}


# The pipeline schedules the acceptance run times against each other on every device of the machine: interleaved
# 1F1B and ZB-V, both with 2 chunks per device (`jaxpar.parallel.pipeline_zb`); and plain 1F1B with the head on the
# last stage against the vocabulary-parallel head (`pipeline.vocab_parallel`). (key, label, overrides)
PIPELINE_SCHEDULES = (
    ("1f1b", "interleaved 1F1B", ("pipeline.schedule=1f1b", "pipeline.virtual_stages=2")),
    ("zb-v", "ZB-V", ("pipeline.schedule=zb-v", "pipeline.virtual_stages=2")),
    ("head_on_last", "1F1B, head on the last stage", ("pipeline.schedule=1f1b", "pipeline.virtual_stages=1")),
    (
        "vocab_parallel",
        "1F1B, vocabulary-parallel head",
        ("pipeline.schedule=1f1b", "pipeline.virtual_stages=1", "pipeline.vocab_parallel=true"),
    ),
)


def pipeline_schedules(settings: Settings, devices: list | None = None) -> dict:
    """Step time of ZB-V against interleaved 1F1B (2 chunks per device each), and of 1F1B with the
    vocabulary-parallel head against the head on the last stage, on mesh pipeline = p, p the largest power of 2 up
    to 8 devices (m = 2p microbatches, 4p layers, the settings' model otherwise), median of the timed steps:
    {"p", "m", "layers", <key of PIPELINE_SCHEDULES>: {"compile_seconds", "step_seconds"}, "zb_v_over_interleaved",
    "vocab_over_last"}; or {"skipped": why} on one device (a pipeline needs two)."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < 2:
        return {"skipped": f"{len(devices)} device: a pipeline needs 2 or more"}
    p = 2 ** min(3, int(np.log2(len(devices))))
    m, layers = 2 * p, 4 * p
    out: dict = {"p": p, "m": m, "layers": layers}
    for key, _, schedule in PIPELINE_SCHEDULES:
        extra = [f"model.n_layers={layers}", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", f"mesh.pipeline={p}"]
        extra += [*schedule, f"pipeline.microbatches={m}"]
        extra += [f"train.global_batch_size={m * max(1, _microbatch_rows(settings))}", "train.grad_accum_steps=1"]
        cfg = resolve_config(load_config(settings.config, [*settings.overrides, *extra], validate=False), p)
        plan = build_plan(cfg, build_mesh(cfg, devices[:p]))
        _, compile_s, step_s = _timed_step(plan, 1, settings.timed_steps)
        out[key] = {"compile_seconds": compile_s, "step_seconds": step_s}
    out["zb_v_over_interleaved"] = out["zb-v"]["step_seconds"] / out["1f1b"]["step_seconds"]
    out["vocab_over_last"] = out["vocab_parallel"]["step_seconds"] / out["head_on_last"]["step_seconds"]
    return out


def dropless_moe(settings: Settings, devices: list | None = None) -> dict:
    """Section 8 (module docstring): {"ep", "experts", "emulated": {"compile_seconds", "step_seconds",
    "tokens_per_s", "loss"}, "ragged": the same or {"skipped": why} off GPUs and TPUs, "ragged_over_emulated"
    (tokens/s ratio, None without both)}; or {"skipped": why} on one device (expert parallelism needs two)."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < 2:
        return {"skipped": f"{len(devices)} device: expert parallelism needs 2 or more"}
    ep = 2 ** min(3, int(np.log2(len(devices))))
    moe = [f"model.moe.num_experts={4 * ep}", "model.moe.top_k=2", "model.moe.routing=dropless"]
    moe += ["model.moe.expert_axes=[data]", f"mesh.data={ep}", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipeline=1"]
    moe += [f"train.global_batch_size={ep * max(1, _microbatch_rows(settings))}", "train.grad_accum_steps=1"]
    out: dict = {"ep": ep, "experts": 4 * ep}
    ragged_ok = devices[0].platform in ("gpu", "tpu")
    for transport in ("emulated", "ragged"):
        if transport == "ragged" and not ragged_ok:
            out[transport] = {"skipped": f"{devices[0].platform} has no ragged all-to-all"}
            continue
        extra = [*moe, f"model.moe.all_to_all={transport}"]
        cfg = resolve_config(load_config(settings.config, [*settings.overrides, *extra], validate=False), ep)
        plan = build_plan(cfg, build_mesh(cfg, devices[:ep]))
        state = init_state(plan, cfg.train.seed)
        batch = random_batch(
            cfg.train.global_batch_size, cfg.data.seq_len, cfg.model.vocab_size, plan.batch_sharding, cfg.train.seed
        )
        _, metrics = make_train_step(plan)(state, batch)
        loss = float(metrics["loss"])
        del state
        _, compile_s, step_s = _timed_step(plan, 1, settings.timed_steps)
        tokens = cfg.train.global_batch_size * cfg.data.seq_len / step_s
        out[transport] = {"compile_seconds": compile_s, "step_seconds": step_s, "tokens_per_s": tokens, "loss": loss}
    both = "tokens_per_s" in out["ragged"]
    out["ragged_over_emulated"] = out["ragged"]["tokens_per_s"] / out["emulated"]["tokens_per_s"] if both else None
    return out


def fp8_check(settings: Settings, best: dict, learning: dict | None, device: dict) -> dict:
    """Section 7: the kept step (`best`, a `measure_step` record) with FP8 GEMMs, and its learning run.

    Returns `measure_step`'s record plus "mfu_fp8_peak" (None without a known FP8 peak), "speedup" (tokens/s over
    bf16's), "gemm_kernels" ({kernel: count} of the compiled step) and, when the bf16 learning run has losses,
    "learning": {"losses", "last10", "bf16_last10", "max_gap" (max |FP8 - bf16| over the steps, nats),
    "final_gap" (last10 - bf16_last10)}.
    """
    from jaxpar.analysis.hlo.gemms import gemm_kernels
    from jaxpar.analysis.hlo.text import compiled_hlo_text

    extra = [f"model.remat={best['remat']}", "precision.fp8.enabled=true"]
    record, (_, compiled) = measure_step(resolved(settings, extra), settings.warmup_steps, settings.timed_steps, None)
    peak, peak_fp8 = device["peak_flops"], device["peak_fp8_flops"]
    model_flops = record["model_flops_per_token"]
    record["mfu"] = flops_lib.mfu(record["tokens_per_s"], model_flops, 1, peak)
    record["mfu_fp8_peak"] = flops_lib.mfu(record["tokens_per_s"], model_flops, 1, peak_fp8)
    record["hfu"] = None
    record["speedup"] = record["tokens_per_s"] / best["tokens_per_s"]
    record["gemm_kernels"] = gemm_kernels(compiled_hlo_text(compiled))
    if learning and "losses" in learning:
        extra += [f"optimizer.learning_rate={settings.learning_rate}", f"optimizer.warmup_steps={settings.warmup}"]
        fp8 = train_on_text(resolved(settings, [*extra, f"train.steps={settings.train_steps}"]), settings.train_steps)
        gaps = [abs(a - b) for a, b in zip(fp8["losses"], learning["losses"])]
        record["learning"] = {
            "losses": fp8["losses"],
            "last10": fp8["last10"],
            "bf16_last10": learning["last10"],
            "max_gap": max(gaps),
            "final_gap": fp8["last10"] - learning["last10"],
            "falls": fp8["falls"],
        }
    return record


def context_kernel_check(on_gpu: bool) -> dict:
    """Section 6 (module docstring): {"parity": `context_kernels.kernel_parity`, "times": `chunk_times`} on a GPU;
    on CPU the decomposition alone at a small shape (cuDNN not run)."""
    if not on_gpu:
        return {"parity": context_kernels.kernel_parity(shape=(2, 64, 4, 2, 16), c=2, kernels=())}
    return {"parity": context_kernels.kernel_parity(), "times": context_kernels.chunk_times()}


def _microbatch_rows(settings: Settings) -> int:
    """Sequences per microbatch of the pipeline comparison: the settings' global batch over 8 (at least 1)."""
    rows = [o for o in settings.overrides if o.startswith("train.global_batch_size=")]
    return max(1, int(rows[-1].split("=")[1]) // 8) if rows else 1


def _section(report: dict, name: str, fn):
    """Runs one part; a failure is recorded (type, message, traceback) and the run goes on."""
    t0 = time.perf_counter()
    try:
        report[name] = fn()
        _LOGGER.info("%s done in %.1f s: %.600s", name, time.perf_counter() - t0, report[name])
    except Exception as e:  # the report must say what failed and still give the other parts
        _LOGGER.exception("%s failed", name)
        report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    report.setdefault("seconds", {})[name] = time.perf_counter() - t0


def run(settings: Settings) -> dict:
    """The whole acceptance run (module docstring); returns the JSON-ready report. Failures of a part are
    reported under its key ("error"), never raised."""
    t_start = time.perf_counter()
    report: dict = {"jax_version": jax.__version__, "settings": dataclasses.asdict(settings)}
    report["device"] = device_info()
    on_gpu = report["device"]["platform"] == "gpu"
    impls = ("xla", "cudnn") if on_gpu else ("xla",)
    _section(report, "attention", lambda: attention_parity(settings.attention_shape, impls))
    peak = report["device"]["peak_flops"]
    limit = report["device"]["memory_bytes"]
    platform = "gpu" if on_gpu else "cpu"
    candidates = []
    for remat in REMAT_CANDIDATES:
        cfg = resolved(settings, [f"model.remat={remat}"])
        if limit is None or planned_peak(cfg, platform) <= MEMORY_FRACTION * limit:
            candidates.append(cfg)
    candidates = candidates[: settings.max_candidates]
    report["candidates"] = [c.model.remat for c in candidates]
    report["remat"] = []
    for cfg in candidates:
        box: dict = {}
        _section(box, "step", lambda cfg=cfg: measure_step(cfg, settings.warmup_steps, settings.timed_steps, peak)[0])
        report["remat"].append(box["step"] if "error" not in box["step"] else {"remat": cfg.model.remat, **box["step"]})
    measured = [r for r in report["remat"] if "tokens_per_s" in r]
    best = max(measured, key=lambda r: r["tokens_per_s"]) if measured else None
    report["best_remat"] = best["remat"] if best else None
    if best:
        extra = [f"model.remat={best['remat']}", f"optimizer.learning_rate={settings.learning_rate}"]
        extra += [f"optimizer.warmup_steps={settings.warmup}", f"train.steps={settings.train_steps}"]
        _section(report, "learning", lambda: train_on_text(resolved(settings, extra), settings.train_steps))
    _section(report, "pipeline_schedules", lambda: pipeline_schedules(settings))
    _section(report, "context_parallel", lambda: context_kernel_check(on_gpu))
    _section(report, "dropless_moe", lambda: dropless_moe(settings))
    if best:
        _section(report, "fp8", lambda: fp8_check(settings, best, report.get("learning"), report["device"]))
    stats = jax.devices()[0].memory_stats() or {}
    report["allocator_peak_bytes"] = stats.get("peak_bytes_in_use")
    report["total_seconds"] = time.perf_counter() - t_start
    report["passed"] = verdict(report)
    return report


def verdict(report: dict) -> dict:
    """{"attention" (every cuDNN error within `ATTENTION_TOLERANCE`; None when cuDNN did not run), "context_parallel"
    (the context-parallel chunk path on cuDNN within it, and the decomposition within 1e-3 of whole-sequence
    attention; None when cuDNN did not run), "learning" (the loss fell), "fp8_learning" (FP8's loss fell too; only
    when section 7 ran), "mfu_at_least_50" (best MFU >= 0.5 on a GPU; None elsewhere)}."""
    out: dict = {"attention": None, "context_parallel": None, "learning": None, "mfu_at_least_50": None}
    context = report.get("context_parallel", {})
    parity = {k: v for k, v in context.get("parity", {}).items() if k != "calls"}
    calls = context.get("parity", {}).get("calls", {})
    if "error" in context:
        out["context_parallel"] = False
    elif any("cudnn" in row for row in parity.values()):
        out["context_parallel"] = all(
            row["decomposition"] <= 1e-3 and all(e <= ATTENTION_TOLERANCE for e in row["cudnn"].values())
            for row in parity.values()
        ) and all(err <= ATTENTION_TOLERANCE for row in calls.values() for k, err in row.items() if k != "lse")
    att = report.get("attention", {})
    if "error" in att:
        out["attention"] = False
    elif any("cudnn" in row for row in att.values()):
        out["attention"] = all(
            err <= ATTENTION_TOLERANCE for row in att.values() for err in row.get("cudnn", {}).values()
        )
    learning = report.get("learning")
    if learning is not None:
        out["learning"] = bool(learning.get("falls", False))
    fp8 = report.get("fp8")
    if fp8 is not None:
        out["fp8_learning"] = "error" not in fp8 and bool(fp8.get("learning", {}).get("falls", False))
    mfus = [r["mfu"] for r in report.get("remat", []) if r.get("mfu") is not None]
    if mfus and report["device"]["platform"] == "gpu":
        out["mfu_at_least_50"] = max(mfus) >= 0.5
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_report(report: dict) -> str:
    """The report as the table the script prints (Markdown)."""
    dev = report["device"]
    peak = dev["peak_flops"]
    lines = [
        f"# GPU acceptance: {dev['device_kind']} ({dev['platform']}), jax {report['jax_version']}",
        "",
        f"memory {human_bytes(dev['memory_bytes'])}; dense bf16 peak "
        f"{'unknown' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}; total {report['total_seconds']:.0f} s",
        "",
        "## Attention: max |x - fp32 reference| / max |reference| (bf16 inputs)",
        "",
        "| documents | implementation | out | dq | dk | dv |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    att = report.get("attention", {})
    if "error" in att:
        lines.append(f"| error | {att['error']} | | | | |")
    else:
        for docs, row in att.items():
            for impl, errs in row.items():
                lines.append(
                    f"| {docs} | {impl} | " + " | ".join(f"{errs[p]:.2e}" for p in ("out", "dq", "dk", "dv")) + " |"
                )
        if not any("cudnn" in row for row in att.values()):
            lines.append("| - | cudnn | not run: no NVIDIA GPU | | | |")
    lines += [
        "",
        "## Train step, one device",
        "",
        "| remat | compile s | step s | tokens/s | MFU | HFU | compiled peak | planned peak | compiled / planned |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report.get("remat", []):
        if "error" in r:
            lines.append(f"| {r['remat']} | error: {r['error']} | | | | | | | |")
            continue
        ratio = "-" if r["planned_ratio"] is None else f"{r['planned_ratio']:.2f}"
        lines.append(
            f"| {r['remat']} | {r['compile_seconds']:.1f} | {r['step_seconds']:.3f} | {r['tokens_per_s']:,.0f} | "
            f"{_pct(r['mfu'])} | {_pct(r['hfu'])} | {human_bytes(r['compiled_peak_bytes'])} | "
            f"{human_bytes(r['planned_peak_bytes'])} | {ratio} |"
        )
    lines += [
        "",
        f"best remat: {report.get('best_remat')}; allocator peak {human_bytes(report.get('allocator_peak_bytes'))}",
    ]
    learning = report.get("learning")
    if learning is not None:
        if "error" in learning:
            lines.append(f"learning: error: {learning['error']}")
        else:
            n = len(learning["losses"])
            lines.append(
                f"learning: {n} steps of real text in {learning['seconds']:.0f} s, loss {learning['losses'][0]:.3f} "
                f"-> {learning['losses'][-1]:.3f} (mean of first 10 {learning['first10']:.3f}, last 10 "
                f"{learning['last10']:.3f})"
            )
    pipe = report.get("pipeline_schedules")
    if pipe is not None:
        if "error" in pipe or "skipped" in pipe:
            lines.append(f"pipeline schedules: {pipe.get('error') or pipe.get('skipped')}")
        else:
            lines.append(
                f"pipeline schedules (p={pipe['p']}, m={pipe['m']}, {pipe['layers']} layers, 2 chunks per device): "
                f"step s interleaved 1F1B {pipe['1f1b']['step_seconds']:.3f}, ZB-V {pipe['zb-v']['step_seconds']:.3f}, "
                f"ZB-V / interleaved {pipe['zb_v_over_interleaved']:.3f}; 1F1B step s head on the last stage "
                f"{pipe['head_on_last']['step_seconds']:.3f}, vocabulary-parallel head "
                f"{pipe['vocab_parallel']['step_seconds']:.3f}, vocabulary-parallel / last "
                f"{pipe['vocab_over_last']:.3f}"
            )
    lines += _context_lines(report.get("context_parallel"))
    lines += _moe_lines(report.get("dropless_moe"))
    lines += _fp8_lines(report.get("fp8"))
    lines.append(f"passed: {report['passed']}")
    return "\n".join(lines)


def _moe_lines(moe: dict | None) -> list[str]:
    """Section 8's line: tokens/s of the ragged and the emulated dispatch, their ratio and first losses."""
    if moe is None:
        return []
    if "error" in moe or "skipped" in moe:
        return [f"dropless MoE: {moe.get('error') or moe.get('skipped')}"]

    def one(name: str) -> str:
        r = moe[name]
        if "tokens_per_s" not in r:
            return f"{name} {r.get('skipped') or r.get('error')}"
        return f"{name} {r['tokens_per_s']:,.0f} tokens/s (loss {r['loss']:.4f})"

    ratio = moe["ragged_over_emulated"]
    return [
        f"dropless MoE (ep={moe['ep']}, {moe['experts']} experts, top-2): {one('ragged')}; {one('emulated')}"
        + (f"; ragged / emulated {ratio:.3f}" if ratio is not None else "")
    ]


def _fp8_lines(fp8: dict | None) -> list[str]:
    """Section 7 of the printed report."""
    if fp8 is None:
        return []
    if "error" in fp8:
        return [f"FP8: error: {fp8['error']}"]
    lines = [
        "",
        f"## FP8 GEMMs (remat {fp8['remat']})",
        "",
        f"step {fp8['step_seconds']:.3f} s, {fp8['tokens_per_s']:,.0f} tokens/s ({fp8['speedup']:.2f}x bf16), MFU "
        f"{_pct(fp8['mfu'])} of the bf16 peak, {_pct(fp8['mfu_fp8_peak'])} of the FP8 peak; compiled peak "
        f"{human_bytes(fp8['compiled_peak_bytes'])}; GEMM kernels {fp8['gemm_kernels']}",
    ]
    learning = fp8.get("learning")
    if learning:
        lines.append(
            f"learning in FP8: last 10 {learning['last10']:.3f} against bf16's {learning['bf16_last10']:.3f} "
            f"(difference {learning['final_gap']:+.3f}; largest per-step |FP8 - bf16| {learning['max_gap']:.3f})"
        )
    return lines


def _context_lines(context: dict | None) -> list[str]:
    """Section 6 of the printed report."""
    if context is None:
        return []
    if "error" in context:
        return [f"context parallelism: error: {context['error']}"]
    lines = ["", "## Context parallelism: a query chunk as two fused-kernel calls (max relative error)", ""]
    lines += [
        "| chunk | decomposition (fp32) | cuDNN out | dq | dk | dv |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for case, row in context["parity"].items():
        if case == "calls":
            continue
        errs = row.get("cudnn")
        cells = " | ".join(f"{errs[p]:.2e}" for p in ("out", "dq", "dk", "dv")) if errs else "not run | | |"
        lines.append(f"| {case} | {row['decomposition']:.2e} | {cells} |")
    for kind, row in context["parity"].get("calls", {}).items():
        lines.append(
            f"| call {kind} | lse {row['lse']:.1e} | "
            + " | ".join(f"{row[p]:.2e}" for p in ("out", "dq", "dk", "dv"))
            + " |"
        )
    times = context.get("times")
    if times:
        lines.append(
            f"chunk times (fwd + bwd, 64k tokens, c = 8): {times['chunk_s'][0] * 1e3:.1f} ms (chunk 0) to "
            f"{times['chunk_s'][-1] * 1e3:.1f} ms (last); busiest device / mean {times['max_over_mean']:.3f}"
        )
    return lines
