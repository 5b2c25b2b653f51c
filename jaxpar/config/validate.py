"""Cross-field checks of a `Config`, run at load before any device work.

Each failure raises `ConfigError` with the dotted key at fault and how to fix it.
"""

from __future__ import annotations

import dataclasses
import math

from jaxpar.config.attention import ATTENTION_IMPLEMENTATIONS
from jaxpar.config.checks import check_between, check_choice, check_not_empty, check_positive
from jaxpar.config.choices import CONTEXT_STRATEGIES, LR_DECAYS, PIPELINE_SCHEDULES, REMAT_POLICIES, ROPE_SCALINGS
from jaxpar.config.data_sources import TEXT_SOURCES, check_data
from jaxpar.config.errors import ConfigError
from jaxpar.config.keys import example
from jaxpar.config.mesh_axes import CONTEXT, DATA, FSDP, PIPELINE, TENSOR
from jaxpar.config.mesh_shape import resolve_mesh_shape
from jaxpar.config.mla import check_mla
from jaxpar.config.moe import check_moe
from jaxpar.config.precision import (
    COMPUTE_DTYPES,
    FLOAT_DTYPES,
    FP8_AMAX_COMPUTE,
    FP8_MAX_HISTORY,
    FP8_SCALINGS,
    LAYOUTS,
)
from jaxpar.config.schema import Config
from jaxpar.config.services import check_distributed, check_metrics

BYTE_VOCAB = 259  # 256 byte values + PAD, BOS, EOS (jaxpar.data.tokenizer)
SEED_RANGE = (-(2**63), 2**63)  # train.seed: a 64-bit integer, as jax's PRNG keys take it


def sequence_parallel(cfg: Config, tensor_size: int) -> bool:
    """`tensor.sequence_parallel`, with null meaning: on whenever the tensor axis is larger than 1."""
    if cfg.tensor.sequence_parallel is None:
        return tensor_size > 1
    return cfg.tensor.sequence_parallel and tensor_size > 1


def validate_config(cfg: Config, num_devices: int | None = None) -> dict[str, int]:
    """Checks ranges and combinations; returns the resolved mesh shape. The checks run section by section, those
    of one section in the order its keys are listed (the first failure is raised).

    Args:
      cfg: the config to check.
      num_devices: total devices of the run; None asks `jax.device_count()`.

    Raises:
      ConfigError: naming the key and the fix.
    """
    _check_model(cfg)
    _check_precision(cfg)
    _check_optimizer(cfg)
    check_data(cfg.data)
    check_positive("data.seq_len", cfg.data.seq_len)
    _check_synthetic(cfg)
    _check_checkpoint_and_train(cfg)
    check_metrics(cfg.metrics)
    check_distributed(cfg.distributed)
    if num_devices is None:
        import jax

        num_devices = jax.device_count()
    shape = resolve_mesh_shape(cfg, num_devices)
    _check_tensor(cfg, shape[TENSOR])
    check_context(cfg, shape[CONTEXT], shape[TENSOR], shape[PIPELINE])
    _check_pipeline(cfg, shape[PIPELINE], shape[TENSOR])
    check_moe(cfg, shape)
    check_mla(cfg, shape)
    _check_state_and_batch(cfg, shape)
    return shape


def _check_synthetic(cfg: Config) -> None:
    """`data.synthetic_branching` against the model's vocabulary (checked whatever the source, as every key)."""
    k, v = cfg.data.synthetic_branching, cfg.model.vocab_size
    if not 0 <= k < v:
        raise ConfigError(
            f"data.synthetic_branching={k} must lie in [0, model.vocab_size={v}): the number of ids that may follow "
            f"each id of the synthetic data (0: uniform independent ids); {example('data.synthetic_branching')}"
        )


def _check_model(cfg: Config) -> None:
    """The `model:` section's ranges, choices and shapes (rotary scaling, heads, head width, vocabulary)."""
    m = cfg.model
    if not m.name.isidentifier():  # whether a family has the name is found when the model is built
        raise ConfigError(
            f"model.name={m.name!r} is not a model family's name, an identifier such as gpt2 (a script registers "
            f"its own with jaxpar.register_model); {example('model.name')}"
        )
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff"):
        check_positive(f"model.{key}", getattr(m, key))
    check_positive("model.rope_theta", m.rope_theta)
    check_choice("model.rope_scaling", m.rope_scaling, ROPE_SCALINGS)
    for key in ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position"):
        check_positive(f"model.{key}", getattr(m, key))  # also where unused: no scaling has a factor <= 0
    if m.rope_scaling == "llama3":
        if m.rope_high_freq_factor <= m.rope_low_freq_factor:
            raise ConfigError(
                f"model.rope_high_freq_factor={m.rope_high_freq_factor} must exceed model.rope_low_freq_factor="
                f"{m.rope_low_freq_factor} for llama3 rotary scaling (Llama 3.x: 4 and 1)"
            )
    check_positive("model.norm_eps", m.norm_eps)
    check_positive("model.init_std", m.init_std)
    check_choice("model.remat", m.remat, REMAT_POLICIES)
    check_choice("model.attention", m.attention, ATTENTION_IMPLEMENTATIONS)
    check_positive("model.max_segments", m.max_segments)
    for key in ("attention_softcap", "final_softcap", "attention_scale_width"):
        value = getattr(m, key)
        if value is not None and (isinstance(value, bool) or not value > 0):
            raise ConfigError(f"model.{key}={value!r} must be > 0, or null (off); {example(f'model.{key}')}")
    if m.attention_softcap is not None and m.attention == "cudnn":
        raise ConfigError(
            f"model.attention_softcap={m.attention_softcap} with model.attention=cudnn: cuDNN's fused attention has "
            f"no soft-capping of the scores; set model.attention=xla (or auto, which picks xla for it)"
        )
    if m.sliding_window is not None and (not isinstance(m.sliding_window, int) or m.sliding_window < 1):
        raise ConfigError(
            f"model.sliding_window={m.sliding_window!r} must be a positive number of tokens (the keys each query "
            f"sees, itself included), or null for full causal attention; {example('model.sliding_window')}"
        )
    if m.n_kv_heads is not None and (m.n_kv_heads <= 0 or m.n_heads % m.n_kv_heads):
        raise ConfigError(
            f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}, or be null (as many as "
            f"model.n_heads); {example('model.n_kv_heads')}"
        )
    if m.head_dim is not None and m.head_dim <= 0:
        raise ConfigError(
            f"model.head_dim={m.head_dim} must be > 0, or null (model.d_model / model.n_heads); "
            f"{example('model.head_dim')}"
        )
    if m.head_dim is None and m.d_model % m.n_heads:
        raise ConfigError(
            f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; change one or set model.head_dim"
        )
    if m.head_width % 2:
        raise ConfigError(f"head width {m.head_width} must be even for rotary embeddings; set model.head_dim")
    if cfg.data.source in TEXT_SOURCES and m.vocab_size < BYTE_VOCAB:
        raise ConfigError(
            f"model.vocab_size={m.vocab_size} is below the byte tokenizer's {BYTE_VOCAB} tokens; "
            f"set model.vocab_size >= {BYTE_VOCAB}"
        )


def _check_precision(cfg: Config) -> None:
    """The `precision:` section's choices (`jaxpar.config.precision`)."""
    p = cfg.precision
    check_choice("precision.compute_dtype", p.compute_dtype, COMPUTE_DTYPES)
    check_choice("precision.layout", p.layout, tuple(LAYOUTS))
    check_choice("precision.reduce_dtype", p.reduce_dtype, FLOAT_DTYPES)
    check_choice("precision.fp8.scaling", p.fp8.scaling, FP8_SCALINGS)
    check_choice("precision.fp8.amax_compute", p.fp8.amax_compute, FP8_AMAX_COMPUTE)
    if not 1 <= p.fp8.amax_history <= FP8_MAX_HISTORY:
        raise ConfigError(
            f"precision.fp8.amax_history={p.fp8.amax_history} must lie in [1, {FP8_MAX_HISTORY}] (the steps of amaxes "
            f"delayed scaling keeps per GEMM operand); {example('precision.fp8.amax_history')}"
        )
    if not 0 <= p.fp8.margin <= 8:
        raise ConfigError(
            f"precision.fp8.margin={p.fp8.margin} must lie in [0, 8] (the scales' headroom is 2^margin, taken from "
            f"the about 15 binary orders of magnitude of E4M3's normal range, 2^-6 to 448); "
            f"{example('precision.fp8.margin')}"
        )


def _check_optimizer(cfg: Config) -> None:
    """The `optimizer:` section's stage, schedule and ranges."""
    o = cfg.optimizer
    if o.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(
            f"optimizer.zero_stage={o.zero_stage} must be 0 (DDP), 1, 2 or 3; {example('optimizer.zero_stage')}"
        )
    check_choice("optimizer.decay", o.decay, LR_DECAYS)
    check_positive("optimizer.learning_rate", o.learning_rate)
    check_positive("optimizer.eps", o.eps)  # Adam's denominator term: 0 divides by zero where a moment is 0
    check_positive("optimizer.warmup_steps", o.warmup_steps, allow_zero=True)
    check_positive("optimizer.weight_decay", o.weight_decay, allow_zero=True)
    for i, pattern in enumerate(o.weight_decay_exclude):  # what each matches is checked against the model's names
        if not pattern.strip():
            raise ConfigError(
                f"optimizer.weight_decay_exclude[{i}] is empty; give fnmatch patterns of parameter names, "
                f"{example('optimizer.weight_decay_exclude')}"
            )
    check_positive("optimizer.grad_clip_norm", o.grad_clip_norm, allow_zero=True)
    check_between("optimizer.min_lr_ratio", o.min_lr_ratio, 0, 1)
    check_between("optimizer.b1", o.b1, 0, 1, high_open=True)
    check_between("optimizer.b2", o.b2, 0, 1, high_open=True)


def _check_checkpoint_and_train(cfg: Config) -> None:
    """The `checkpoint:` and `train:` sections: counts and intervals in range. (`checkpoint.restore_from` is
    checked by the run before any device work, where it seeds one: `jaxpar.training.start_state`.)"""
    c, t = cfg.checkpoint, cfg.train
    check_positive("checkpoint.every_steps", c.every_steps, allow_zero=True)
    check_positive("checkpoint.keep", c.keep)
    check_not_empty("train.run_dir", t.run_dir, "the directory for the run's config, metrics and checkpoints")
    if not SEED_RANGE[0] <= t.seed < SEED_RANGE[1]:
        raise ConfigError(f"train.seed={t.seed} must be a 64-bit integer, in [-2**63, 2**63); {example('train.seed')}")
    for key in ("steps", "global_batch_size", "grad_accum_steps", "log_every", "max_bad_steps"):
        check_positive(f"train.{key}", getattr(t, key))
    check_positive("train.eval_batches", t.eval_batches, allow_zero=True)  # 0: the whole validation split
    check_positive("train.eval_every", t.eval_every, allow_zero=True)
    check_positive("train.peak_flops_per_device", t.peak_flops_per_device, allow_zero=True)
    check_positive("train.peak_fp8_flops_per_device", t.peak_fp8_flops_per_device, allow_zero=True)
    check_positive("train.sample_tokens", t.sample_tokens, allow_zero=True)
    check_positive("train.divergence_rollbacks", t.divergence_rollbacks, allow_zero=True)
    check_positive("train.watchdog_s", t.watchdog_s, allow_zero=True)


def _check_tensor(cfg: Config, tp: int) -> None:
    """With `mesh.tensor` = `tp` > 1: heads, MLP width and vocabulary split over it, and the sequence too under
    sequence parallelism."""
    if tp == 1:
        return
    m = cfg.model
    for key, value in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.kv_heads), ("model.d_ff", m.d_ff)):
        if value % tp:
            hint = (
                " (grouped-query attention needs at least one key/value head per tensor rank)"
                if key == "model.n_kv_heads"
                else ""
            )
            raise ConfigError(
                f"{key}={value} must be divisible by mesh.tensor={tp}{hint}; lower mesh.tensor or change {key}"
            )
    if m.vocab_size % tp:
        raise ConfigError(
            f"model.vocab_size={m.vocab_size} must be divisible by mesh.tensor={tp} (the "
            f"vocabulary is sharded over tensor); round it up, e.g. model.vocab_size="
            f"{-(-m.vocab_size // tp) * tp}"
        )
    if sequence_parallel(cfg, tp) and cfg.data.seq_len % tp:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} must be divisible by mesh.tensor={tp} with sequence "
            f"parallelism; change data.seq_len or set tensor.sequence_parallel=false"
        )


def context_multiple(c: int, tp: int, sp: bool) -> int:
    """What data.seq_len must divide by with `mesh.context` = c: 2c for the load-balanced layout's 2c chunks
    (`jaxpar.parallel.context`), and each device's T/c tokens by `mesh.tensor` = tp under sequence parallelism."""
    return math.lcm(2 * c, c * tp) if sp else 2 * c


def check_context(cfg: Config, c: int, tp: int, stages: int) -> None:
    """The `context:` section on `c` = mesh.context devices: the strategy, a sequence that splits into the
    load-balanced layout's 2c chunks (and each device's slice over tensor under sequence parallelism), and ring
    attention outside the zero-bubble schedules.

    Why not ring under zb-h1 / zb-v: those run each stage's own op in a `lax.switch`, so at one slot the devices of
    one stage run a ring's forward permutes while another stage's run its backward's. A collective permute's
    participants are the whole program, not its source-target pairs (XLA:CPU's rendezvous waits for every device:
    measured, two stages' different permutes deadlock or exchange each other's blocks), while the all-gather's are
    its replica group, the stage's own context devices."""
    check_choice("context.strategy", cfg.context.strategy, CONTEXT_STRATEGIES)
    if c == 1:
        return
    for key, what in (
        ("sliding_window", "a window"),
        ("attention_softcap", "soft-capped scores"),
        ("attention_scale_width", "another score scale"),
    ):
        value = getattr(cfg.model, key)
        if value is not None:
            raise ConfigError(
                f"model.{key}={value} with mesh.context={c}: context parallelism's attention (both strategies) "
                f"computes plain causal attention scaled by the head width and cannot honour {what}; set "
                f"mesh.context=1, or model.{key}=null if the model was trained without it"
            )
    schedule = cfg.pipeline.schedule
    if cfg.context.strategy == "ring" and stages > 1 and schedule.startswith("zb"):
        raise ConfigError(
            f"context.strategy=ring with pipeline.schedule={schedule}: the zero-bubble schedules run a different op "
            f"on each stage, and the ring's permutes cannot run inside them (their participants are every device); "
            f"use context.strategy=all_gather, or pipeline.schedule=1f1b or gpipe"
        )
    t, sp = cfg.data.seq_len, sequence_parallel(cfg, tp)
    multiple = context_multiple(c, tp, sp)
    if t % multiple:
        lower, upper = t // multiple * multiple, -(-t // multiple) * multiple
        lengths = " or ".join(f"data.seq_len={n}" for n in (lower, upper) if n > 0)
        sizes = [k for k in range(1, c + 1) if t % context_multiple(k, tp, sp) == 0 and k > 1]
        fits = f", or a mesh.context that fits it: {', '.join(map(str, sizes))}" if sizes else ""
        why = f"2 * mesh.context = {2 * c} (the load-balanced layout's chunks)"
        if multiple != 2 * c:
            why += f" and by mesh.context * mesh.tensor = {c * tp} (sequence parallelism splits each slice)"
        raise ConfigError(f"data.seq_len={t} must be divisible by {why}; use {lengths}{fits}")


def _check_pipeline(cfg: Config, stages: int, tp: int) -> None:
    """The `pipeline:` section on `stages` = mesh.pipeline stages: the schedule, equal-depth stages, and
    interleaving's constraints (`_virtual_stages`)."""
    check_choice("pipeline.schedule", cfg.pipeline.schedule, PIPELINE_SCHEDULES)
    check_positive("pipeline.microbatches", cfg.pipeline.microbatches)
    uneven = uneven_split(cfg)
    if cfg.model.stacked_layers % stages and not uneven:
        raise ConfigError(
            f"{_stacked(cfg)} must be divisible by mesh.pipeline={stages} for the even split; set "
            f"pipeline.balance_stages=true (or give pipeline.stage_layers) to run the stages unevenly, or change "
            f"model.n_layers or mesh.pipeline"
        )
    fp8 = cfg.precision.fp8
    if uneven and cfg.model.stack_depth % stages and fp8.enabled and fp8.scaling == "delayed":
        raise ConfigError(
            f"precision.fp8.scaling=delayed with {_stacked(cfg)} layers over mesh.pipeline={stages} stages, which "
            f"do not divide them: the amax history is stored evenly over the stages; set "
            f"precision.fp8.scaling=current, or a depth the stages divide"
        )
    _pairs(cfg, stages)
    _virtual_stages(cfg, stages)
    _stage_layers(cfg, stages)
    _vocab_parallel(cfg, stages, tp)


def _stacked(cfg: Config) -> str:
    """The layer stack's depth in blocks as a message names it: model.n_layers, or with `model.moe.first_dense`
    dense blocks before the stack, the difference."""
    m = cfg.model
    if not m.first_dense:
        return f"model.n_layers={m.n_layers}"
    return f"model.n_layers - model.moe.first_dense = {m.n_layers} - {m.first_dense} = {m.stacked_layers}"


def _pairs(cfg: Config, stages: int) -> None:
    """A dense stack whose unit is several layers (`ModelConfig.layers_per_unit`: gemma2's local and global pair)
    holds whole units on every stage (MoE groups are checked by `jaxpar.config.moe`)."""
    m, unit = cfg.model, cfg.model.layers_per_unit
    if m.moe.enabled or unit == 1:
        return
    if m.n_layers % unit:
        raise ConfigError(
            f"model.n_layers={m.n_layers} must be a multiple of {unit} for model.name={m.name} (its layers alternate "
            f"local and global attention, stacked as pairs); change model.n_layers"
        )
    # an uneven split's counts are checked there, and it stores the stack with zero rows where p does not divide it
    v = cfg.pipeline.virtual_stages
    if stages > 1 and not uneven_split(cfg) and m.stack_depth % (stages * v):
        raise ConfigError(
            f"model.n_layers / {unit} = {m.stack_depth} units of {m.name}'s stack (each a local and a global layer) "
            f"must be divisible by mesh.pipeline * pipeline.virtual_stages = {stages} * {v} = {stages * v} (each "
            f"stage holds whole units); change mesh.pipeline or pipeline.virtual_stages, or give "
            f"pipeline.stage_layers or pipeline.balance_stages=true"
        )


def _vocab_parallel(cfg: Config, stages: int, tp: int) -> None:
    """pipeline.vocab_parallel: a 1F1B pipeline whose tensor shard of the vocabulary splits over the stages."""
    pipe = cfg.pipeline
    if not pipe.vocab_parallel:
        return
    key = "pipeline.vocab_parallel"
    if stages == 1:
        raise ConfigError(f"{key} splits the head over pipeline stages: it needs mesh.pipeline > 1; {example(key)}")
    if pipe.schedule != "1f1b" or pipe.virtual_stages != 1:
        raise ConfigError(
            f"{key} runs with pipeline.schedule=1f1b and pipeline.virtual_stages=1 (got {pipe.schedule}, "
            f"{pipe.virtual_stages}); set those, or {example(key)}"
        )
    if cfg.model.vocab_size % (tp * stages):
        size = -(-cfg.model.vocab_size // (tp * stages)) * tp * stages
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} must be divisible by mesh.tensor * mesh.pipeline = "
            f"{tp} * {stages} with {key} (each stage computes an equal slice of the vocabulary); round it up, e.g. "
            f"model.vocab_size={size}, or {example(key)}"
        )


def uneven_split(cfg: Config) -> bool:
    """Whether the config asks for a split other than the even one (`pipeline.stage_layers` or
    `pipeline.balance_stages`)."""
    return bool(cfg.pipeline.stage_layers) or cfg.pipeline.balance_stages


def _stage_layers(cfg: Config, stages: int) -> None:
    """pipeline.stage_layers and pipeline.balance_stages: one count per model chunk, adding up to the model."""
    pipe, n = cfg.pipeline, cfg.model.stacked_layers
    if not uneven_split(cfg):
        return
    key = "pipeline.stage_layers" if pipe.stage_layers else "pipeline.balance_stages"
    if stages == 1:
        raise ConfigError(
            f"{key} splits the layers over pipeline stages: it needs mesh.pipeline > 1; set mesh.pipeline or unset "
            f"it, {example(key)}"
        )
    if pipe.stage_layers and pipe.balance_stages:
        raise ConfigError(
            "pipeline.stage_layers and pipeline.balance_stages both choose the split; set one (balance_stages "
            "picks the counts itself)"
        )
    chunks = stages * pipe.virtual_stages
    every = cfg.model.layers_per_unit
    if n // every < chunks and pipe.balance_stages:
        kind = f"MoE unit (model.moe.every={every} layers)" if cfg.model.moe.enabled else f"unit ({every} layers)"
        what = kind if every > 1 else "layer"
        raise ConfigError(
            f"pipeline.balance_stages gives each of the {chunks} model chunks at least one {what}, and the model "
            f"has {n // every}; set pipeline.stage_layers, or lower mesh.pipeline or pipeline.virtual_stages"
        )
    if not pipe.stage_layers:
        return
    counts = pipe.stage_layers
    even = [n // chunks] * chunks if n % chunks == 0 else None
    hint = f" (the even split is {even})" if even else ""
    if any(c < 0 for c in counts):
        raise ConfigError(
            f"pipeline.stage_layers={list(counts)} has a negative count; give each model chunk 0 layers or more{hint}"
        )
    if len(counts) != chunks:
        what = f"mesh.pipeline={stages}" + (
            f" * pipeline.virtual_stages={pipe.virtual_stages}" if pipe.virtual_stages > 1 else ""
        )
        raise ConfigError(
            f"pipeline.stage_layers={list(counts)} has {len(counts)} {'entry' if len(counts) == 1 else 'entries'}; "
            f"it needs one per model chunk, "
            f"{what} = {chunks}{hint}"
        )
    if any(c < 0 or c % every for c in counts) or sum(counts) != n:
        what = f"model.moe.every={every}" if cfg.model.moe.enabled else f"{every} ({cfg.model.name}'s stack unit)"
        unit = f", each a multiple of {what}" if every > 1 else ""
        raise ConfigError(
            f"pipeline.stage_layers={list(counts)} must be counts of at least 0{unit} adding up to "
            f"{_stacked(cfg)} (they add up to {sum(counts)}){hint}"
        )


def _check_state_and_batch(cfg: Config, shape: dict[str, int]) -> None:
    """The state's embed dimension splits over its storage axes, and the global batch over replicas, accumulation
    steps and pipeline microbatches."""
    o, t = cfg.optimizer, cfg.train
    # Parameters, gradients and optimizer state are sharded along the embed dimension over fsdp, and over
    # data too for the ZeRO stages that partition something (jaxpar.parallel.sharding).
    state_shards = shape[FSDP] * (shape[DATA] if o.zero_stage >= 1 else 1)
    if cfg.model.d_model % state_shards:
        what = "mesh.fsdp" if o.zero_stage == 0 else "mesh.fsdp * mesh.data"
        raise ConfigError(
            f"model.d_model={cfg.model.d_model} must be divisible by {what}={state_shards} (state is sharded along "
            f"the embed dimension); change the mesh, model.d_model or optimizer.zero_stage"
        )
    replicas = shape[DATA] * shape[FSDP]
    splits = replicas * t.grad_accum_steps * cfg.pipeline.microbatches
    if t.global_batch_size % splits:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must be divisible by mesh.data*mesh.fsdp "
            f"({replicas}) times train.grad_accum_steps ({t.grad_accum_steps}) times pipeline.microbatches "
            f"({cfg.pipeline.microbatches}) = {splits}; change the batch size, the accumulation steps or the "
            f"microbatches"
        )


def resolve_config(cfg: Config, num_devices: int) -> Config:
    """`cfg` with every derived value made concrete: mesh sizes (no -1), `model.n_kv_heads`, `model.head_dim`
    and `tensor.sequence_parallel`. This is the config saved beside a run.

    Raises:
      ConfigError: as `validate_config`.
    """
    shape = validate_config(cfg, num_devices)
    m = cfg.model
    return dataclasses.replace(
        cfg,
        mesh=dataclasses.replace(cfg.mesh, **shape),
        model=dataclasses.replace(m, n_kv_heads=m.kv_heads, head_dim=m.head_width),
        tensor=dataclasses.replace(cfg.tensor, sequence_parallel=sequence_parallel(cfg, shape[TENSOR])),
    )


def _virtual_stages(cfg: Config, stages: int) -> None:
    """pipeline.virtual_stages: interleaving's constraints (`jaxpar.parallel.schedule`) and the V's of zb-v
    (`jaxpar.parallel.zero_bubble`)."""
    v, pipe = cfg.pipeline.virtual_stages, cfg.pipeline
    check_positive("pipeline.virtual_stages", v)
    if pipe.schedule == "zb-v" and (stages == 1 or v != 2):
        missing = ([f"mesh.pipeline > 1 (got {stages})"] if stages == 1 else []) + (
            [f"pipeline.virtual_stages=2 (got {v})"] if v != 2 else []
        )
        raise ConfigError(
            f"pipeline.schedule=zb-v runs two model chunks per device in a V: it needs {' and '.join(missing)}; "
            f"set {'them' if len(missing) > 1 else 'it'}, or pipeline.schedule=zb-h1"
        )
    if v == 1:
        return
    if stages == 1:
        raise ConfigError(
            f"pipeline.virtual_stages={v} needs a pipeline (mesh.pipeline > 1); set mesh.pipeline or "
            f"pipeline.virtual_stages=1"
        )
    if pipe.schedule == "gpipe":
        raise ConfigError(
            f"pipeline.virtual_stages={v} interleaves the 1f1b, zb-h1 and zb-v schedules, not {pipe.schedule}; set "
            f"pipeline.schedule=1f1b or pipeline.virtual_stages=1"
        )
    chunks = stages * v
    if cfg.model.stacked_layers % chunks and not uneven_split(cfg):
        raise ConfigError(
            f"{_stacked(cfg)} must be divisible by mesh.pipeline * pipeline.virtual_stages = "
            f"{stages} * {v} = {chunks} (model chunks of equal depth); change model.n_layers, mesh.pipeline or "
            f"pipeline.virtual_stages, or give the chunks' depths in pipeline.stage_layers"
        )
    if pipe.microbatches % stages and pipe.schedule != "zb-v":
        m = pipe.microbatches
        below, above = m - m % stages, m - m % stages + stages
        raise ConfigError(
            f"pipeline.microbatches={m} must be a multiple of mesh.pipeline={stages} with "
            f"pipeline.virtual_stages={v} and pipeline.schedule={pipe.schedule} (interleaving runs microbatches "
            "in groups of one per stage); use " + (f"{below} or {above}" if below else f"{above}")
        )
