"""The stacked layer axis every jaxpar model shares: blocks created with `nnx.vmap`, run with `jax.lax.scan`.

Shape letters: B batch, T sequence (T/t under sequence parallelism), D model width, L layers.

Every parameter of a model's `blocks` has a leading `layers` dimension of size L. Compile time does not grow with
depth, and the pipeline splits the stack into stages by sharding that dimension over the `pipeline` mesh axis:
inside the train step each stage's module holds L / pipeline layers and `scan_layers` runs just those.

Parallelism enters through one hook: `gather(module) -> module`, applied to each layer right before it runs. On
one device it is the identity; inside the train step's `shard_map` it all-gathers the layer's fsdp-sharded
weights (`jaxpar.parallel.gather`), and its transpose reduce-scatters their gradients.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Literal, overload

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config.choices import REMAT_KEEPING_EXITS_ONLY, REMAT_POLICIES, REMAT_RECOMPUTING_EXPERTS
from jaxpar.parallel.expert import EXPERT_COMBINED, EXPERT_DISPATCHED
from jaxpar.parallel.fp8 import layer_scales
from jaxpar.parallel.gather import Gather, ModuleT
from jaxpar.parallel.tensor import NO_TENSOR_PARALLEL, TENSOR_GATHERED, TENSOR_REDUCED, TensorParallel

# Checkpoint names of the activations the `names` remat policy keeps: the inputs of the row-parallel projections
# (tag them with `jax.ad_checkpoint.checkpoint_name` in a model's blocks).
ATTENTION_CONTEXT = "attention_context"
MLP_HIDDEN = "mlp_hidden"


def no_gather(module: ModuleT) -> ModuleT:
    """The `Gather` of one device: the module as it is."""
    return module


_policies = jax.checkpoint_policies
# The outputs of the tensor-parallel collectives (`jaxpar.parallel.tensor`): TENSOR_REDUCED, each block exit's
# all-reduce or reduce-scatter, and TENSOR_GATHERED, each sequence-parallel enter's all-gather. A policy that does
# not save them makes the backward re-run those collectives to rebuild the forward, which the compiler-chosen
# partitioning of the same model (`jaxpar.analysis.bench.baselines.compiler_chosen_step`) does not do for the
# matmul outputs it keeps: with remat dots and no saved outputs the explicit step moved 1.24x its bytes over
# `tensor` (1.36x with sequence parallelism) on the llama_1b shape. So:
#   * none and dots save both: the backward re-runs no tensor collective (the compiler-chosen program with these
#     policies re-runs none either).
#   * names and full save TENSOR_REDUCED only (b*s'*D per layer, s' = s/t with sequence parallelism): the
#     backward re-runs no exit, but with sequence parallelism it re-gathers both block inputs, as Megatron does
#     (Korthikanti et al. 2022, section 4.2.2), instead of keeping 2*b*s*D per layer (t block inputs). The
#     compiler-chosen program with these policies re-runs the attention's all-reduce, which moves the same ring
#     bytes as the two all-gathers: without sequence parallelism the explicit step moves less, with it the same.
# The all-gathered weights of FSDP / ZeRO-3 (`jaxpar.parallel.gather`) carry no name: they are re-gathered in the
# backward instead of being kept.
# The expert-parallel all-to-alls (`jaxpar.parallel.expert`): none and dots save both their outputs (the backward
# re-runs no all-to-all of the forward), names saves EXPERT_COMBINED, the MoE block's counterpart of an exit (the
# backward re-runs the dispatch once). full saves neither (`REMAT_RECOMPUTING_EXPERTS`): the combine's output is k
# (dropless) or k * capacity_factor (capacity) times the block input, so keeping it undoes what full is for; its
# backward re-runs dispatch and combine. Measured with the GPU compiler (deviceless, H100), temporaries per device
# keeping -> not keeping it: configs/mixtral_8x7b.yaml (dropless, k=2) 35.2 -> 30.3 GB; configs/deepseek_v3.yaml
# at capacity routing (k=8, capacity_factor 1.25) 99.9 -> 27.8 GB.
_EXITS = (TENSOR_REDUCED, EXPERT_COMBINED)
_COLLECTIVES = (TENSOR_REDUCED, TENSOR_GATHERED, EXPERT_DISPATCHED, EXPERT_COMBINED)

# What saving them costs, measured on 8 H100s compiled without a GPU (configs/llama_1b.yaml shape, data=2 x
# tensor=4, ZeRO-1, bf16, 8 x 4096 tokens; `python benchmarks/tensor_bytes.py --target h100:1x8` prints
# the table): XLA's temporary bytes per device, before -> with the saved outputs, without / with sequence
# parallelism (the compiler-chosen program in brackets), and the ring bytes over `tensor` per step:
#   none   74.73 -> 73.75 GB / 75.21 -> 74.24 GB  (73.75)  6.64 -> 6.64 GB (the policy without the saved outputs
#                                                          also kept each layer's weights as scan residuals)
#   dots   12.28 -> 12.27 GB / 11.53 -> 12.72 GB  (12.03)  8.25 / 9.06 -> 6.64 GB (compiler 6.64)
#   names   9.86 -> 10.94 GB /  9.10 -> 9.37 GB   (9.64)   8.25 / 9.06 -> 6.64 / 8.25 GB (compiler 8.25)
#   full    8.52 ->  9.59 GB /  7.76 -> 8.02 GB   (8.36)   8.25 / 9.06 -> 6.64 / 8.25 GB (compiler 8.25)


def _collectives_saved(remat: str) -> tuple[str, ...]:
    """The collective outputs policy `remat` keeps: the exits' only (`REMAT_KEEPING_EXITS_ONLY`), without the MoE
    combine's under `REMAT_RECOMPUTING_EXPERTS`, or all."""
    if remat in REMAT_RECOMPUTING_EXPERTS:
        return (TENSOR_REDUCED,)
    return _EXITS if remat in REMAT_KEEPING_EXITS_ONLY else _COLLECTIVES


# model.remat (`jaxpar.config.choices.REMAT_POLICIES`) -> its `jax.checkpoint` policy.
CHECKPOINT_POLICIES = {
    # Every matmul output and tensor-collective output is saved, so neither is recomputed; elementwise ops
    # (norms, rotary, gates) are recomputed, and so are the all-gathered weights. (A "save everything except the
    # gathered weights" policy keeps them anyway: a cast or reshape of a gathered weight is saveable.)
    "none": _policies.save_from_both_policies(
        _policies.dots_saveable, _policies.save_only_these_names(*_collectives_saved("none"))
    ),
    # Recompute the whole block in the backward from its input, except the exits' reduced outputs.
    "full": _policies.save_only_these_names(*_collectives_saved("full")),
    # Save matmul outputs without batch dimensions and the tensor collectives' outputs, recompute the rest.
    "dots": _policies.save_from_both_policies(
        _policies.dots_with_no_batch_dims_saveable, _policies.save_only_these_names(*_collectives_saved("dots"))
    ),
    # Save only the named activations: ATTENTION_CONTEXT and MLP_HIDDEN (the inputs of the row-parallel
    # projections) and the exits' reduced outputs; the backward recomputes the rest of the block but not the
    # attention itself.
    "names": _policies.save_only_these_names(ATTENTION_CONTEXT, MLP_HIDDEN, *_collectives_saved("names")),
}
if set(CHECKPOINT_POLICIES) != set(REMAT_POLICIES):
    raise ImportError(
        f"checkpoint policies {sorted(CHECKPOINT_POLICIES)} differ from jaxpar.config.choices.REMAT_POLICIES "
        f"{REMAT_POLICIES}"
    )


def stack_layers(n_layers: int, make_layer: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs) -> nnx.Module:
    """Creates `n_layers` layers as one module whose every parameter has a leading `layers` dimension.

    Args:
      n_layers: L, the stack's depth.
      make_layer: builds one layer from its own `nnx.Rngs` (each layer draws different initial values).
      rngs: the model's generator; split L ways.
    """

    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(layer_rngs: nnx.Rngs) -> nnx.Module:
        return make_layer(layer_rngs)

    return make(rngs)


def run_layer(
    layer: nnx.Module,
    x_BTD: jax.Array,
    remat: str,
    gather: Gather = no_gather,
    tp: TensorParallel = NO_TENSOR_PARALLEL,
    segment_ids_BT: jax.Array | None = None,
    positions_BT: jax.Array | None = None,
) -> jax.Array:
    """One layer outside a stack (e.g. `model.moe.first_dense`'s dense blocks) as `scan_layers` runs each row:
    gathered (`gather`) inside and checkpointed with `CHECKPOINT_POLICIES[remat]`, so its backward keeps what a
    stacked layer keeps. x [B, T, D] -> [B, T, D]; segment ids and positions as `scan_layers`.

    Raises:
      KeyError: `remat` is not one of `jaxpar.config.choices.REMAT_POLICIES`.
    """
    graphdef, state = nnx.split(layer)

    def body(x, state):
        return gather(nnx.merge(graphdef, state))(x, tp, segment_ids_BT, positions_BT)

    return jax.checkpoint(body, policy=CHECKPOINT_POLICIES[remat], prevent_cse=False)(x_BTD, state)


ACTIVE_ROWS_SCOPE = "active_rows"  # the name scope of `active_rows`' skip conds
# The stage layout's mask of an uneven pipeline split (`active_rows`): [mask, whether a scan read it].
_ACTIVE_ROWS: contextvars.ContextVar[list | None] = contextvars.ContextVar("jaxpar_active_rows", default=None)


@contextlib.contextmanager
def active_rows(mask: jax.Array) -> Iterator[list]:
    """Within the block, `scan_layers` runs only the rows of the stack where `mask` (fp32 [rows of the stack])
    is nonzero; at the others the layer is the identity (its aux zeros), skipped in a `jax.lax.cond`, so a
    skipped row costs no FLOPs (forward or backward). The pipeline's uneven split pads each stage's stack to a
    common depth with such rows (`jaxpar.parallel.layer_split`).

    Yields a list whose element 0 is the mask and element 1 turns True once a scan has read it (so that a
    caller can tell a model whose blocks do not run through `scan_layers`, which would ignore the mask)."""
    state = [mask, False]
    token = _ACTIVE_ROWS.set(state)
    try:
        yield state
    finally:
        _ACTIVE_ROWS.reset(token)


# Under FP8 delayed scaling, the scales of this stack's rows (`fp8_stack_scales`): [scales, whether a scan read it].
_FP8_SCALES: contextvars.ContextVar[list | None] = contextvars.ContextVar("jaxpar_fp8_stack_scales", default=None)


@contextlib.contextmanager
def fp8_stack_scales(scales_LO3: jax.Array, probes_LO3: jax.Array) -> Iterator[list]:
    """Within the block, `scan_layers` runs row l of the stack with its FP8 GEMMs' delayed scales
    `scales_LO3[l]` and amax probes `probes_LO3[l]` (fp32 [rows of the stack, O FP8 GEMMs, 3 operands],
    `jaxpar.parallel.fp8.layer_scales`), and checks that each row runs exactly O of them. Yields
    [(scales, probes), whether a scan read them] (as `active_rows`)."""
    state = [(scales_LO3, probes_LO3), False]
    token = _FP8_SCALES.set(state)
    try:
        yield state
    finally:
        _FP8_SCALES.reset(token)


@overload
def scan_layers(
    layers: nnx.Module,
    x_BTD: jax.Array,
    remat: str,
    gather: Gather = ...,
    tp: TensorParallel = ...,
    segment_ids_BT: jax.Array | None = ...,
    with_aux: Literal[False] = ...,
    positions_BT: jax.Array | None = ...,
) -> jax.Array: ...


@overload
def scan_layers(
    layers: nnx.Module,
    x_BTD: jax.Array,
    remat: str,
    gather: Gather = ...,
    tp: TensorParallel = ...,
    segment_ids_BT: jax.Array | None = ...,
    *,
    with_aux: Literal[True],
    positions_BT: jax.Array | None = ...,
) -> tuple[jax.Array, dict]: ...


def scan_layers(
    layers: nnx.Module,
    x_BTD: jax.Array,
    remat: str,
    gather: Gather = no_gather,
    tp: TensorParallel = NO_TENSOR_PARALLEL,
    segment_ids_BT: jax.Array | None = None,
    with_aux: bool = False,
    positions_BT: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, dict]:
    """Runs a stack made by `stack_layers` over activations [B, T, D]: x = layer(x, tp) for each layer in order,
    or x = layer(x, tp, segment_ids_BT) when packed-document segment ids (int32 [B, T]) are given, and
    x = layer(x, tp, segment_ids_BT, positions_BT) when rotary positions (int32 [B, T]) are given too (context
    parallelism, `jaxpar.model.layers.Attention`).

    Each layer is gathered (`gather`) inside the scan body and checkpointed with `CHECKPOINT_POLICIES[remat]`.
    With `with_aux` each layer returns (x, aux), a pytree of arrays (e.g. a mixture-of-experts block's router
    statistics, `jaxpar.model.moe`), and the result is (x, aux stacked on a leading dimension of size L).

    Inside `active_rows(mask)` the rows where the mask is 0 are skipped (the identity, aux zeros). Inside
    `fp8_stack_scales(scales)` each row's FP8 GEMMs quantise with that row's delayed scales.

    Raises:
      KeyError: `remat` is not one of `jaxpar.config.choices.REMAT_POLICIES`.
      ValueError: inside `active_rows`, a mask whose length is not the stack's depth; inside `fp8_stack_scales`,
        scales for another depth, or a row that runs another number of FP8 GEMMs than the scales have sites.
    """
    graphdef, stacked = nnx.split(layers)

    extra: tuple = () if segment_ids_BT is None else (segment_ids_BT,)
    if positions_BT is not None:
        extra = (segment_ids_BT, positions_BT)

    depth = jax.tree.leaves(stacked)[0].shape[0]
    fp8 = _FP8_SCALES.get()
    scales = None
    if fp8 is not None:
        scales = fp8[0]
        if scales[0].shape[0] != depth:
            raise ValueError(f"fp8_stack_scales: scales of shape {scales[0].shape} for a stack of {depth} rows")
        fp8[1] = True

    def run(x, layer_state, row_scales):
        layer = gather(nnx.merge(graphdef, layer_state))
        if row_scales is None:
            return layer(x, tp, *extra)
        with layer_scales(*row_scales) as used:
            out = layer(x, tp, *extra)
        sites = row_scales[0].shape[0]
        if used[1] != sites:
            raise ValueError(
                f"FP8 delayed scaling: a layer ran {used[1]} FP8 GEMMs and its model family's fp8_gemm_sites gives "
                f"{sites}; register the family with fp8_gemm_sites giving {used[1]} (jaxpar.register_model), or set "
                f"precision.fp8.scaling=current"
            )
        return out

    def body(x, row):
        out = run(x, *row)
        return out if with_aux else (out, None)

    body = jax.checkpoint(body, policy=CHECKPOINT_POLICIES[remat], prevent_cse=False)
    rows = (stacked, scales)
    active = _ACTIVE_ROWS.get()
    if active is None:
        x_BTD, aux = jax.lax.scan(body, x_BTD, rows)
        return (x_BTD, aux) if with_aux else x_BTD
    mask = active[0]
    if mask.shape != (depth,):
        raise ValueError(f"active_rows: a mask of shape {mask.shape} for a stack of {depth} rows")
    active[1] = True
    first = jax.tree.map(lambda a: a[0], rows)
    aux_shape = jax.eval_shape(body, x_BTD, first)[1]

    def skip(x, row):
        return x, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux_shape)

    def masked(x, row_keep):
        row, keep = row_keep
        with jax.named_scope(ACTIVE_ROWS_SCOPE):  # how readers of the compiled program find these conds
            return jax.lax.cond(keep > 0, body, skip, x, row)

    x_BTD, aux = jax.lax.scan(masked, x_BTD, (rows, mask))
    return (x_BTD, aux) if with_aux else x_BTD
