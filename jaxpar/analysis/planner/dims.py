"""The planner's view of a step: the parameter table of a model config (derived from the model's abstract
shapes), how much of each leaf one device holds, and the step's sizes on a platform (letters as in
`jaxpar.analysis.planner.plan`). Shared by the memory plan (`jaxpar.analysis.planner.plan`), the collectives
(`jaxpar.analysis.planner.comm`) and the ZeRO table of a compiled step (`jaxpar.analysis.planner.memory`); no
compilation, no devices.

Expert parallelism (`model.moe.expert_axes`, a subset of data and fsdp; ep the product of their sizes): the routed
experts' weights (w_gate, w_up [E, D, F], w_down [E, F, D] of each MoE block, `Leaf.expert`) have their experts
dimension split over the expert axes (E/ep whole experts per device, F still over `tensor`) and their `embed`
dimension over the storage axes that are not expert axes only; the router and the shared experts are dense
parameters like any other (`local_size`).

Context parallelism (`mesh.context` c > 1, `jaxpar.parallel.context`): each device holds r = s/c tokens of every
sequence (its load-balanced slice), so every per-token size of the plan is r tokens, not s (`Dims.r`; s' = s/(c t)
between blocks under sequence parallelism, `Dims.s_act`); s stays the whole sequence, which attention's keys span.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax

from jaxpar.config.mesh_axes import CONTEXT, DATA, FSDP, MESH_AXES, PIPELINE, TENSOR
from jaxpar.config.precision import DTYPE_BYTES, check_platform, precision_layout, resolve_compute_dtype
from jaxpar.config.schema import Config, ModelConfig
from jaxpar.model import init_params, logical_axes
from jaxpar.model.flops import row_flops_per_token
from jaxpar.model.moe import EXPERTS_AXIS
from jaxpar.parallel import layer_split
from jaxpar.parallel.layer_split import StageLayout, stored_rows
from jaxpar.parallel.sharding import PARAM_RULES


def collective_bytes(dtype_bytes: int, platform: str) -> int:
    """Bytes per element that a collective of a float array `dtype_bytes` wide (2: bf16, 4: fp32) moves when
    compiled for `platform`: 4 for bf16 on cpu (XLA:CPU widens bf16 collectives to fp32,
    `jaxpar.analysis.planner.plan`), else `dtype_bytes`. Raises ValueError for an unknown platform."""
    return 4 if check_platform(platform) == "cpu" and dtype_bytes == 2 else dtype_bytes


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter array: path, global shape and logical axes (`jaxpar.model.logical_axes`)."""

    path: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]

    @property
    def in_blocks(self) -> bool:
        return self.axes[0] == "layers"

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def expert(self) -> bool:
        """A routed expert's weight (experts and mlp dimensions: w_gate, w_up, w_down of an MoE block), which
        expert parallelism splits over experts; the router [D, E] has no mlp dimension and is dense."""
        return EXPERTS_AXIS in self.axes and "mlp" in self.axes


@functools.lru_cache(maxsize=64)
def param_leaves(model: ModelConfig) -> tuple[Leaf, ...]:
    """The parameter table of the model `model.name` selects: every parameter's path, global shape and logical
    axes, derived from the model itself (`jax.eval_shape` of `jaxpar.model.init_params` and
    `jaxpar.model.logical_axes`: no FLOPs, no memory), in path order. Cached per `ModelConfig`.

    Raises:
      ValueError / TypeError: as `jaxpar.model.model_def` (an unregistered `model.name`, a model that does not
        follow `jaxpar.model.interface`).
    """
    shapes = jax.eval_shape(lambda: init_params(model, 0))
    axes = logical_axes(model)
    flat_axes = dict(jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))[0])
    leaves = []
    for path, shape in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        leaves.append(Leaf("/".join(str(k.key) for k in path), tuple(shape.shape), tuple(flat_axes[path])))
    return tuple(sorted(leaves, key=lambda leaf: leaf.path))


def local_size(
    leaf: Leaf, shape: dict[str, int], storage: tuple[str, ...] = (), expert_axes: tuple[str, ...] = ()
) -> int:
    """Elements of `leaf` on one device: every logical axis divided by the mesh axes `PARAM_RULES` maps it to,
    restricted to tensor and pipeline plus the `storage` axes (fsdp, data) the caller counts as sharding it. A
    routed expert's weight (`Leaf.expert`) with `expert_axes` (`model.moe.expert_axes`): its experts dimension
    divided by their sizes' product ep, its embed dimension by the `storage` axes that are not expert axes
    (module docstring); other leaves ignore `expert_axes`."""
    split = expert_axes if leaf.expert else ()
    total = 1
    for dim, name in zip(leaf.shape, leaf.axes):
        axes = [a for a in (PARAM_RULES[name] if name is not None else ()) if a in (TENSOR, PIPELINE)]
        if name == "embed":
            axes += [a for a in storage if a not in split]
        if name == EXPERTS_AXIS:
            axes += list(split)
        total *= -(-dim // math.prod(shape[a] for a in axes))  # ceil: shard_shape of an uneven split
    return total


@dataclasses.dataclass(frozen=True)
class Dims:
    """The step's sizes as the planner uses them (the letters of `jaxpar.analysis.planner.plan`)."""

    shape: dict
    zero: int
    b: int
    s: int  # the whole sequence (data.seq_len)
    r: int  # tokens of each sequence on one device: s / c under context parallelism, else s
    s_act: int  # s': tokens per device between blocks, r / t with sequence parallelism, else r
    sp: bool
    accum: int  # M
    m: int  # pipeline microbatches
    layers_per_stage: int
    compute_bytes: int  # Bc: bytes of the compute dtype (activations, gathered weights)
    reduce_bytes: int  # Br: bytes of precision.reduce_dtype (gradient reductions)
    param_bytes: int  # bytes of the working parameters (`jaxpar.config.precision.PrecisionLayout.param_bytes`)
    platform: str
    virtual: int = 1  # v: model chunks per device (interleaved 1F1B, pipeline.virtual_stages); 1 without
    expert_axes: tuple[str, ...] = ()  # model.moe.expert_axes (() for a dense model)
    layout: StageLayout | None = None  # an uneven split's stage layout (`jaxpar.parallel.layer_split`)
    row_layers: int = 1  # layers per row of the layer stack (model.moe.every for a mixture-of-experts stack)

    @property
    def c(self) -> int:
        """The context size: the devices each sequence is split over (1 without context parallelism)."""
        return self.shape.get(CONTEXT, 1)

    @property
    def ep(self) -> int:
        """Expert-parallel size: the product of the expert axes' sizes (1 without)."""
        return math.prod(self.shape[a] for a in self.expert_axes)

    @property
    def layers_per_chunk(self) -> int:
        """L/(pv): the layers of one model chunk, what one 1F1B tick runs forward or backward (L/p when v = 1);
        with an uneven split the stage layout's slot depth n_max (its padding rows skipped, but held)."""
        if self.layout is not None:
            return self.layout.n_max * self.row_layers
        return self.layers_per_stage // self.virtual

    def wire(self, dtype_bytes: int) -> int:
        """Bytes per element a collective of that dtype moves on this platform (`collective_bytes`)."""
        return collective_bytes(dtype_bytes, self.platform)


def dims(cfg: Config, platform: str) -> Dims:
    """Sizes of a resolved config (mesh without -1, `tensor.sequence_parallel` concrete) on `platform`.

    Raises:
      ValueError: the config is not resolved; platform not one of `jaxpar.config.precision.PLATFORMS`.
    """
    check_platform(platform)
    shape = {a: getattr(cfg.mesh, a) for a in MESH_AXES}
    if min(shape.values()) < 1:
        raise ValueError(f"config is not resolved (mesh {shape}); call jaxpar.config.resolve_config first")
    t, p = shape[TENSOR], shape[PIPELINE]
    sp = bool(cfg.tensor.sequence_parallel) and t > 1
    accum, m = cfg.train.grad_accum_steps, cfg.pipeline.microbatches
    b = cfg.train.global_batch_size // (shape[DATA] * shape[FSDP] * accum * m)
    s = cfg.data.seq_len
    r = s // shape[CONTEXT]  # this device's slice of each sequence
    return Dims(
        shape=shape,
        zero=cfg.optimizer.zero_stage,
        b=b,
        s=s,
        r=r,
        s_act=r // t if sp else r,
        sp=sp,
        accum=accum,
        m=m,
        # the layers each stage stores (the first dense blocks run with the embedding): the stack's rows rounded up
        # to a multiple of p (`jaxpar.parallel.layer_split.stored_rows`), in blocks
        layers_per_stage=stored_rows(cfg.model.stack_depth, p) // p * cfg.model.layers_per_unit,
        compute_bytes=DTYPE_BYTES[resolve_compute_dtype(cfg.precision.compute_dtype, platform)],
        reduce_bytes=DTYPE_BYTES[cfg.precision.reduce_dtype],
        param_bytes=precision_layout(cfg.precision.layout).param_bytes,
        platform=platform,
        virtual=cfg.pipeline.virtual_stages if p > 1 and cfg.pipeline.schedule != "gpipe" else 1,
        expert_axes=expert_axes(cfg),
        layout=stage_layout(cfg, p),
        row_layers=cfg.model.moe.every if cfg.model.moe.enabled else 1,
    )


def stage_layout(cfg: Config, p: int) -> StageLayout | None:
    """The stage layout of `cfg`'s uneven split on p stages (`jaxpar.parallel.layer_split.stage_layout`, rows
    costed by `jaxpar.model.flops.row_flops_per_token` of the model's parameter shapes), None for the even split."""
    shapes = lambda: jax.eval_shape(lambda: init_params(cfg.model, 0))  # noqa: E731
    return layer_split.stage_layout(cfg, p, lambda: row_flops_per_token(cfg, shapes()))


def expert_axes(cfg: Config) -> tuple[str, ...]:
    """`model.moe.expert_axes` of an MoE model, () for a dense one."""
    return tuple(cfg.model.moe.expert_axes) if cfg.model.moe.enabled else ()


def rank_params_split(model: ModelConfig, shape: dict[str, int], expert_axes: tuple[str, ...] = ()) -> tuple[int, int]:
    """P per tensor/pipeline rank in two parts, (dense, expert): the parameters one model-parallel rank holds
    before ZeRO's split (the ZeRO formulas apply to this P): leaves sharded over `tensor` (heads, MLP hidden,
    vocabulary) count 1/t, the stacked layers 1/p, replicated ones (the embedding and head are on every stage)
    fully (`local_size`); the expert part is the routed experts' weights (`Leaf.expert`), split 1/ep over
    `expert_axes`, 0 for a dense model. Their sum is the parameter count when tensor = pipeline = 1 and there are
    no expert axes. `shape`: mesh axis sizes."""
    leaves = param_leaves(model)
    expert = sum(local_size(x, shape, (), expert_axes) for x in leaves if x.expert)
    return sum(local_size(x, shape) for x in leaves if not x.expert), expert
