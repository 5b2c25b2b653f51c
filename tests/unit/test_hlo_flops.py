"""`jaxpar.analysis.hlo.flops`: matmul FLOPs per device from a compiled program, with loop trip counts and the
branch of each conditional that device takes; XLA's own `cost_analysis()` does neither (checked here too).

A toy shard_map over mesh pipeline=2 x tensor=2: a scan of 5 steps whose body runs an [8, 64] x [64, 64] matmul
and an all-reduce over `tensor` inside `lax.cond(axis_index("pipeline") == 1)`, plus one unconditional matmul.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.analysis.hlo.flops import dot_flops_per_device, per_device_cost

MATMUL = 2 * 8 * 64 * 64  # one [8, 64] x [64, 64] matmul
TRIPS = 5


def _compiled(branch_on: str):
    mesh = jax.make_mesh((2, 2), ("pipeline", "tensor"), devices=jax.devices()[:4])

    def body(w, x):
        s = jax.lax.axis_index(branch_on)

        def step(c, _):
            c = jax.lax.cond(s == 1, lambda: jax.lax.psum(c @ w, "tensor"), lambda: c)
            return c, None

        c, _ = jax.lax.scan(step, x, None, length=TRIPS)
        return c @ w

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
    return jax.jit(fn).lower(jnp.ones((64, 64)), jnp.ones((8, 64))).compile()


@pytest.fixture(scope="module")
def compiled(need_devices):
    need_devices(4)
    return _compiled("pipeline")


def test_counts_trip_counts_and_the_branch_each_device_takes(compiled):
    # Partition ids are positions in mesh.devices.flat: (pipeline, tensor) = (0,0), (0,1), (1,0), (1,1).
    assert dot_flops_per_device(compiled.as_text()) == [MATMUL, MATMUL, (TRIPS + 1) * MATMUL, (TRIPS + 1) * MATMUL]


def test_cost_analysis_counts_a_loop_body_once(compiled):
    """Why the module exists: XLA's estimate counts the scan's body once, not TRIPS times."""
    flops = compiled.cost_analysis()["flops"]
    assert flops < 3 * MATMUL < (TRIPS + 1) * MATMUL


def test_selector_on_another_axis(need_devices):
    need_devices(4)
    # tensor index 1: partitions 1 and 3. (The all-reduce over tensor inside then has one member per group
    # taking the branch; the program is only compiled, never run.)
    text = _compiled("tensor").as_text()
    assert dot_flops_per_device(text) == [MATMUL, (TRIPS + 1) * MATMUL, MATMUL, (TRIPS + 1) * MATMUL]
    # Any per-instruction cost: all-reduces executed per device.
    reduces = per_device_cost(text, lambda module, comp, i: float(i.opcode.startswith("all-reduce")))
    assert reduces == [0, TRIPS, 0, TRIPS]
