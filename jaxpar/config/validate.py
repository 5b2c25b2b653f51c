"""Cross-field checks of a `Config`, run at load before any device work.

Each failure raises `ConfigError` with the dotted key at fault and how to fix it.
"""

from __future__ import annotations

import dataclasses
import os

from jaxpar.config.attention import ATTENTION_IMPLEMENTATIONS
from jaxpar.config.choices import LR_DECAYS, PIPELINE_SCHEDULES, REMAT_POLICIES, ROPE_SCALINGS, WANDB_MODES
from jaxpar.config.data_sources import GENERATED_SOURCES, TEXT_SOURCES, check_data, source_configs
from jaxpar.config.errors import ConfigError
from jaxpar.config.extras import WANDB_FEATURE, installed, missing_message
from jaxpar.config.mesh_axes import DATA, FSDP, PIPELINE, TENSOR, mesh_sizes
from jaxpar.config.moe import check_moe
from jaxpar.config.precision import COMPUTE_DTYPES, FLOAT_DTYPES, LAYOUTS
from jaxpar.config.schema import Config

BYTE_VOCAB = 259  # 256 byte values + PAD, BOS, EOS (jaxpar.data.tokenizer)


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value != value or value in (float("inf"), float("-inf")):  # NaN compares false with everything
        raise ConfigError(f"{key}={value} must be a finite number")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


def _cpu_hint(num_devices: int) -> str:
    if num_devices != 1:
        return ""
    return (
        "; on a machine without accelerators, simulate devices with --cpu-devices N (JAX_NUM_CPU_DEVICES=N) "
        "or use --devices N with jaxpar-plan"
    )


def sequence_parallel(cfg: Config, tensor_size: int) -> bool:
    """`tensor.sequence_parallel`, with null meaning: on whenever the tensor axis is larger than 1."""
    if cfg.tensor.sequence_parallel is None:
        return tensor_size > 1
    return cfg.tensor.sequence_parallel and tensor_size > 1


def resolve_mesh_shape(cfg: Config, num_devices: int) -> dict[str, int]:
    """Returns {axis: size} for data, fsdp, tensor, pipeline with any -1 filled in.

    Raises:
      ConfigError: a device count below 1, more than one -1, a size below -1 or 0, or a product that does not
        equal `num_devices`.
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ConfigError(
            f"device count {num_devices!r}: a mesh needs at least 1 device; give a positive device "
            f"count (e.g. --devices 8)"
        )
    sizes = mesh_sizes(cfg.mesh)
    fill = [a for a, s in sizes.items() if s == -1]
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}={size}: a mesh axis size is a positive integer, or -1 to fill")
    if len(fill) > 1:
        raise ConfigError(f"mesh: only one axis may be -1, got {', '.join('mesh.' + a for a in fill)}")
    fixed = 1
    for size in sizes.values():
        if size != -1:
            fixed *= size
    if fill:
        if num_devices % fixed:
            raise ConfigError(
                f"mesh.{fill[0]}=-1 cannot fill {num_devices} devices: the other axes multiply to {fixed}, "
                f"which does not divide {num_devices}; change the other mesh sizes{_cpu_hint(num_devices)}"
            )
        sizes[fill[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ConfigError(
            f"mesh: data*fsdp*tensor*pipeline = {' * '.join(str(v) for v in sizes.values())} = {fixed} but "
            f"there are {num_devices} devices; make the product equal the device count (or set "
            f"one axis to -1 and the others so that they divide it, e.g. mesh.fsdp=-1){_cpu_hint(num_devices)}"
        )
    return sizes


def _wandb_goes_online(mode: str) -> bool:
    """Whether a W&B run in `mode` streams: "online", or "" with WANDB_MODE unset or online."""
    if mode == "":
        mode = os.environ.get("WANDB_MODE", "online")
    return mode in ("online", "run")


def _wandb_api_key() -> bool:
    """Whether W&B has an API key here: WANDB_API_KEY, or an api.wandb.ai entry in the netrc file that `wandb
    login` writes (NETRC or ~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def _check_metrics(cfg: Config) -> None:
    mc = cfg.metrics
    if mc.wandb_mode not in WANDB_MODES:
        raise ConfigError(
            f"metrics.wandb_mode={mc.wandb_mode!r} must be one of {', '.join(repr(m) for m in WANDB_MODES)}"
        )
    if mc.wandb and not installed("wandb"):
        raise ConfigError(missing_message("wandb", WANDB_FEATURE, instead="set metrics.wandb=false"))
    if mc.wandb and _wandb_goes_online(mc.wandb_mode) and not _wandb_api_key():
        raise ConfigError(
            f"metrics.wandb=true with metrics.wandb_mode={mc.wandb_mode!r} streams to Weights & "
            "Biases, but no API key is configured (WANDB_API_KEY, or `wandb login`); log in, or set "
            "metrics.wandb_mode=offline (upload later with `wandb sync`)"
        )
    if mc.wandb and not mc.wandb_project.strip():
        raise ConfigError("metrics.wandb_project is empty; name the W&B project, e.g. metrics.wandb_project=jaxpar")


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
    _positive("data.seq_len", cfg.data.seq_len)
    _check_synthetic(cfg)
    _check_checkpoint_and_train(cfg)
    _check_metrics(cfg)
    if num_devices is None:
        import jax

        num_devices = jax.device_count()
    shape = resolve_mesh_shape(cfg, num_devices)
    _check_tensor(cfg, shape[TENSOR])
    _check_pipeline(cfg, shape[PIPELINE])
    check_moe(cfg, shape)
    _check_state_and_batch(cfg, shape)
    return shape


def _check_synthetic(cfg: Config) -> None:
    """`data.synthetic_branching` against the model's vocabulary, when a source is `synthetic`."""
    d = cfg.data
    kinds = {sd.source for _, _, sd in source_configs(d)} if d.sources else {d.source}
    k, v = d.synthetic_branching, cfg.model.vocab_size
    if kinds & set(GENERATED_SOURCES) and not 0 <= k < v:
        raise ConfigError(
            f"data.synthetic_branching={k} must lie in [0, model.vocab_size={v}): the number of ids that may follow "
            f"each id of the synthetic data (0: uniform independent ids)"
        )


def _check_model(cfg: Config) -> None:
    """The `model:` section's ranges, choices and shapes (rotary scaling, heads, head width, vocabulary)."""
    m = cfg.model
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff"):
        _positive(f"model.{key}", getattr(m, key))
    _positive("model.rope_theta", m.rope_theta)
    _choice("model.rope_scaling", m.rope_scaling, ROPE_SCALINGS)
    if m.rope_scaling != "none":
        _positive("model.rope_scaling_factor", m.rope_scaling_factor)
    if m.rope_scaling == "llama3":
        _positive("model.rope_low_freq_factor", m.rope_low_freq_factor)
        _positive("model.rope_original_max_position", m.rope_original_max_position)
        if m.rope_high_freq_factor <= m.rope_low_freq_factor:
            raise ConfigError(
                f"model.rope_high_freq_factor={m.rope_high_freq_factor} must exceed model.rope_low_freq_factor="
                f"{m.rope_low_freq_factor} for llama3 rotary scaling (Llama 3.x: 4 and 1)"
            )
    _positive("model.norm_eps", m.norm_eps)
    _positive("model.init_std", m.init_std)
    _choice("model.remat", m.remat, REMAT_POLICIES)
    _choice("model.attention", m.attention, ATTENTION_IMPLEMENTATIONS)
    _positive("model.max_segments", m.max_segments)
    if m.n_kv_heads is not None and (m.n_kv_heads <= 0 or m.n_heads % m.n_kv_heads):
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}")
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
    _choice("precision.compute_dtype", p.compute_dtype, COMPUTE_DTYPES)
    _choice("precision.layout", p.layout, tuple(LAYOUTS))
    _choice("precision.reduce_dtype", p.reduce_dtype, FLOAT_DTYPES)


def _check_optimizer(cfg: Config) -> None:
    """The `optimizer:` section's stage, schedule and ranges."""
    o = cfg.optimizer
    if o.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"optimizer.zero_stage={o.zero_stage} must be 0 (DDP), 1, 2 or 3")
    _choice("optimizer.decay", o.decay, LR_DECAYS)
    _positive("optimizer.learning_rate", o.learning_rate)
    _positive("optimizer.eps", o.eps)  # Adam's denominator term: 0 divides by zero where a moment is 0
    _positive("optimizer.warmup_steps", o.warmup_steps, allow_zero=True)
    _positive("optimizer.weight_decay", o.weight_decay, allow_zero=True)
    _positive("optimizer.grad_clip_norm", o.grad_clip_norm, allow_zero=True)
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optimizer.min_lr_ratio={o.min_lr_ratio} must lie in [0, 1]")
    for key, value in (("optimizer.b1", o.b1), ("optimizer.b2", o.b2)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{key}={value} must lie in [0, 1)")


def _check_checkpoint_and_train(cfg: Config) -> None:
    """The `checkpoint:` and `train:` sections: the restore path exists, counts and intervals in range."""
    c, t = cfg.checkpoint, cfg.train
    if c.restore_from and not os.path.isdir(c.restore_from):
        raise ConfigError(
            f"checkpoint.restore_from={c.restore_from!r} (--restore-from) is not a directory; give a "
            f"run directory, its checkpoints/ directory or one of its step directories"
        )
    _positive("checkpoint.every_steps", c.every_steps, allow_zero=True)
    _positive("checkpoint.keep", c.keep)
    if not t.run_dir.strip():
        raise ConfigError(
            "train.run_dir is empty; name the directory for the run's config, metrics and "
            "checkpoints, e.g. train.run_dir=runs/tiny"
        )
    for key in ("steps", "global_batch_size", "grad_accum_steps", "log_every", "max_bad_steps"):
        _positive(f"train.{key}", getattr(t, key))
    _positive("train.eval_batches", t.eval_batches, allow_zero=True)  # 0: the whole validation split
    _positive("train.eval_every", t.eval_every, allow_zero=True)
    _positive("train.peak_flops_per_device", t.peak_flops_per_device, allow_zero=True)
    _positive("train.sample_tokens", t.sample_tokens, allow_zero=True)
    _positive("train.divergence_rollbacks", t.divergence_rollbacks, allow_zero=True)
    _positive("train.watchdog_s", t.watchdog_s, allow_zero=True)


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


def _check_pipeline(cfg: Config, stages: int) -> None:
    """The `pipeline:` section on `stages` = mesh.pipeline stages: the schedule, equal-depth stages, and
    interleaving's constraints (`_virtual_stages`)."""
    _choice("pipeline.schedule", cfg.pipeline.schedule, PIPELINE_SCHEDULES)
    _positive("pipeline.microbatches", cfg.pipeline.microbatches)
    if cfg.model.n_layers % stages:
        raise ConfigError(
            f"model.n_layers={cfg.model.n_layers} must be divisible by mesh.pipeline={stages} (stages of "
            f"equal depth); change model.n_layers or mesh.pipeline"
        )
    _virtual_stages(cfg, stages)


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
    """pipeline.virtual_stages: interleaved 1F1B's constraints (`jaxpar.parallel.schedule`)."""
    v, pipe = cfg.pipeline.virtual_stages, cfg.pipeline
    _positive("pipeline.virtual_stages", v)
    if v == 1:
        return
    if stages == 1:
        raise ConfigError(
            f"pipeline.virtual_stages={v} needs a pipeline (mesh.pipeline > 1); set mesh.pipeline or "
            f"pipeline.virtual_stages=1"
        )
    if pipe.schedule != "1f1b":
        raise ConfigError(
            f"pipeline.virtual_stages={v} interleaves the 1f1b schedule, not {pipe.schedule}; set "
            f"pipeline.schedule=1f1b or pipeline.virtual_stages=1"
        )
    chunks = stages * v
    if cfg.model.n_layers % chunks:
        raise ConfigError(
            f"model.n_layers={cfg.model.n_layers} must be divisible by mesh.pipeline * pipeline.virtual_stages = "
            f"{stages} * {v} = {chunks} (model chunks of equal depth); change model.n_layers, mesh.pipeline or "
            f"pipeline.virtual_stages"
        )
    if pipe.microbatches % stages:
        m = pipe.microbatches
        below, above = m - m % stages, m - m % stages + stages
        raise ConfigError(
            f"pipeline.microbatches={m} must be a multiple of mesh.pipeline={stages} with "
            f"pipeline.virtual_stages={v} (interleaved 1F1B runs microbatches in groups of one per stage); use "
            + (f"{below} or {above}" if below else f"{above}")
        )
