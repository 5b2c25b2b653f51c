"""Parameters as plain nested dicts, and the bridge between those dicts and the NNX `Transformer`.

The train state, the optimizer, checkpoints and sharding all see parameters as a nested dict of arrays
(`nnx.to_pure_dict`); `bind` turns such a dict (whole or sharded) back into a module for the forward pass.
"""
from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx

from jaxpar.config.schema import ModelConfig
from jaxpar.model.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """The static part of a model: its NNX graph definition and an abstract state to bind values into."""

    cfg: ModelConfig
    graphdef: nnx.GraphDef
    abstract_state: nnx.State

    def bind(self, params: dict) -> Transformer:
        """Returns a `Transformer` holding `params` (a nested dict shaped like `init_params`' output)."""
        state = jax.tree.map(lambda v: v, self.abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)


def model_def(cfg: ModelConfig) -> ModelDef:
    """Builds the model abstractly (no FLOPs, no memory) to get its structure."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    return ModelDef(cfg, graphdef, state)


def init_params(cfg: ModelConfig, seed: int) -> dict:
    """Initialises parameters (fp32) from `seed`. Pure: jit it with `out_shardings` to create them sharded.

    With `jax_threefry_partitionable` (the default in current jax) the values do not depend on the sharding,
    so every mesh layout starts from identical parameters.
    """
    return nnx.to_pure_dict(nnx.state(Transformer(cfg, nnx.Rngs(seed)), nnx.Param))


def logical_axes(cfg: ModelConfig) -> dict:
    """Nested dict mirroring the parameters whose leaves are tuples of logical axis names, one per dimension.

    Block parameters get a leading `layers` axis (the stacked dimension).
    """
    mdef = model_def(cfg)

    def names(path, var):
        axes = tuple(var.get_metadata()["logical_axes"])
        return ("layers",) + axes if path[0].key == "blocks" else axes

    state = nnx.state(nnx.merge(mdef.graphdef, mdef.abstract_state), nnx.Param)
    tagged = jax.tree_util.tree_map_with_path(names, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(tagged) if isinstance(tagged, nnx.State) else tagged


def param_count(params: dict) -> int:
    """Number of scalar parameters in a pytree of arrays or ShapeDtypeStructs."""
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))
