"""Hugging Face model directories (the families of `jaxpar.model.hf`) <-> jaxpar run directories (Orbax
checkpoints), behind `jaxpar-checkpoints import-hf` and `jaxpar-checkpoints export-hf`.

    import_hf("path/to/Llama-3.2-1B", "runs/llama32", ["train.steps=100"])   # step 0: weights, fresh AdamW
    restored = jaxpar.restore("runs/llama32", ["mesh.tensor=2", ...])         # onto any mesh and ZeRO stage
    export_hf("runs/llama32", "out/llama32_hf", dtype="bfloat16")             # back to transformers

An imported run directory holds a step-0 checkpoint (the weights as float32 parameters, AdamW's zero moments),
`config.yaml` (the model from config.json, every other key the defaults plus the overrides given, mesh left to
fill the devices) and `hf_config.json` (the source config.json, whose keys jaxpar does not own, e.g. token ids,
go back out on export). Training it (`jaxpar-train RUN_DIR/config.yaml`) continues from step 0; a fresh run of
another config starts from the same weights with `model.init_from: HF_DIR` (`jaxpar.training.loop`) or
`checkpoint.restore_from: RUN_DIR`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence

from jaxpar.config import ConfigError, load_config, save_config
from jaxpar.config.paths import output_dir_problem, write_atomic
from jaxpar.model.hf import check_export_dir, load_hf, save_hf
from jaxpar.model.hf.config import model_differences

_LOGGER = logging.getLogger("jaxpar.training.hf_checkpoint")
HF_CONFIG_COPY = "hf_config.json"  # the imported directory's config.json, beside config.yaml
_ONE_DEVICE = ("mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipeline=1", "pipeline.virtual_stages=1")


def import_hf(hf_dir: str, run_dir: str, overrides: Sequence[str] = ()) -> dict:
    """Writes `hf_dir`'s weights as step 0 of a jaxpar run in `run_dir` (see the module docstring), built on one
    host device (the whole model in host memory: parameters and AdamW's two moments, 12 bytes per parameter).

    Args:
      overrides: dotted config overrides for the run's config.yaml (`model.*` shape keys come from config.json
        and may not be overridden).

    Returns:
      {"run_dir", "step": 0, "parameters": count, "dtype": the stored weights' dtype, "model": ModelConfig dict}.

    Raises:
      HFConfigError: the directory is not a model jaxpar can read (the message names the key or tensor).
      ConfigError: `run_dir` cannot be written (a file in the way, no permission) or already holds checkpoints,
        or an override is invalid or changes the model's shape.
    """
    import jax  # device work only from here on

    from jaxpar.checkpoint.store import RUN_CHECKPOINT_DIR, Checkpointer
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.training.plan import build_plan
    from jaxpar.training.state import init_state

    problem = output_dir_problem(run_dir)
    if problem is not None:
        raise ConfigError(f"--out {run_dir!r} {problem}; import into a new run directory you can write")
    ckpt_dir = os.path.join(run_dir, RUN_CHECKPOINT_DIR)
    if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        cut_short = (
            ""
            if os.path.isfile(os.path.join(run_dir, "config.yaml"))
            else (" but no config.yaml (written after the checkpoint: an import cut short?)")
        )
        raise ConfigError(
            f"{ckpt_dir} already holds checkpoints{cut_short}; import into a new run directory"
            + (f", or delete {ckpt_dir} if it is that import's" if cut_short else "")
        )
    hf = load_hf(hf_dir)
    values = {"model": dataclasses.asdict(hf.cfg), "train": {"run_dir": run_dir}}
    cfg = load_config(values, overrides, validate=False)
    changed = model_differences(cfg.model, hf.cfg)
    if changed:
        raise ConfigError(
            f"overrides change the model of {hf_dir} ({'; '.join(changed)}); leave the model's shape to config.json"
        )
    if cfg.train.run_dir != run_dir:
        raise ConfigError(f"train.run_dir={cfg.train.run_dir!r} differs from --out {run_dir!r}; drop the override")
    one = load_config(cfg.to_dict(), _ONE_DEVICE, num_devices=1)  # validates the run's settings too
    devices = jax.local_devices(backend="cpu")[:1]
    plan = build_plan(one, build_mesh(one, devices))
    state = init_state(plan, params=hf.params)
    ckpt = Checkpointer(ckpt_dir, every_steps=1, keep=1, async_save=False)
    try:
        ckpt.save(0, state, data_state={"next_sample": 0}, config=cfg.to_dict(), force=True)
        ckpt.wait()
    finally:
        ckpt.close()
    save_config(cfg, os.path.join(run_dir, "config.yaml"))  # after the checkpoint: a run dir with it is whole
    write_atomic(os.path.join(run_dir, HF_CONFIG_COPY), json.dumps(hf.hf_config, indent=2, sort_keys=True) + "\n")
    count = sum(int(x.size) for x in jax.tree.leaves(hf.params))
    _LOGGER.info("imported %s (%d parameters, %s) into %s", hf_dir, count, hf.dtype, run_dir)
    return {"run_dir": run_dir, "step": 0, "parameters": count, "dtype": hf.dtype, "model": dataclasses.asdict(hf.cfg)}


def _hf_config_beside(path: str) -> dict | None:
    """The hf_config.json of the run that `path` (run dir, checkpoints/ or a step dir) belongs to, if any."""
    here = os.path.abspath(path)
    for _ in range(3):
        candidate = os.path.join(here, HF_CONFIG_COPY)
        if os.path.isfile(candidate):
            with open(candidate, encoding="utf-8") as f:
                return json.load(f)
        here = os.path.dirname(here)
    return None


def export_hf(
    path: str,
    out_dir: str,
    *,
    dtype: str = "float32",
    step: int | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Writes the parameters of a jaxpar checkpoint of a built-in family (a run dir, its checkpoints/ dir or a step
    dir) as a Hugging Face directory of its family (`jaxpar.model.hf.save_hf`): the float32 parameters (the master copy
    under precision.layout=16p) cast to `dtype`. Reads only the parameters, on the host CPU
    (`jaxpar.checkpoint.params.restore_params`: any optimizer, 4 bytes per parameter). Returns the files written.

    Raises:
      FileNotFoundError: no complete checkpoint at `path`. HFConfigError: not a family that converts, an unknown
        dtype, parameters that do not fit the saved config, or `out_dir` cannot take the export
        (`jaxpar.model.hf.check_export_dir`).
    """
    from jaxpar.checkpoint.params import restore_params

    check_export_dir(out_dir)  # before reading the checkpoint
    params, cfg, chosen = restore_params(path, step)
    files = save_hf(
        params, cfg.model, out_dir, dtype=dtype, base_config=_hf_config_beside(path), max_shard_bytes=max_shard_bytes
    )
    _LOGGER.info("exported step %d of %s to %s (%s)", chosen, path, out_dir, dtype)
    return files
