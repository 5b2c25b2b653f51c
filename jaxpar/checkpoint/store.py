"""Save and restore the training state with Orbax: sharded arrays plus two JSON items.

A checkpoint directory holds one sub-directory per step, written by `orbax.checkpoint.CheckpointManager`:

    <directory>/<step>/state/    the state pytree (jax Arrays, optax states, int32 step), OCDBT/Zarr
    <directory>/<step>/data/     JSON: the data iterator position, e.g. {"next_sample": 123}
    <directory>/<step>/config/   JSON: the run config as a plain dict
    <directory>/<step>/format/   JSON: the format version and the jaxpar version that wrote it
                                 (`jaxpar.checkpoint.format`; a restore checks it before anything else)

Completeness. On a local or POSIX filesystem Orbax writes a step into `<step>.orbax-checkpoint-tmp`, writes
`commit_success.txt` into it, then renames it to `<step>` (Orbax's `AtomicRenameTemporaryPath`). By default Orbax's
step finder accepts any local directory whose name lacks the tmp suffix; this module also requires the
`commit_success.txt` marker (and gives Orbax's finder a `CommitFileTemporaryPath` step-name format, so its retention
count agrees), so a half-copied or hand-made step directory is never taken as a checkpoint. A writable
`Checkpointer` removes left-over tmp directories when it opens (`cleanup_tmp_directories=True`; done in the
background, awaited by the first save), so a step can be saved again after a crash mid-save.

Async failures. A background write failure is raised by the next `wait()`, `save()` or `close()`, once.
Restores check the target against the saved metadata first (`jaxpar.checkpoint.mismatch`): every leaf, and a
`CheckpointMismatchError` (a `ValueError`) carrying every difference.

Restoring onto a different mesh or layout is supported: every leaf of `abstract_state` is a
`jax.ShapeDtypeStruct` with a `.sharding`, and the arrays come back with exactly that sharding.

Optional entries (`OPTIONAL_ENTRIES`): top-level state entries that a run has or not by its settings, not its
model, and that hold statistics rather than parameters: FP8 delayed scaling's amax history ("fp8",
`jaxpar.training.fp8_history`). A step restores into a target that has such an entry when it holds the entry with
the target's shapes; otherwise (saved without one, or with another window or model) the target's entry starts
at zeros, its initial value. A saved entry the target lacks is read and dropped. Each case is logged.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxpar.checkpoint.format import FORMAT_ITEM, CheckpointFormatError, check_format, format_record
from jaxpar.checkpoint.mismatch import CheckpointMismatchError, check_target
from jaxpar.config.paths import directory_problem

_STATE, _DATA, _CONFIG = "state", "data", "config"
OPTIONAL_ENTRIES = ("fp8",)  # module docstring
# Orbax's notes on reading a checkpoint read-only, which say nothing wrong with it: the directory is read-only (we
# asked for that), and a step has no _CHECKPOINT_METADATA file (our steps commit with commit_success.txt instead).
_BENIGN_ORBAX_WARNINGS = ("Given directory is read only", "Metadata file does not exist")


class _DropBenignOrbaxWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_BENIGN_ORBAX_WARNINGS)


logging.getLogger("absl").addFilter(_DropBenignOrbaxWarnings())
_LOGGER = logging.getLogger("jaxpar.checkpoint")
# What TensorStore and Orbax append to a read error for the machine rather than the reader: TensorStore's whole
# spec as JSON ("[tensorstore_spec='{...}']"), the repr of a TensorStore object or of a bound method of one.
_MACHINE_DETAIL = re.compile(r"\s*(\[tensorstore_spec=|<bound method |TensorStore\()")
# A TensorStore status code leading its message (absl's canonical codes), and the array a read was for.
_STATUS = re.compile(r"^[A-Z][A-Z_]+: ")
_ARRAY = re.compile(r'Error reading "([^"/]+)/')
RUN_CHECKPOINT_DIR = "checkpoints"  # a run directory's checkpoint root: <run_dir>/checkpoints/<step>/
_STEP_NAME = re.compile(r"0|[1-9][0-9]*")  # Orbax's default step directory name: no prefix, no padding
_TMP_STEP = re.compile(r"(0|[1-9][0-9]*)\.orbax-checkpoint-tmp.*")  # a save interrupted or still in flight
_COMMIT_MARKER = ocp.path.atomicity_types.COMMIT_SUCCESS_FILE  # "commit_success.txt"


def _read_failure(error: BaseException) -> str:
    """What went wrong reading a step, in one line of plain words: e.g. "its array files are damaged (reading
    'step': Error decoding manifest: Encoded length (0) is less than minimum length (16))". The
    library's own detail (TensorStore's spec, object reprs) is left out; the full error is logged at debug level.
    """
    lines = str(error).strip().splitlines()
    text = _MACHINE_DETAIL.split(lines[0] if lines else "", maxsplit=1)[0].strip()
    if _STATUS.match(text):  # TensorStore: "CODE: outer context: ...: innermost cause"; keep the cause
        array = _ARRAY.search(text)
        cause = ": ".join(text.split(": ")[-2:])
        return f"its array files are damaged ({f'reading {array.group(1)!r}: ' if array else ''}{cause})"
    if isinstance(error, json.JSONDecodeError):
        return f"a metadata file of the step is not valid JSON ({text})"
    return f"{text or 'no message'} ({type(error).__name__})"


def _is_complete_step_dir(path: str) -> bool:
    """True if `path` is `<int>` (no tmp suffix) and holds Orbax's commit marker."""
    name = os.path.basename(os.path.normpath(path))
    if _STEP_NAME.fullmatch(name) is None or not os.path.isdir(path):
        return False
    return os.path.isfile(os.path.join(path, _COMMIT_MARKER))


def complete_steps(root: str) -> list[int]:
    """Steps with a complete (committed) checkpoint in checkpoint root `root`, ascending; [] if it is missing."""
    if not os.path.isdir(root):
        return []
    return sorted(int(n) for n in os.listdir(root) if _is_complete_step_dir(os.path.join(root, n)))


def _manager_options(every_steps: int, keep: int, async_save: bool, read_only: bool) -> ocp.CheckpointManagerOptions:
    """The Orbax manager's options for a `Checkpointer` (its arguments): nothing created before the first save,
    and a step found only once it holds the commit marker (module docstring)."""
    return ocp.CheckpointManagerOptions(
        # what Orbax sets for read_only itself (saying so at warning level when given anything else)
        max_to_keep=None if read_only else keep,
        save_interval_steps=0 if read_only else every_steps,
        enable_async_checkpointing=async_save,
        read_only=read_only,
        create=False,  # `save` creates the directory: a failed restore must not leave it behind
        cleanup_tmp_directories=not read_only,
        # Only for finding steps: a step counts once it holds commit_success.txt. Writing still uses the
        # default atomic rename of <step>.orbax-checkpoint-tmp.
        step_name_format=ocp.path.step.standard_name_format(
            temporary_path_cls=ocp.path.atomicity.CommitFileTemporaryPath
        ),
    )


def _check_has_shardings(abstract_state: Any) -> None:
    """Raises ValueError naming the leaves of a restore target that carry no `.sharding`."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
    missing = [jax.tree_util.keystr(p) for p, x in leaves if getattr(x, "sharding", None) is None]
    if missing:
        raise ValueError(f"abstract_state leaves need a .sharding (jax.ShapeDtypeStruct(..., sharding=...)): {missing}")


class Checkpointer:
    """Periodic, optionally asynchronous checkpoints of (state, data_state, config), keeping the last `keep`.

    Args:
      directory: checkpoint root; made absolute (Orbax requires it). Created by the first `save`, never before,
        so a run that fails before saving (a restore that does not fit, a missing restore path) leaves no empty
        directory behind.
      every_steps: save when `step % every_steps == 0` (or on a preemption signal); >= 1.
      keep: number of most recent checkpoints kept; older ones are deleted after a newer one commits; >= 1.
      async_save: write arrays in a background thread; `save` returns once device buffers are copied to host.
      read_only: only restore; never create, save, delete, or clean up tmp directories (`Checkpointer.read_only`
        makes one).

    Raises:
      ValueError: `every_steps` or `keep` < 1.

    All processes of a multi-process run must call `save`/`restore`/`wait` (Orbax syncs them); the directory must
    be shared.
    """

    def __init__(
        self, directory: str, *, every_steps: int, keep: int, async_save: bool = True, read_only: bool = False
    ):
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.every_steps = every_steps
        self._read_only = read_only
        self._manager = ocp.CheckpointManager(
            self.directory,
            item_handlers={
                _STATE: ocp.StandardCheckpointHandler(),
                _DATA: ocp.JsonCheckpointHandler(),
                _CONFIG: ocp.JsonCheckpointHandler(),
                FORMAT_ITEM: ocp.JsonCheckpointHandler(),
            },
            options=_manager_options(every_steps, keep, async_save, read_only),
        )
        # Newest step saved or in flight; should_save reads this, not the filesystem, each step.
        self._last_saved: int | None = self.latest_step()

    @classmethod
    def read_only(cls, directory: str) -> Checkpointer:
        """A Checkpointer of `directory` that only restores (synchronous; never creates, saves, deletes or cleans
        up anything there): how a checkpoint is read outside the run that writes it. Close it after use."""
        return cls(directory, every_steps=1, keep=1, async_save=False, read_only=True)

    def all_steps(self) -> list[int]:
        """Steps with a complete (committed) checkpoint on disk, ascending; [] if the directory is missing."""
        return complete_steps(self.directory)

    def latest_step(self) -> int | None:
        """Latest complete checkpoint step on disk, or None. An in-flight async save is not counted until it commits."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """True if `step % every_steps == 0` (or a preemption was signalled) and `step` is newer than any save so far,
        including one still in flight."""
        if self._last_saved is not None and step <= self._last_saved:
            return False
        return step % self.every_steps == 0 or self._manager.reached_preemption(step)

    def save(self, step: int, state: Any, *, data_state: dict, config: dict, force: bool = False) -> bool:
        """Save `state` (pytree of jax Arrays) and the JSON dicts `data_state`, `config` as step `step`.

        Returns:
          True if a save was started; False if `should_save(step)` is False and not `force`.
        Raises:
          orbax.checkpoint.checkpoint_manager.StepAlreadyExistsError (a ValueError): the step was already saved.
          TypeError: `data_state` or `config` is not JSON-serialisable.
          Any failure of the previous async save (Orbax waits for it first).
        """
        if not force and not self.should_save(step):
            return False
        for name, item in ((_DATA, data_state), (_CONFIG, config)):
            try:  # fail here, not later in Orbax's background thread
                json.dumps(item)
            except TypeError as e:
                raise TypeError(f"checkpoint item {name!r} is not JSON-serialisable: {e}") from e
        args = ocp.args.Composite(
            **{
                _STATE: ocp.args.StandardSave(state),
                _DATA: ocp.args.JsonSave(data_state),
                _CONFIG: ocp.args.JsonSave(config),
                FORMAT_ITEM: ocp.args.JsonSave(format_record()),
            }
        )
        if not self._read_only:  # every process (a shared directory): exist_ok makes concurrent creation safe
            os.makedirs(self.directory, exist_ok=True)
        saved = bool(self._manager.save(step, args=args, force=True))
        if saved:
            self._last_saved = step if self._last_saved is None else max(step, self._last_saved)
        return saved

    def restore(self, step: int | None, abstract_state: Any) -> tuple[Any, dict, dict]:
        """Restore step `step` (None: the latest complete one) onto `abstract_state`'s shapes, dtypes and shardings.

        With `step=None`, a latest step that cannot be read (a corrupted file, a truncated array) is skipped and
        the next older complete step is tried. Once an older step restores, each skipped one is reported in one
        warning line (logger "jaxpar.checkpoint": the step and the cause in plain words, the full error at debug
        level) and, by a writable Checkpointer, renamed to `<step>.corrupt` (kept for inspection, never taken as
        a checkpoint again, no longer blocking a new save of that step). If no step restores, nothing is renamed
        and the latest step's error is raised.

        Args:
          abstract_state: pytree of `jax.ShapeDtypeStruct` with `.sharding`, same structure as the saved state.
        Returns:
          (state, data_state, config): the state's arrays carry exactly the target shardings.
        Raises:
          FileNotFoundError: no complete checkpoint (for `step`) in the directory.
          CheckpointFormatError (a ConfigError): the step's format version is one this jaxpar does not read
            (checked before its arrays; with `step=None` the newest step decides, nothing is set aside).
          CheckpointMismatchError (a ValueError): structure, shape or dtype mismatch (`.differences` names the
            keys, `.path` and `.step` the checkpoint).
          ValueError: leaves without sharding.
          Whatever reading raised, for an explicit `step`, or for the latest step when no step is readable.
        """
        _check_has_shardings(abstract_state)
        if step is not None:
            return self._restore_step(step, abstract_state)
        return self._restore_latest(abstract_state)

    def _restore_latest(self, abstract_state: Any) -> tuple[Any, dict, dict]:
        """`restore(None, ...)`: the newest readable complete step, setting aside the unreadable newer ones."""
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        unreadable: list[tuple[int, Exception]] = []
        for candidate in reversed(steps):
            try:
                restored = self._restore_step(candidate, abstract_state)
            except (CheckpointMismatchError, CheckpointFormatError):  # readable, but not by this target or jaxpar
                raise
            except Exception as e:  # noqa: BLE001 - any read failure makes this step unusable
                unreadable.append((candidate, e))
                continue
            for bad, error in unreadable:  # an older step fits the target, so these are damaged, not mismatched
                _LOGGER.warning(
                    "checkpoint step %d in %s cannot be read: %s; fell back to step %d%s",
                    bad,
                    self.directory,
                    _read_failure(error),
                    candidate,
                    "" if self._read_only else f" (the damaged step is kept as {bad}.corrupt)",
                )
                _LOGGER.debug("checkpoint step %d: the read error in full", bad, exc_info=error)
                self._set_aside(bad)
            return restored
        raise unreadable[0][1]

    def _restore_step(self, step: int, abstract_state: Any) -> tuple[Any, dict, dict]:
        step_dir = os.path.join(self.directory, str(step))
        if not _is_complete_step_dir(step_dir):
            raise FileNotFoundError(missing_step_message(self.directory, step, self.all_steps()))
        check_step_format(step_dir)
        saved = self._manager.item_metadata(step)[_STATE]
        saved_tree = saved.tree if hasattr(saved, "tree") else saved
        target, fresh = _optional_entries(saved_tree, abstract_state, step)
        # a layer stack stored over other pipeline stages comes back cut or zero-padded to the target's rows
        resized = check_target(saved_tree, target, os.path.join(step_dir, _STATE), step)
        args = ocp.args.Composite(
            **{
                _STATE: ocp.args.StandardRestore(target, strict=not resized),
                _DATA: ocp.args.JsonRestore(),
                _CONFIG: ocp.args.JsonRestore(),
            }
        )
        restored = self._manager.restore(step, args=args)
        state = restored[_STATE]
        if isinstance(state, dict):  # the optional entries as the target has them
            state = {k: v for k, v in state.items() if k not in OPTIONAL_ENTRIES or k in fresh}
            state.update({k: _zeros_like(v) for k, v in fresh.items() if v is not None})
        return state, dict(restored[_DATA]), dict(restored[_CONFIG])

    def _set_aside(self, step: int) -> None:
        """Renames an unreadable step directory to `<step>.corrupt` (process 0; all processes then agree)."""
        if self._read_only:
            return
        if jax.process_index() == 0:
            source = os.path.join(self.directory, str(step))
            target = f"{source}.corrupt"
            suffix = 1
            while os.path.exists(target):
                target, suffix = f"{source}.corrupt{suffix}", suffix + 1
            os.rename(source, target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"jaxpar_set_aside_{step}")
        self._manager.reload()
        self._last_saved = self.latest_step()

    def wait(self) -> None:
        """Block until async saves have committed (and old steps are deleted); re-raise a background save failure.

        Orbax raises a given background failure once; later calls return normally.
        """
        try:
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        finally:  # nothing is in flight any more: a failed step no longer blocks `should_save`
            self._last_saved = self.latest_step()

    def close(self) -> None:
        """Wait for pending saves (re-raising their failure), then release Orbax's threads."""
        self._manager.close()


def _optional_entries(saved_tree: Any, abstract_state: Any, step: int) -> tuple[Any, dict]:
    """(the restore target for a step holding `saved_tree`, {entry: the target's abstract subtree to start at zeros,
    or None to keep the restored one}) for the `OPTIONAL_ENTRIES` (module docstring). A saved entry that is not
    restored as it is gets a placeholder target of its own shapes, replicated, and is dropped after reading."""
    if not isinstance(saved_tree, dict) or not isinstance(abstract_state, dict):
        return abstract_state, {}
    target, fresh = dict(abstract_state), {}
    shardings = [a.sharding for a in jax.tree.leaves(abstract_state)]
    meshes = [s.mesh for s in shardings if isinstance(s, jax.sharding.NamedSharding)]
    replicated = jax.sharding.NamedSharding(meshes[0], jax.sharding.PartitionSpec()) if meshes else shardings[0]

    def placeholder(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), tree)

    def shapes(tree):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return [(jax.tree_util.keystr(k), tuple(a.shape), str(jax.numpy.dtype(a.dtype))) for k, a in leaves]

    for key in OPTIONAL_ENTRIES:
        has_saved, wanted = key in saved_tree, key in abstract_state
        if not has_saved and not wanted:
            continue
        if not has_saved:
            _LOGGER.info("checkpoint step %d holds no %r entry: this run's starts empty (zeros)", step, key)
            del target[key]
            fresh[key] = abstract_state[key]
        elif not wanted:
            _LOGGER.info("checkpoint step %d holds an %r entry this run does not keep: it is not restored", step, key)
            target[key] = placeholder(saved_tree[key])
        elif shapes(saved_tree[key]) != shapes(abstract_state[key]):
            _LOGGER.warning(
                "checkpoint step %d holds an %r entry of other shapes (%s) than this run's (%s), e.g. another "
                "precision.fp8.amax_history: this run's starts empty (zeros)",
                step,
                key,
                shapes(saved_tree[key]),
                shapes(abstract_state[key]),
            )
            target[key] = placeholder(saved_tree[key])
            fresh[key] = abstract_state[key]
        else:
            fresh[key] = None
    return target, fresh


def _zeros_like(abstract: Any) -> Any:
    """Zeros of each `jax.ShapeDtypeStruct` leaf's shape and dtype, with its sharding (one jitted program: every
    process of a multi-host run computes its own shards)."""

    def zeros(a):
        return jax.jit(lambda: jax.numpy.zeros(a.shape, a.dtype), out_shardings=a.sharding)()

    return jax.tree.map(zeros, abstract)


def read_json_item(step_dir: str, item: str) -> dict | None:
    """A JSON item of a step (`data`, `config` or `format`), or None when the step has none."""
    directory = os.path.join(step_dir, item)
    if not os.path.isdir(directory):
        return None
    return dict(ocp.JsonCheckpointHandler().restore(epath.Path(directory)))


def check_step_format(step_dir: str) -> int:
    """The format version of the step at `step_dir` (`jaxpar.checkpoint.format`): what every restore checks
    before it reads the step's config or arrays.

    Raises:
      CheckpointFormatError: a version this jaxpar does not read, naming it and the versions it reads.
    """
    return check_format(read_json_item(step_dir, FORMAT_ITEM), step_dir)


def missing_step_message(root: str, step: int | None, steps: list[int]) -> str:
    """Why checkpoint root `root` gives no step `step` (None: any step), naming its complete `steps` and how to
    pick one."""
    if not steps:
        return f"no complete checkpoint in {root}"
    return (
        f"no complete checkpoint for step {step} in {root}; its complete steps are {', '.join(map(str, steps))}: "
        f"give one step's directory (e.g. {os.path.join(root, str(steps[-1]))}) or {root} itself for the latest"
    )


def resolve_checkpoint_path(path: str) -> tuple[str, int | None]:
    """Maps a run dir, a checkpoint root or one step dir to (absolute checkpoint root, step or None).

    A step dir is recognised by its name (`<int>`) and a `state/` sub-directory or commit marker; a run dir by
    its `RUN_CHECKPOINT_DIR` sub-directory; anything else is taken as a checkpoint root.

    Raises:
      FileNotFoundError: `path` does not exist or is not a directory, or is an Orbax temporary step directory
        (an unfinished save, never a checkpoint; the message names its parent).
    """
    path = os.path.abspath(os.fspath(path))
    problem = directory_problem(path)
    if problem is not None:
        raise FileNotFoundError(
            f"checkpoint path {path} {problem}; pass a run directory (holding {RUN_CHECKPOINT_DIR}/), its "
            f"{RUN_CHECKPOINT_DIR}/ directory or one of its step directories"
        )
    name = os.path.basename(path)
    if _TMP_STEP.fullmatch(name):
        raise FileNotFoundError(
            f"{path} is an unfinished save (Orbax temporary directory), not a checkpoint; pass "
            f"its parent {os.path.dirname(path)} to use the complete steps"
        )
    if _STEP_NAME.fullmatch(name) and (
        os.path.isdir(os.path.join(path, _STATE)) or os.path.isfile(os.path.join(path, _COMMIT_MARKER))
    ):
        return os.path.dirname(path), int(name)
    run_checkpoints = os.path.join(path, RUN_CHECKPOINT_DIR)
    if os.path.isdir(run_checkpoints):
        return run_checkpoints, None
    return path, None


def restore_from_path(path: str, abstract_state: Any) -> tuple[Any, dict, dict]:
    """Restore (state, data_state, config) from a run directory or checkpoint root (latest step), or one step
    directory `.../<step>` (`resolve_checkpoint_path`).

    Raises:
      FileNotFoundError: `path` does not exist, is an unfinished save, or holds no complete checkpoint.
      CheckpointFormatError, CheckpointMismatchError, ValueError: as `Checkpointer.restore`.
    """
    root, step = resolve_checkpoint_path(path)
    ckpt = Checkpointer.read_only(root)
    try:
        return ckpt.restore(step, abstract_state)
    finally:
        ckpt.close()
