"""Parameters as plain nested dicts, and the bridge between those dicts and the model module.

The train state, the optimizer, checkpoints and sharding all see parameters as a nested dict of arrays
(`nnx.to_pure_dict`); `bind` turns such a dict (whole or sharded) back into a module for the forward pass. The
module is the family `model.name` selects (`jaxpar.model.registry`), checked against
`jaxpar.model.interface.LanguageModel` when its structure is first derived.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config.schema import ModelConfig
from jaxpar.model.interface import (
    LAYERS_AXIS,
    STACK_ATTRIBUTE,
    LanguageModel,
    check_model,
    takes_positions,
    takes_segment_ids,
)
from jaxpar.model.registry import model_family


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """The static part of a model: its NNX graph definition and an abstract state to bind values into."""

    cfg: ModelConfig
    graphdef: nnx.GraphDef
    abstract_state: nnx.State
    takes_segment_ids: bool = True  # run_blocks takes packed-document segment ids (jaxpar.model.interface)
    takes_positions: bool = True  # run_blocks takes context parallelism's positions_BT (jaxpar.model.interface)

    def logical_axes(self) -> dict:
        """Nested dict mirroring the parameters whose leaves are tuples of logical axis names, one per dimension.

        Parameters of the stacked `blocks` get a leading `layers` axis.
        """

        def names(path, var):
            axes = tuple(var.get_metadata()["logical_axes"])
            return (LAYERS_AXIS,) + axes if path[0].key == STACK_ATTRIBUTE else axes

        state = nnx.state(nnx.merge(self.graphdef, self.abstract_state), nnx.Param)
        tagged = jax.tree_util.tree_map_with_path(names, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        return nnx.to_pure_dict(tagged) if isinstance(tagged, nnx.State) else tagged

    def bind(self, params: dict) -> LanguageModel:
        """Returns the model module holding `params` (a nested dict shaped like `init_params`' output)."""
        state = jax.tree.map(lambda v: v, self.abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)


def build_model(cfg: ModelConfig, seed: int) -> LanguageModel:
    """The module of family `cfg.name` with parameters initialised from `seed` (fp32 on the default device).

    Raises:
      ValueError: `cfg.name` is not registered (`jaxpar.model.registry.model_family`), or the family refuses
        the config.
    """
    return model_family(cfg.name).build(cfg, nnx.Rngs(seed))


def model_def(cfg: ModelConfig) -> ModelDef:
    """Builds the model abstractly (no FLOPs, no memory) to get its structure, and checks it follows
    `jaxpar.model.interface` (raising TypeError / ValueError there, before any device work)."""
    abstract = nnx.eval_shape(lambda: build_model(cfg, 0))
    check_model(abstract, cfg.name, cfg.stack_depth, cfg.moe.enabled)
    graphdef, state = nnx.split(abstract)
    return ModelDef(cfg, graphdef, state, takes_segment_ids(abstract), takes_positions(abstract))


def init_params(cfg: ModelConfig, seed: int, stack_rows: int | None = None) -> dict:
    """Initialises parameters (fp32) from `seed`. Pure: jit it with `out_shardings` to create them sharded.

    With `jax_threefry_partitionable` (the default in current jax) the values do not depend on the sharding,
    so every mesh layout starts from identical parameters. `stack_rows`: store the layer stack with that many
    rows (`fit_stack`: zero rows after the last layer), None: `cfg.stack_depth`.
    """
    params = nnx.to_pure_dict(nnx.state(build_model(cfg, seed), nnx.Param))
    return params if stack_rows is None else fit_stack(params, stack_rows, cfg.stack_depth)


def fit_stack(params: dict, rows: int, depth: int) -> dict:
    """`params` with every leaf of the layer stack (`STACK_ATTRIBUTE`, leading dimension of the stack's rows)
    cut or padded with zero rows to `rows`: how a stack of `depth` layers is stored over pipeline stages that do
    not divide it (`jaxpar.parallel.layer_split.stored_rows`). Rows past `depth` hold no layer; they are zero
    and stay zero in training (a zero pre-norm residual block is the identity and gets zero gradients).
    Works on jax and numpy arrays alike (and on `jax.ShapeDtypeStruct`s under `jax.eval_shape`).

    Raises:
      ValueError: `rows` < `depth` (it would drop layers), or a stack leaf with fewer than `depth` rows.
    """
    if rows < depth:
        raise ValueError(f"a stack of {depth} layers cannot be stored in {rows} rows")
    if STACK_ATTRIBUTE not in params:
        return params

    def fit(a):
        have = a.shape[0]
        if have < depth:
            raise ValueError(f"a layer stack leaf of {have} rows holds fewer than the model's {depth} layers")
        if have == rows:
            return a
        if have > rows:
            return a[:rows]
        pad = [(0, rows - have)] + [(0, 0)] * (a.ndim - 1)
        return np.pad(a, pad) if isinstance(a, np.ndarray) else jnp.pad(a, pad)

    return {**params, STACK_ATTRIBUTE: jax.tree.map(fit, params[STACK_ATTRIBUTE])}


def logical_axes(cfg: ModelConfig) -> dict:
    """Nested dict mirroring the parameters whose leaves are tuples of logical axis names, one per dimension
    (`ModelDef.logical_axes` of `model_def(cfg)`)."""
    return model_def(cfg).logical_axes()
