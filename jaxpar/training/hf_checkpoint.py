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

Both run on every device of every process of the job (`jaxpar-launch -n N -- jaxpar-checkpoints ...` on a
cluster), laid out over `jaxpar.parallel.mesh.process_mesh()`, and no host ever holds the whole model: import reads
each process's slices of the safetensors straight into the sharded state, export gathers one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxpar.config import Config, ConfigError, load_config, save_config
from jaxpar.config.mesh_axes import DATA, FSDP
from jaxpar.config.paths import output_dir_problem, write_atomic
from jaxpar.model.hf import check_export_dir, check_hf
from jaxpar.model.hf.config import hf_config_from_model, model_differences, read_hf_config

if TYPE_CHECKING:
    import optax

_LOGGER = logging.getLogger("jaxpar.training.hf_checkpoint")
HF_CONFIG_COPY = "hf_config.json"  # the imported directory's config.json, beside config.yaml
_ONE_DEVICE = (
    "mesh.data=1",
    "mesh.fsdp=1",
    "mesh.tensor=1",
    "mesh.pipeline=1",
    "mesh.context=1",
    "pipeline.virtual_stages=1",
)


def import_hf(
    hf_dir: str, run_dir: str, overrides: Sequence[str] = (), *, optimizer: optax.GradientTransformation | None = None
) -> dict:
    """Writes `hf_dir`'s weights as step 0 of a jaxpar run in `run_dir` (see the module docstring). Every process of
    the job calls it.

    The step-0 state is built on every device of every process, laid out ZeRO-3 over `process_mesh()` (each array
    split over all devices): each process reads only the slices of the safetensors tensors its devices hold
    (`jaxpar.model.hf.place.place_hf_params`), and the fresh optimizer state (AdamW's two zero moments, 8 bytes per
    parameter) is made by the jitted program that lays out the state, on the devices (`init_state`); Orbax writes
    each process's shards. A process holds 12 bytes per parameter (AdamW, float32) over the process count, plus
    the block being read, then Orbax's host copies of the shards it writes (as in every checkpoint save); on the
    CPU backend, as `jaxpar-checkpoints` runs, a device's memory is its host's. Measured: docs/checkpoints.md.

    The optimizer state is written, not left out: the run directory is then a checkpoint like any other, which
    `jaxpar-train RUN_DIR/config.yaml`, `jaxpar.restore` and `checkpoint.restore_from` read as they read every
    checkpoint (a checkpoint without it would need a second restore path that makes a fresh optimizer). A run that
    wants no written state at all starts from the directory itself with `model.init_from: HF_DIR` (4 bytes per
    parameter read, straight onto the training mesh).

    Args:
      overrides: dotted config overrides for the run's config.yaml (`model.*` shape keys come from config.json
        and may not be overridden).
      optimizer: the optax transformation whose fresh state step 0 holds, as `jaxpar.training.plan.build_plan`
        takes it (default: the config's AdamW); a run of it resumes with the same one (`jaxpar.restore(...,
        optimizer=)`, `jaxpar.train(..., optimizer=)`).

    Returns:
      {"run_dir", "step": 0, "parameters": count, "dtype": the stored weights' dtype, "model": ModelConfig dict}.

    Raises:
      HFConfigError: the directory is not a model jaxpar can read (the message names the key or tensor); checked
        from config.json and the safetensors headers before any device work.
      ConfigError: `run_dir` cannot be written (a file in the way, no permission) or already holds checkpoints,
        an override is invalid or changes the model's shape, or the model's width is not divisible by the
        job's device count.
    """
    import jax  # device work only from here on

    from jaxpar.checkpoint.store import RUN_CHECKPOINT_DIR, Checkpointer
    from jaxpar.model.hf.lazy import HFSliceReader
    from jaxpar.model.hf.place import place_hf_params
    from jaxpar.parallel.mesh import process_mesh
    from jaxpar.training.plan import build_plan
    from jaxpar.training.state import abstract_params, init_state

    problem = output_dir_problem(run_dir, keep_created=jax.process_count() > 1)
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
    hf_config = read_hf_config(hf_dir)
    model = check_hf(hf_dir)  # config.json and the safetensors headers: every refusal before device work
    values = {"model": dataclasses.asdict(model), "train": {"run_dir": run_dir}}
    cfg = load_config(values, overrides, validate=False)
    changed = model_differences(cfg.model, model)
    if changed:
        raise ConfigError(
            f"overrides change the model of {hf_dir} ({'; '.join(changed)}); leave the model's shape to config.json"
        )
    if cfg.train.run_dir != run_dir:
        raise ConfigError(f"train.run_dir={cfg.train.run_dir!r} differs from --out {run_dir!r}; drop the override")
    one = load_config(cfg.to_dict(), _ONE_DEVICE, num_devices=1)  # validates the run's settings too
    mesh = process_mesh()
    if one.model.d_model % mesh.size:
        raise ConfigError(
            f"import-hf splits every array over all {mesh.size} devices of the job, and model.d_model="
            f"{one.model.d_model} is not divisible by {mesh.size}; run it on a device count that divides it"
        )
    plan = build_plan(_spread(one, mesh.shape[DATA], mesh.shape[FSDP]), mesh, optimizer=optimizer)
    target = abstract_params(plan)
    with HFSliceReader(hf_dir, model) as reader:
        state = init_state(plan, params=place_hf_params(reader, target), donate=True)
        stored = reader.stored_dtype
    ckpt = Checkpointer(ckpt_dir, every_steps=1, keep=1, async_save=False)
    try:
        ckpt.save(0, state, data_state={"next_sample": 0}, config=cfg.to_dict(), force=True)
        ckpt.wait()
    finally:
        ckpt.close()
    del state
    if jax.process_index() == 0:
        save_config(cfg, os.path.join(run_dir, "config.yaml"))  # after the checkpoint: a run dir with it is whole
        write_atomic(os.path.join(run_dir, HF_CONFIG_COPY), json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxpar.training.hf_checkpoint: imported")  # every process sees it whole
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(target))
    _LOGGER.info("imported %s (%d parameters, %s) into %s", hf_dir, count, stored, run_dir)
    return {"run_dir": run_dir, "step": 0, "parameters": count, "dtype": stored, "model": dataclasses.asdict(model)}


def _spread(one: Config, data: int, fsdp: int) -> Config:
    """The run's config `one` (validated on one device) laid out for the import over data x fsdp devices: ZeRO-3
    (every array split over all of them), no tensor, pipeline, context or expert axes. The optimizer state's
    structure does not depend on the layout, so any mesh and ZeRO stage restores it."""
    return dataclasses.replace(
        one,
        mesh=dataclasses.replace(one.mesh, data=data, fsdp=fsdp, tensor=1, pipeline=1, context=1),
        optimizer=dataclasses.replace(one.optimizer, zero_stage=3),
        model=dataclasses.replace(one.model, moe=dataclasses.replace(one.model.moe, expert_axes=())),
    )


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
    dir) as a Hugging Face directory of its family: the float32 parameters (the master copy under
    precision.layout=16p) cast to `dtype`. Every process of the job calls it; process 0 writes the files.

    Reads only the parameters (`jaxpar.checkpoint.params.restore_params`: any optimizer, 4 bytes per parameter),
    spread over every device of every process (`jaxpar.model.hf.gather.export_shardings` on `process_mesh()`), each
    process reading only its shards; then gathers them one Hugging Face tensor at a time onto each process, and
    process 0 streams each into its file (`jaxpar.model.hf.gather.save_hf_gathered`). A host holds its processes'
    shards of the parameters (on the CPU backend, where a device's memory is the host's), Orbax's buffers while it
    reads them, then one tensor at a time, about twice (float32, gathered and on the host; then the host copy and
    its cast): never the whole model unless one process holds all the devices. Returns the files written.

    Raises:
      FileNotFoundError: no complete checkpoint at `path`. HFConfigError: not a family that converts, an unknown
        dtype, parameters that do not fit the saved config, or `out_dir` cannot take the export
        (`jaxpar.model.hf.check_export_dir`).
    """
    from jaxpar.checkpoint.params import restore_params
    from jaxpar.checkpoint.saved import saved_config, select_step
    from jaxpar.model.hf.gather import export_shardings, save_hf_gathered
    from jaxpar.parallel.mesh import process_mesh

    check_export_dir(out_dir)  # before reading the checkpoint
    root, chosen = select_step(path, step)  # a missing checkpoint is refused before any device work
    model = load_config(saved_config(root, chosen), validate=False).model
    hf_config_from_model(model, dtype)  # a model its family's transformers class cannot express: refused first
    mesh = process_mesh()
    params, cfg, _ = restore_params(root, chosen, shardings=export_shardings(model, mesh))
    files = save_hf_gathered(
        params,
        cfg.model,
        out_dir,
        mesh,
        dtype=dtype,
        base_config=_hf_config_beside(path),
        max_shard_bytes=max_shard_bytes,
    )
    _LOGGER.info("exported step %d of %s to %s (%s)", chosen, path, out_dir, dtype)
    return files
