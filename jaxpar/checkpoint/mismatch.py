"""What a restore checks before reading: the checkpoint's arrays against the restore target, leaf by leaf.

Every leaf is compared, including the empty nodes of optax states (an `EmptyState`, None, {}), by Orbax's dotted
leaf names; a difference in presence, structure, shape or dtype is an `ArrayDifference`, and all of them together
a `CheckpointMismatchError` (a `ValueError`). Orbax's own shape error does not name the key, and it silently casts
dtypes, so `jaxpar.checkpoint.store` checks first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxpar.config.schema import STACK_ATTRIBUTE

EMPTY = "empty"  # a node without arrays (an optax state such as EmptyState, None, {}), as a leaf of `_flat_leaves`


def _flat_leaves(tree: Any) -> dict[str, tuple[tuple[int, ...], str] | str]:
    """Orbax's dotted leaf names ("opt_state.0.mu.w") -> (shape, dtype name) for arrays, `EMPTY` for nodes that
    hold none; the same for a restore target and for a checkpoint's metadata."""
    out: dict = {}

    def walk(x: Any, path: str) -> None:
        if hasattr(x, "shape"):
            out[path] = (tuple(int(n) for n in x.shape), str(jax.numpy.dtype(x.dtype)))
        elif isinstance(x, dict) and x:
            for k, v in x.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(x, (list, tuple)) and len(x):
            for i, v in enumerate(x):
                walk(v, f"{path}.{i}" if path else str(i))
        else:
            out[path] = EMPTY

    walk(ocp.tree.serialize_tree(tree, keep_empty_nodes=True), "")
    return out


@dataclasses.dataclass(frozen=True)
class ArrayDifference:
    """One leaf on which a checkpoint and a restore target disagree.

    Attributes:
      key: Orbax's dotted name of the leaf, e.g. "params.blocks.attn.wk".
      saved, target: (shape, dtype name) of the array on that side, `EMPTY` for a node without arrays, None
        where that side has no such key.
    """

    key: str
    saved: tuple[tuple[int, ...], str] | str | None
    target: tuple[tuple[int, ...], str] | str | None

    def __str__(self) -> str:
        s, t = self.saved, self.target
        if s is None:
            return f"{self.key}: in the target, missing from the checkpoint"
        if t is None:
            return f"{self.key}: in the checkpoint, missing from the target"
        if s == EMPTY or t == EMPTY:
            return (
                f"{self.key}: {'no array' if s == EMPTY else 'an array'} in the checkpoint, "
                f"{'no array' if t == EMPTY else 'an array'} in the target"
            )
        parts = [f"checkpoint shape {s[0]} != target shape {t[0]}"] if s[0] != t[0] else []
        parts += [f"checkpoint dtype {s[1]} != target dtype {t[1]}"] if s[1] != t[1] else []
        return f"{self.key}: {'; '.join(parts)}"


class CheckpointMismatchError(ValueError):
    """The checkpoint is readable but its arrays do not fit the restore target (another model or optimizer).

    Attributes:
      path: the step's state directory; step: its step.
      differences: every `ArrayDifference`, sorted by key (presence, structure, shape or dtype).
    """

    def __init__(self, path: str, step: int, differences: Sequence[ArrayDifference]):
        self.path, self.step, self.differences = path, step, tuple(differences)
        super().__init__(
            f"checkpoint {path} does not match the restore target:\n" + "\n".join(f"  {d}" for d in self.differences)
        )

    def __reduce__(self):  # keeps the fields through pickling (multiprocessing, pytest-xdist)
        return type(self), (self.path, self.step, self.differences)

    def summary(self, examples: int = 3) -> str:
        """ "N arrays differ, e.g. A; B; C", the parameters' differences first (they say most about the model)."""
        first = sorted(self.differences, key=lambda d: not d.key.startswith("params."))[:examples]
        return f"{len(self.differences)} arrays differ, e.g. {'; '.join(map(str, first))}"


def stack_rows_differ(key: str, saved: Any, target: Any) -> bool:
    """Whether leaf `key` is a leaf of the layer stack (a `STACK_ATTRIBUTE` segment in its dotted name: the
    parameters, the fp32 master copy, the optimizer's moments) whose saved and target (shape, dtype) differ only
    in the leading dimension, the stack's rows: a stack stored over another number of pipeline stages, with
    another count of zero rows after its last layer (`jaxpar.parallel.layer_split.stored_rows`)."""
    if STACK_ATTRIBUTE not in key.split(".") or not (isinstance(saved, tuple) and isinstance(target, tuple)):
        return False
    (s_shape, s_dtype), (t_shape, t_dtype) = saved, target
    return s_dtype == t_dtype and len(s_shape) == len(t_shape) >= 1 and s_shape[1:] == t_shape[1:]


def check_target(saved_tree: Any, abstract_state: Any, path: str, step: int) -> bool:
    """Raise CheckpointMismatchError with every key whose presence, structure, shape or dtype differs between the
    checkpoint's metadata (`saved_tree`, of the step's state at `path`) and the target, but the layer stack's
    rows (`stack_rows_differ`: the same model's stack stored over other pipeline stages; the caller restores it
    cut or zero-padded, which drops or adds only zero rows when the models are the same, as a restore checks
    first: `jaxpar.config.resume.check_restored_model`). Returns whether any stack leaf's rows differ."""
    saved, want = _flat_leaves(saved_tree), _flat_leaves(abstract_state)
    keys = [k for k in sorted(saved.keys() | want.keys()) if saved.get(k) != want.get(k)]
    resized = [k for k in keys if stack_rows_differ(k, saved.get(k), want.get(k))]
    differences = [ArrayDifference(k, saved.get(k), want.get(k)) for k in keys if k not in resized]
    if differences:
        raise CheckpointMismatchError(path, step, differences)
    return bool(resized)
