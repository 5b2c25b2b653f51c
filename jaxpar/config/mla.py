"""Checks of the Multi-head Latent Attention keys of `model:` (`kv_lora_rank`, `q_lora_rank`, `qk_nope_head_dim`,
`qk_rope_head_dim`, `v_head_dim`; `jaxpar.model.mla`) against the rest of the config and the resolved mesh. Called
by `jaxpar.config.validate.validate_config`. No jax."""

from __future__ import annotations

import logging

from jaxpar.config.attention import CUDNN_MAX_HEAD_DIM_HOPPER
from jaxpar.config.errors import ConfigError
from jaxpar.config.keys import example
from jaxpar.config.mesh_axes import CONTEXT, DATA, FSDP
from jaxpar.config.schema import Config

log = logging.getLogger(__name__)

MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def check_mla(cfg: Config, shape: dict[str, int]) -> None:
    """Ranges of the MLA keys, and MLA against the mesh and the other sections.

    Args:
      cfg: the config.
      shape: the resolved mesh shape {data, fsdp, tensor, pipeline, context}.

    Raises:
      ConfigError: a key not > 0 (or null), an odd qk_rope_head_dim; with `model.kv_lora_rank` set: an
        `n_kv_heads` other than n_heads, `mesh.context` > 1 or `precision.fp8.enabled` (not supported with MLA),
        latent widths that the parameters' storage axes (fsdp, and data from ZeRO-1 on) do not divide, or
        `model.attention=cudnn` with a kernel width max(N + R, E) cuDNN does not take; the message names the fix.
    """
    m = cfg.model
    for key in MLA_KEYS:
        value = getattr(m, key)
        if value is not None and (isinstance(value, bool) or not value > 0):
            raise ConfigError(f"model.{key}={value!r} must be > 0, or null; {example(f'model.{key}')}")
    if m.qk_rope_head_dim is not None and m.qk_rope_head_dim % 2:
        raise ConfigError(
            f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even (rotary embedding rotates pairs); "
            f"{example('model.qk_rope_head_dim')}"
        )
    if not m.mla:
        unused = [k for k in MLA_KEYS if getattr(m, k) is not None]
        if unused:
            log.warning("model.%s have no effect without model.kv_lora_rank (MLA off)", ", model.".join(unused))
        return
    nope, rope, value = m.mla_widths
    if rope % 2:
        raise ConfigError(
            f"MLA's rotary width, model.qk_rope_head_dim=null (head width {m.head_width} / 2 = {rope}), must be even; "
            f"{example('model.qk_rope_head_dim')}"
        )
    if m.n_kv_heads is not None and m.n_kv_heads != m.n_heads:
        raise ConfigError(
            f"model.n_kv_heads={m.n_kv_heads} with model.kv_lora_rank={m.kv_lora_rank}: Multi-head Latent "
            f"Attention gives every head its own keys and values (from the shared latent); set "
            f"model.n_kv_heads=null"
        )
    if shape[CONTEXT] > 1:
        raise ConfigError(
            f"model.kv_lora_rank={m.kv_lora_rank} (Multi-head Latent Attention) with mesh.context={shape[CONTEXT]}: "
            f"context parallelism does not run MLA yet; set mesh.context=1"
        )
    if cfg.precision.fp8.enabled:
        raise ConfigError(
            f"precision.fp8.enabled=true with model.kv_lora_rank={m.kv_lora_rank}: FP8 GEMMs do not cover Multi-head "
            f"Latent Attention's projections yet; set precision.fp8.enabled=false"
        )
    # The latents are the rows (embed dimension) of wq_b and wkv_b, split like d_model (jaxpar.model.mla).
    state_shards = shape[FSDP] * (shape[DATA] if cfg.optimizer.zero_stage >= 1 else 1)
    for key in ("kv_lora_rank", "q_lora_rank"):
        rank = getattr(m, key)
        if rank is not None and rank % state_shards:
            what = "mesh.fsdp" if cfg.optimizer.zero_stage == 0 else "mesh.fsdp * mesh.data"
            raise ConfigError(
                f"model.{key}={rank} must be divisible by {what}={state_shards} (the up-projection's rows are "
                f"sharded like model.d_model); change the mesh or model.{key}"
            )
    width = m.kernel_head_width
    if m.attention == "cudnn" and (width % 8 or width > CUDNN_MAX_HEAD_DIM_HOPPER):
        raise ConfigError(
            f"model.attention=cudnn with MLA's kernel width max(qk_nope_head_dim + qk_rope_head_dim, v_head_dim) = "
            f"{width}: cuDNN's fused attention takes multiples of 8 up to {CUDNN_MAX_HEAD_DIM_HOPPER} (Hopper); change "
            f"the widths or set model.attention=xla"
        )
