"""Where a run starts: its run directory, checked writable before any device work (`check_run_dir`), and the state
it starts from (`initial_state`): its own latest checkpoint (a resume, with the data position), else
`checkpoint.restore_from`'s (checked before any device work: `check_restore_from`), else fresh (parameters from
`model.init_from`, or initialised from the seed).
"""

from __future__ import annotations

import os

import jax

from jaxpar.checkpoint.info import read_json_item
from jaxpar.checkpoint.mismatch import CheckpointMismatchError
from jaxpar.checkpoint.saved import saved_config, select_step
from jaxpar.checkpoint.store import Checkpointer, restore_from_path
from jaxpar.config import Config, ConfigError, save_config
from jaxpar.config.paths import output_dir_problem
from jaxpar.config.resume import check_restored_model, check_resume_config, keep_previous_config
from jaxpar.data.stream import SHARD_SET_KEY
from jaxpar.training.hooks.base import log as _log
from jaxpar.training.init_from import place_init_params, resumes
from jaxpar.training.plan import StepPlan
from jaxpar.training.state import abstract_params, abstract_state, init_state


def check_run_dir(run_dir: str) -> None:
    """Checks that `train.run_dir` is, or can be created as, a directory this process can write in
    (`jaxpar.config.paths.output_dir_problem`), and leaves the file system as it found it (directories it creates to
    check are removed again) in a single-process run. With several processes they are kept: the processes check
    at the same time, and one removing a directory another is probing would fail that one's check.

    Raises:
      ConfigError: naming the path, what is in the way (a file where a directory must be, no permission to write,
        the OS error) and the fix.
    """
    problem = output_dir_problem(run_dir, keep_created=jax.process_count() > 1)
    if problem is not None:
        raise ConfigError(
            f"train.run_dir={run_dir!r} {problem}; give a directory you can write, e.g. train.run_dir=runs/tiny "
            f"(it is created if missing)"
        )


def check_restore_from(cfg: Config) -> None:
    """Checks `checkpoint.restore_from` where it seeds the run (a run without checkpoints of its own), before any
    device work, reading only the step's format and config items: a complete step there, of a format version
    this jaxpar reads, holding the model `cfg` names (`jaxpar.config.resume.check_restored_model`: the check of
    every restore).

    Raises:
      ConfigError: the path holds no complete checkpoint (for the step it names: the message lists the steps
        there are and how to pick one), the step's format version is unknown here (`CheckpointFormatError`), or
        its model differs (every key).
    """
    source = cfg.checkpoint.restore_from
    if not source or resumes(cfg.train.run_dir):
        return
    try:
        root, step = select_step(source)
        saved = saved_config(root, step)
    except FileNotFoundError as e:
        raise ConfigError(f"checkpoint.restore_from={source!r} (--restore-from): {e}") from e
    check_restored_model(
        saved,
        cfg.model,
        os.path.join(root, str(step)),
        "set those keys to the checkpoint's (its run's config.yaml), or take its parameters alone with "
        "model.init_from (a fresh optimizer at step 0)",
    )


def initial_state(cfg: Config, plan: StepPlan, ckpt: Checkpointer | None, train_loader):
    """The state to start from (the latest checkpoint's, with the data position set on `train_loader`, else
    `checkpoint.restore_from`'s, else fresh: parameters from `model.init_from` or initialised from the seed),
    after writing RUN_DIR/config.yaml (keeping a resumed run's previous one if settings changed).

    A resume sets the data position of its latest checkpoint (read from that step's JSON alone) before any array
    is restored, so a position the data cannot take, or a shard set that changed since
    (`jaxpar.data.stream.check_shard_set`), is refused first. `checkpoint.restore_from` seeds a new run, which
    may train on other data (its `data.*` settings are not compared either): the shard sets the position was
    saved over are not checked.

    Raises:
      ConfigError: other data settings than the checkpoint's, a shard set that changed since, a checkpoint that
        does not fit, or a run already past `train.steps`. ValueError: a data position the data cannot take.
    """
    t, run_dir = cfg.train, cfg.train.run_dir
    own = ckpt if ckpt is not None and ckpt.latest_step() is not None else None  # the run's own checkpoints
    resuming = own is not None
    changes = check_resume_config(run_dir, cfg) if resuming else {}  # refuses other data before any write
    if own is not None and (saved := _latest_data_state(own)) is not None:
        _set_data_position(train_loader, saved)  # before the arrays: a resume that cannot go on stops here
    state, data_state = _restore(cfg, plan, ckpt)
    if state is None and cfg.model.init_from:
        params = place_init_params(cfg.model, abstract_params(plan))  # each process reads its own slices
        state = init_state(plan, params=params, donate=True)  # parameters only: fresh optimizer, step 0
        _log(f"parameters from model.init_from={cfg.model.init_from} (a fresh optimizer state at step 0)")
    elif state is None:
        state = init_state(plan, t.seed)
    else:
        if not resuming:  # checkpoint.restore_from: a new run, whose data may differ
            data_state = {k: v for k, v in data_state.items() if k != SHARD_SET_KEY}
        _set_data_position(train_loader, data_state)  # again: the restore may have fallen back to an older step
    start = int(state["step"])
    if start > t.steps:
        raise ConfigError(
            f"the run in train.run_dir={run_dir!r} is already at step {start}, past train.steps="
            f"{t.steps}; raise train.steps to train on, or give another train.run_dir"
        )
    if jax.process_index() == 0:  # only once the state fits: a failed restore leaves the old config.yaml
        os.makedirs(run_dir, exist_ok=True)
        if changes:
            kept = keep_previous_config(run_dir, start)
            _log(
                f"resuming with changed settings ({'; '.join(f'{k}: {a!r} -> {b!r}' for k, (a, b) in changes.items())}"
                f"); the previous config is kept as {kept}"
            )
        save_config(cfg, os.path.join(run_dir, "config.yaml"))
    if start:
        position = data_state.get("next_sample", "the caller's iterator state")  # as restored, no re-gather
        if "taken" in data_state:  # a mixture (jaxpar.data.MixtureLoader)
            position = f"rows per source {data_state['taken']}"
        _log(f"resumed at step {start} (data position {position})")
        if start == t.steps:
            _log(
                f"the run in train.run_dir={run_dir!r} has reached train.steps={t.steps}: nothing to train (it is "
                f"evaluated); raise train.steps to train on, or give another train.run_dir for a new run"
            )
    return state


def _latest_data_state(ckpt: Checkpointer) -> dict | None:
    """The data position saved with `ckpt`'s latest complete step (its JSON item only), or None when it cannot be
    read (the restore then names what is wrong, or falls back to an older step)."""
    try:
        return read_json_item(os.path.join(ckpt.directory, str(ckpt.latest_step())), "data")
    except Exception:  # noqa: BLE001 - any read failure is the restore's to report
        return None


def _set_data_position(train_loader, data_state: dict) -> None:
    """`train_loader.set_state(data_state)`.

    Raises:
      ConfigError: what `set_state` raises as one (a shard set that changed since).
      ValueError: any other refusal, with the fix.
    """
    try:
        train_loader.set_state(data_state)
    except ConfigError:
        raise
    except ValueError as e:
        raise ValueError(
            f"the checkpoint's data position does not fit this run's data ({e}); resume with the "
            f"data the run was saved with (the built-in corpus, or the same iterator), or start "
            f"a fresh run in another train.run_dir"
        ) from e


def _restore(cfg: Config, plan: StepPlan, ckpt: Checkpointer | None):
    """Returns (state, data_state) from RUN_DIR's latest checkpoint, else from `checkpoint.restore_from`, else
    (None, None). A run's own checkpoints come first, so rerunning a command that seeded the run from another
    checkpoint resumes where it stopped.

    Raises:
      ConfigError: the path holds no complete checkpoint, or the checkpoint's arrays do not fit this config.
    """
    target = abstract_state(plan)
    own = ckpt if ckpt is not None and ckpt.latest_step() is not None else None  # the run's own checkpoints
    source = own.directory if own is not None else cfg.checkpoint.restore_from
    try:
        if own is not None:  # the run's own progress wins over checkpoint.restore_from, which only seeds a fresh run
            if cfg.checkpoint.restore_from:
                _log(
                    f"resuming from this run's own checkpoints in {own.directory}; checkpoint.restore_from="
                    f"{cfg.checkpoint.restore_from} only starts a run that has none"
                )
            state, data_state, _ = own.restore(None, target)
            return state, data_state
        if cfg.checkpoint.restore_from:
            state, data_state, _ = restore_from_path(cfg.checkpoint.restore_from, target)
            _log(f"restored from {cfg.checkpoint.restore_from}")
            return state, data_state
    except FileNotFoundError as e:
        raise ConfigError(
            f"{e}; pass a run directory, its checkpoints/ directory or one of its step "
            f"directories to --restore-from (checkpoint.restore_from)"
        ) from e
    except CheckpointMismatchError as e:
        raise ConfigError(
            f"the checkpoint in {source} does not fit this config ({e.summary()}); run with the config it was "
            f"saved with (config.yaml beside it) and, if it "
            f"was trained with an optimizer of your own, that optimizer, or start a fresh run in another "
            f"train.run_dir"
        ) from e
    return None, None
