"""`model.init_from`: a fresh run's parameters from a Hugging Face model directory or a jaxpar checkpoint.

`check_init_from` runs before any device work (reads config.json and safetensors headers, or a checkpoint's saved
config) and names every model key that differs. `place_init_params` then puts the parameters straight onto the
run's mesh, each process reading only the slices its own devices hold (no host holds the whole model), and
`jaxpar.training.state.init_state(plan, params=..., donate=True)` adds a fresh optimizer state, made on the devices,
at step 0. `load_init_params` reads them whole into host memory instead (small models and tools).
"""

from __future__ import annotations

import os

import jax

from jaxpar.config import ConfigError, load_config
from jaxpar.config.paths import directory_problem
from jaxpar.config.schema import ModelConfig
from jaxpar.model.hf import HFConfigError, check_hf, is_hf_directory, load_hf
from jaxpar.model.hf.config import model_differences
from jaxpar.model.interface import STACK_ATTRIBUTE


def _saved_model(path: str) -> tuple[ModelConfig, str, int]:
    """(the model config saved with the checkpoint at `path`, its root, its step), reading metadata only."""
    from jaxpar.checkpoint.saved import saved_config, select_step

    root, step = select_step(path)
    return load_config(saved_config(root, step), validate=False).model, root, step


def resumes(run_dir: str) -> bool:
    """True if `run_dir` holds a complete checkpoint of its own (the run resumes from it; init_from is unused)."""
    from jaxpar.checkpoint.store import RUN_CHECKPOINT_DIR, complete_steps

    return bool(complete_steps(os.path.join(run_dir, RUN_CHECKPOINT_DIR)))


def check_init_from(model: ModelConfig) -> None:
    """Checks `model.init_from` (if set) fits `model`, before any device work.

    Raises:
      ConfigError: the path is neither a Hugging Face directory (config.json) nor a jaxpar checkpoint, cannot be
        read, or its model differs from `model` (every differing key, with the value to set).
    """
    path = model.init_from
    if not path:
        return
    problem = directory_problem(path)
    if problem is not None:
        raise ConfigError(
            f"model.init_from={path!r} {problem}; give a Hugging Face model directory (config.json + "
            f"*.safetensors) or a jaxpar run or checkpoint directory, or leave it empty to initialise from train.seed"
        )
    if is_hf_directory(path):
        try:
            check_hf(path, model)
        except HFConfigError as e:
            raise ConfigError(f"model.init_from: {e}") from e
        return
    try:
        saved, root, step = _saved_model(path)
    except FileNotFoundError as e:
        raise ConfigError(
            f"model.init_from={path!r} holds neither config.json (a Hugging Face directory) nor a complete jaxpar "
            f"checkpoint ({e})"
        ) from e
    differences = model_differences(model, saved)
    if saved.name != model.name:
        differences.insert(0, f"model.name: config {model.name!r}, checkpoint {saved.name!r}")
    if differences:
        raise ConfigError(
            f"model.init_from: the checkpoint {root} (step {step}) holds another model: "
            + "; ".join(d.replace("Hugging Face directory", "checkpoint") for d in differences)
            + "; set those model.* keys to the checkpoint's values"
        )


def load_init_params(model: ModelConfig) -> dict:
    """The parameters `model.init_from` names, whole on the host as float32 numpy (small models and tools; a run
    places them with `place_init_params`): a Hugging Face directory's, or a jaxpar checkpoint's (its master copy
    under precision.layout=16p; only the parameters are read, whatever optimizer the run had:
    `jaxpar.checkpoint.params.restore_params`).

    Raises:
      ConfigError: as `check_init_from`.
    """
    check_init_from(model)
    if is_hf_directory(model.init_from):
        return load_hf(model.init_from, model).params
    from jaxpar.checkpoint.params import restore_params

    return restore_params(model.init_from)[0]


def place_init_params(model: ModelConfig, target: dict) -> dict:
    """The parameters `model.init_from` names, as float32 jax arrays placed onto `target`'s shardings, each process
    reading only the blocks its devices hold: a Hugging Face directory's slices of each safetensors tensor
    (`jaxpar.model.hf.place.place_hf_params`), or a jaxpar checkpoint's shards of its parameters alone
    (`jaxpar.checkpoint.params.restore_params`). Host memory: one device's block of one parameter at a time.

    Args:
      target: the model's parameter tree of `jax.ShapeDtypeStruct`s with shardings
        (`jaxpar.training.state.abstract_params(plan)`).

    Raises:
      ConfigError: as `check_init_from`.
    """
    check_init_from(model)
    if is_hf_directory(model.init_from):
        from jaxpar.model.hf.lazy import HFSliceReader
        from jaxpar.model.hf.place import place_hf_params

        try:
            with HFSliceReader(model.init_from, model) as reader:
                return place_hf_params(reader, target)
        except HFConfigError as e:
            raise ConfigError(f"model.init_from: {e}") from e
    from jaxpar.checkpoint.params import restore_params

    rows = jax.tree.leaves(target[STACK_ATTRIBUTE])[0].shape[0] if STACK_ATTRIBUTE in target else None
    return restore_params(model.init_from, shardings=jax.tree.map(lambda s: s.sharding, target), stack_rows=rows)[0]


def check_init_from_tokenizer(cfg) -> None:
    """A Hugging Face `model.init_from` directory that holds a `tokenizer.json` fixes the token ids its weights
    mean: the run's data must be token shards made with that tokenizer (`jaxpar-data tokenize ... --tokenizer
    DIR`), compared by the tokenizer file's SHA-256 recorded in each shard set's manifest. Reads only manifests;
    before any device work. A directory without a tokenizer.json, or a jaxpar checkpoint, is not checked.

    Args:
      cfg: the run's `Config`.

    Raises:
      ConfigError: a data source that is not a shard set, or a shard set made with another tokenizer.
    """
    from jaxpar.config.data_sources import source_configs
    from jaxpar.data.errors import DataError
    from jaxpar.data.shards import file_sha256, read_manifest

    directory = cfg.model.init_from
    tokenizer_file = os.path.join(directory, "tokenizer.json")
    if not (is_hf_directory(directory) and os.path.isfile(tokenizer_file)):
        return
    digest = file_sha256(tokenizer_file)
    fix = f"tokenize the data with `jaxpar-data tokenize INPUT --tokenizer {directory} --out DIR` and train on it"
    sources = [(n, d) for n, _, d in source_configs(cfg.data)] if cfg.data.sources else [("data", cfg.data)]
    for name, data in sources:
        where = "data" if name == "data" else f"data.sources ({name})"
        if data.source != "shards":
            raise ConfigError(
                f"model.init_from={directory!r} holds the tokenizer its weights were trained with, but {where} is "
                f"source={data.source!r} (jaxpar's byte tokens); {fix} (data.source=shards data.path=DIR)"
            )
        for path in filter(None, (data.path, data.validation_path)):
            try:
                recorded = read_manifest(os.path.expanduser(path))["tokenizer"].get("sha256")
            except (DataError, OSError, KeyError):
                continue  # the data checks name what is wrong with the set itself
            if recorded != digest:
                raise ConfigError(
                    f"the shard set {path} was made with another tokenizer than model.init_from={directory!r}'s "
                    f"tokenizer.json (SHA-256 {recorded} vs {digest}); {fix}"
                )
