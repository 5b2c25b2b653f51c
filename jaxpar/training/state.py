"""The train state {"step", "params", "opt_state"[, "master"][, "fp8"]}: created on the mesh (`init_state`) or
described abstractly (`abstract_state`, a restore target), laid out as the plan says
(`jaxpar.training.plan.StepPlan`).

With the `16p` layout (`jaxpar.config.precision.LAYOUTS`) "master" holds the fp32 parameters the optimizer updates
and "params" their bf16 cast, which the forward reads (MoE balancing biases kept fp32:
`jaxpar.training.router_bias`); with `fp32` "params" are the fp32 parameters themselves.
With FP8 delayed scaling "fp8" holds the amax history (`jaxpar.training.fp8_history`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.model import init_params
from jaxpar.model.interface import STACK_ATTRIBUTE
from jaxpar.model.params import fit_stack
from jaxpar.training import fp8_history, router_bias
from jaxpar.training.plan import StepPlan


def init_state(plan: StepPlan, seed: int = 0, *, params: dict | None = None, donate: bool = False) -> dict:
    """Creates the sharded train state {"step", "params", "opt_state"[, "master"][, "fp8"]} directly on the mesh.

    The optimizer state (AdamW's two moments: 8 bytes per parameter) is made on the devices, by the same jitted
    program that lays out the parameters (its zeros come out with `plan.state_shardings`): never on the host.

    Args:
      plan: the step plan.
      seed: initialises the parameters (identical for every mesh layout, see `jaxpar.model.init_params`).
      params: start from these parameters instead (fp32 or the parameter dtype, any sharding, e.g. a restored
        run's: `jaxpar.restore`), with a fresh optimizer state of `plan.tx` at step 0: how a script continues a
        run with another optimizer. Resharded onto the plan's layout; the seed is not used. Host numpy arrays are
        copied to the devices whole by each process; a model larger than a host is placed first
        (`jaxpar.model.hf.place.place_hf_params` onto `abstract_params(plan)`), then given with `donate`.
      donate: `params` are float32 jax arrays laid out as `abstract_params(plan)` that the caller gives up: their
        buffers become the state's fp32 parameters (no second copy on the devices) and `params` are deleted.

    Raises:
      ValueError: `params` is not shaped like the plan's model's parameters.
    """
    if params is None:
        # The fp32 parameters in a program of their own, the same for every precision layout: fused with the
        # casts and optimizer state of a layout, XLA may round them differently (seen with XLA:CPU's elemental
        # emitters: the 16p master copy 1 ulp off the fp32 layout's parameters).
        fp32 = jax.jit(
            lambda: init_params(plan.cfg.model, seed, plan.stack_rows), out_shardings=plan.state_shardings["params"]
        )()
        return jax.jit(lambda p: _fill_state(plan, p), out_shardings=plan.state_shardings, donate_argnums=0)(fp32)
    want = jax.eval_shape(lambda: init_params(plan.cfg.model, 0, plan.stack_rows))
    depth = plan.cfg.model.stack_depth
    # the stack as another mesh stores it (zero rows after the last layer), or unpadded: stored as this plan does
    fitted = params
    if _stacked(params, depth):
        fitted = jax.eval_shape(lambda p: fit_stack(p, plan.stack_rows, depth), params)
    _check_params_fit(fitted, want, plan.cfg.model.name)
    fp32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)  # no copy of float32 jax arrays
    fill = jax.jit(
        lambda p: _fill_state(plan, fit_stack(p, plan.stack_rows, depth)),
        out_shardings=plan.state_shardings,
        donate_argnums=0 if donate else (),
    )
    return fill(fp32)


def _stacked(params, depth: int) -> bool:
    """Whether `params` has a layer stack whose leaves all hold at least `depth` rows (`fit_stack` can store
    it); otherwise `_check_params_fit` names what differs."""
    stack = params.get(STACK_ATTRIBUTE) if isinstance(params, dict) else None
    leaves = jax.tree.leaves(stack) if stack is not None else []
    return bool(leaves) and all(np.ndim(a) >= 1 and np.shape(a)[0] >= depth for a in leaves)


def abstract_params(plan: StepPlan) -> dict:
    """The model's float32 parameters as `jax.ShapeDtypeStruct`s with the shardings of the state's float32 copy
    ("master" under the 16p layout, else "params"): where to place parameters that `init_state(plan, params=...,
    donate=True)` takes without a copy. No device work."""
    shapes = jax.eval_shape(lambda: init_params(plan.cfg.model, 0, plan.stack_rows))
    shardings = plan.state_shardings["master" if plan.has_master else "params"]
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=sh), shapes, shardings)


def abstract_state(plan: StepPlan) -> dict:
    """`init_state`'s output as ShapeDtypeStructs carrying their shardings (a restore target; no device work)."""
    shapes = jax.eval_shape(_state_initializer(plan, 0))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, plan.state_shardings)


def _check_params_fit(params, want: dict, model_name: str) -> None:
    """`params` has `want`'s paths and shapes, with floating-point leaves; raises ValueError naming the first
    difference."""

    def flat(tree) -> dict:
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {"/".join(str(getattr(k, "key", k)) for k in path): x for path, x in leaves}

    got, expected = flat(params), flat(want)
    fix = "give the parameters of a run with the same model.* settings (e.g. jaxpar.restore(...).params)"
    for path in sorted(set(got) | set(expected)):
        if path not in got or path not in expected:
            what = "missing" if path not in got else "not a parameter of the model"
            raise ValueError(f"params do not fit model {model_name!r}: {path} is {what}; {fix}")
        shape, dtype = tuple(np.shape(got[path])), getattr(got[path], "dtype", None)
        if shape != expected[path].shape or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"params do not fit model {model_name!r}: {path} is {dtype} {shape}, the model's is floating-point "
                f"{expected[path].shape}; {fix}"
            )


def _fill_state(plan: StepPlan, params: dict) -> dict:
    """The train state at step 0 around fp32 `params`."""
    state: dict[str, Any] = {"step": jnp.zeros((), jnp.int32)}
    if plan.has_master:
        state["master"] = params
        state["params"] = router_bias.cast_params(params, plan.param_dtype)  # MoE balancing biases stay fp32
    else:
        state["params"] = params
    state["opt_state"] = plan.tx.init(params)
    if fp8_history.delayed_config(plan.cfg):
        state["fp8"] = fp8_history.initial_history(plan.cfg)
    return state


def _state_initializer(plan: StepPlan, seed: int) -> Callable[[], dict]:
    return lambda: _fill_state(plan, init_params(plan.cfg.model, seed, plan.stack_rows))
