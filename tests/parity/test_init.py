"""Parameter initialisation is bitwise identical on every mesh layout.

`init_state` jits the initialiser with the layout's output shardings; with partitionable threefry the random
values must not depend on how they are split. Four layouts on 8 simulated CPU devices: one device; data=8
(ZeRO-1: parameters replicated, optimizer state split over data); fsdp=8; data=2 x fsdp=4 with ZeRO-3.

Shape letters: L layers, D model width, F mlp hidden width.
"""

import jax
import numpy as np
import pytest
from optax import tree_utils as otu
from step_helpers import FP32, make_plan, quick_compile, shard_shape, to_host

from jaxpar.training.state import init_state

pytestmark = pytest.mark.usefixtures("devices8")  # tests/conftest.py: fails when the process has fewer
SEED = 11
# name -> (data, fsdp, zero_stage, devices)
LAYOUTS = {"single": (1, 1, 0, 1), "data8": (8, 1, 1, 8), "fsdp8": (1, 8, 1, 8), "data2_fsdp4_zero3": (2, 4, 3, 8)}


def _init(name: str):
    data, fsdp, zero, n = LAYOUTS[name]
    plan = make_plan(
        [*FP32, f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"optimizer.zero_stage={zero}"], jax.devices()[:n]
    )
    state = init_state(plan, SEED)
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(plan.state_shardings)):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), name
    return state


def _layout(state) -> dict:
    """Where each device's piece of a weight and of its Adam moment lies: {device id: (start along D,
    shard shape)}. Distinguishes layouts with equal shard shapes but different shard placement."""
    out = {}
    for kind, x in (
        ("w", state["params"]["blocks"]["mlp"]["w_up"]),  # [L, D, F], sharded along D
        ("mu", otu.tree_get(state["opt_state"], "mu")["blocks"]["mlp"]["w_up"]),
    ):
        out[kind] = {
            d.id: (idx[1].start or 0, shard_shape(x)) for d, idx in x.sharding.devices_indices_map(x.shape).items()
        }
    return out


def _assert_bitwise_equal(state, ref, name: str) -> None:
    assert jax.tree.structure(state) == jax.tree.structure(ref), name
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(ref)):
        assert x.dtype == y.dtype, (name, path)
        np.testing.assert_array_equal(x, y, err_msg=f"{name} {jax.tree_util.keystr(path)}")


def test_init_is_identical_across_layouts():
    with quick_compile():  # compile time dominates; the default-optimised code is checked below
        states = {name: _init(name) for name in LAYOUTS}
    layouts = {name: _layout(s) for name, s in states.items()}
    L, D, F = states["single"]["params"]["blocks"]["mlp"]["w_up"].shape
    full, eighth = (L, D, F), (L, D // 8, F)
    assert layouts["single"]["w"] == {0: (0, full)}
    assert set(layouts["data8"]["w"].values()) == {(0, full)} and len(layouts["data8"]["w"]) == 8
    assert layouts["data8"]["mu"] == {i: (i * D // 8, eighth) for i in range(8)}
    assert layouts["fsdp8"]["w"] == layouts["fsdp8"]["mu"] == {i: (i * D // 8, eighth) for i in range(8)}
    # data-major device order, fsdp-major shard order: device 4 * data + fsdp holds shard 2 * fsdp + data.
    zero3 = {4 * d + f: ((2 * f + d) * D // 8, eighth) for d in range(2) for f in range(4)}
    assert layouts["data2_fsdp4_zero3"]["w"] == layouts["data2_fsdp4_zero3"]["mu"] == zero3
    names = list(LAYOUTS)
    assert all(layouts[a] != layouts[b] for i, a in enumerate(names) for b in names[i + 1 :])

    ref = to_host(states["single"])
    assert all(np.any(x != 0) for x in jax.tree.leaves(ref["params"]))
    for name in names[1:]:
        _assert_bitwise_equal(to_host(states[name]), ref, name)


@pytest.mark.slow
def test_init_is_identical_with_default_compiler_optimisations():
    """Bitwise equality is a property of the compiled code: check it once on the code that ships (vectorised,
    fused), for the two most different layouts."""
    _assert_bitwise_equal(to_host(_init("data2_fsdp4_zero3")), to_host(_init("single")), "data2_fsdp4_zero3")
