"""Hugging Face weights in and out of jaxpar's built-in families: Llama 2/3.x, Qwen2/2.5, Qwen3, Mistral, Mixtral
and DeepSeek-V3 (a llama with Multi-head Latent Attention) (`jaxpar.model.llama`), and Gemma 2 (`jaxpar.model.gemma`).

    hf = load_hf("path/to/Qwen2.5-7B")                       # ModelConfig (model.name from model_type) + params
    state = init_state(plan, params=hf.params)               # on any mesh (jaxpar.training.state.init_state)
    save_hf(params, cfg, "out/hf", dtype="bfloat16")         # transformers' Qwen2ForCausalLM loads it

A directory is `config.json` plus `model.safetensors` or shards named by `model.safetensors.index.json`. Which
families and config keys map to what: `jaxpar.model.hf.config`; tensor names and layouts, and the rotary
convention: `jaxpar.model.hf.weights`. Everything here is numpy on the host, the whole model at once: no device
work. A model larger than a host goes in and out by the slice instead, straight between the files and sharded jax
arrays (`jaxpar.model.hf.place`, `jaxpar.model.hf.gather`; the slice map: `jaxpar.model.hf.lazy`, the file I/O:
`jaxpar.model.hf.files`).
"""

from __future__ import annotations

import dataclasses
import json
import os

from jaxpar.config.paths import output_dir_problem, write_atomic
from jaxpar.config.schema import ModelConfig
from jaxpar.model.hf.config import (
    CONFIG_FILE,
    HFConfigError,
    hf_config_from_model,
    model_config_from_hf,
    model_differences,
    read_hf_config,
)
from jaxpar.model.hf.weights import (
    INDEX_FILE,
    PARTIAL,
    check_hf_tensors,
    hf_tensors,
    read_hf_params,
    write_hf_tensors,
)

__all__ = [
    "HFConfigError",
    "HFModel",
    "check_export_dir",
    "check_hf",
    "hf_config_from_model",
    "hf_tensors",
    "is_hf_directory",
    "load_hf",
    "model_config_from_hf",
    "save_hf",
]


@dataclasses.dataclass
class HFModel:
    """An imported Hugging Face model.

    Attributes:
      cfg: the jaxpar ModelConfig (`model_config_from_hf`).
      params: jaxpar's nested parameter dict of float32 numpy arrays.
      dtype: the dtype the weights were stored in ("float32", "bfloat16", "float16").
      hf_config: the directory's config.json as read.
    """

    cfg: ModelConfig
    params: dict
    dtype: str
    hf_config: dict


def is_hf_directory(path: str) -> bool:
    """True if `path` is a directory holding config.json (a Hugging Face model directory, not a jaxpar run)."""
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def check_hf(hf_dir: str, want: ModelConfig | None = None) -> ModelConfig:
    """Reads config.json and the safetensors headers only (no weights) and returns the directory's ModelConfig
    (`want`'s other fields kept). With `want`, its family, shape, rope, norm, window and expert fields must equal
    the directory's.

    Raises:
      HFConfigError: an unreadable or unsupported directory, tensors that do not fit config.json, or (with `want`)
        every `model.*` key on which `want` differs, with the value to set.
    """
    cfg = model_config_from_hf(read_hf_config(hf_dir), want)
    if want is not None:
        differences = model_differences(want, cfg)
        if differences:
            raise HFConfigError(
                f"the config's model does not match the Hugging Face directory {hf_dir}: "
                + "; ".join(differences)
                + "; set those model.* keys to the directory's values (jaxpar-checkpoints import-hf writes a "
                "config that has them)"
            )
    check_hf_tensors(hf_dir, cfg)
    return cfg


def load_hf(hf_dir: str, base: ModelConfig | None = None) -> HFModel:
    """Imports `hf_dir` (config.json + safetensors) as the jaxpar family its model_type names: ModelConfig
    (`base`'s other fields kept: `jaxpar.model.hf.config.model_config_from_hf`) and float32 numpy parameters.

    Raises:
      HFConfigError: as `check_hf`.
    """
    hf_config = read_hf_config(hf_dir)
    cfg = model_config_from_hf(hf_config, base)
    params, dtype = read_hf_params(hf_dir, cfg)
    return HFModel(cfg=cfg, params=params, dtype=dtype, hf_config=hf_config)


def save_hf(
    params: dict,
    cfg: ModelConfig,
    out_dir: str,
    *,
    dtype: str = "float32",
    base_config: dict | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Writes a jaxpar parameter dict (numpy or jax arrays) of `cfg`'s family as a Hugging Face directory that
    transformers' class of the family loads: config.json (`hf_config_from_model`; `base_config` supplies the keys
    jaxpar does not own, e.g. token ids) and safetensors of `dtype` (sharded with an index above
    `max_shard_bytes` per file). Returns the file names.

    Raises:
      HFConfigError: `out_dir` cannot take the export (`check_export_dir`), a model the family's transformers class
        cannot express (`hf_config_from_model`), an unknown dtype, or parameters shaped unlike `cfg`; each before
        any file is written.
    """
    check_export_dir(out_dir)
    hf = hf_config_from_model(cfg, dtype, base_config)
    tensors = hf_tensors(params, cfg, dtype)
    files = write_hf_tensors(tensors, out_dir, max_shard_bytes)  # each file whole or not at all
    write_atomic(os.path.join(out_dir, CONFIG_FILE), json.dumps(hf, indent=2, sort_keys=True) + "\n")  # last
    return [CONFIG_FILE, *files]


def check_export_dir(out_dir: str) -> None:
    """Refuses an `out_dir` that an export cannot write into: a file in the way, no permission to write
    (`jaxpar.config.paths.output_dir_problem`), model files already there, or the files of an export that was
    cut short (safetensors without config.json, which is written last, or a `.partial` file).

    Raises:
      HFConfigError: naming the directory, the problem and the fix.
    """
    problem = output_dir_problem(out_dir)
    if problem is not None:
        raise HFConfigError(f"{out_dir!r} {problem}; export into a new or empty directory you can write")
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    model = [n for n in names if n in (CONFIG_FILE, INDEX_FILE) or n.endswith((".safetensors", PARTIAL))]
    if model and CONFIG_FILE not in model:
        raise HFConfigError(
            f"{out_dir} holds {', '.join(sorted(model))} but no {CONFIG_FILE} (written last): an export that was "
            f"cut short; delete those files and export again, or export into a new directory"
        )
    if model:
        raise HFConfigError(
            f"{out_dir} already holds {', '.join([CONFIG_FILE, *sorted(set(model) - {CONFIG_FILE})])}; export into "
            f"a new or empty directory"
        )
