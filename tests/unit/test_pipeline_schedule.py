"""The interleaved 1F1B clock-tick arithmetic (jaxpar.parallel.schedule), checked by simulating every tick of every
device for p in {1, 2, 3, 4}, v in {1, 2, 3}, several m: each chunk of each microbatch runs forward and backward
exactly once, a device runs at most one forward and one backward per tick, activations and gradients always come
from the neighbouring device one tick earlier, the stash never needs more than its slots, and the busy ticks give
the stated bubble."""

import itertools

import jax.numpy as jnp
import pytest

from jaxpar.parallel import schedule

CASES = [(p, v, m) for p, v in itertools.product((1, 2, 3, 4), (1, 2, 3)) for m in (p, 2 * p, 3 * p) if m >= 1]
CASES += [(2, 1, 3), (4, 1, 5), (3, 1, 1)]  # plain 1F1B takes any m


def _backward_tick(i: int, c: int, p: int, v: int) -> int:
    """t_b(i, c) as the module docstring of `jaxpar.parallel.schedule` states it (the step runs `backward_at`)."""
    g, r = divmod(i, p)
    j, s = divmod(c, p)
    return schedule.warmup_ticks(p, v) + g * p * v + (v - 1 - j) * p + r + (p - 1 - s)


@pytest.mark.parametrize("p,v,m", CASES)
def test_every_chunk_runs_once_in_dependency_order(p, v, m):
    n = schedule.ticks(p, v, m)
    fwd, bwd = {}, {}
    for t in range(n):
        for s in range(p):
            i, j, ok = schedule.forward_at(t, s, p, v, m)
            if ok:
                key = (i, j * p + s)
                assert key not in fwd
                fwd[key] = t
                assert schedule.forward_tick(*key, p, v) == t
            i, j, ok = schedule.backward_at(t, s, p, v, m)
            if ok:
                key = (i, j * p + s)
                assert key not in bwd
                bwd[key] = t
                assert _backward_tick(*key, p, v) == t
    chunks = p * v
    assert set(fwd) == set(bwd) == {(i, c) for i in range(m) for c in range(chunks)}
    for i in range(m):
        for c in range(chunks - 1):
            assert fwd[(i, c + 1)] == fwd[(i, c)] + 1  # one ring permute forward per tick
            assert bwd[(i, c)] == bwd[(i, c + 1)] + 1  # and one backward
        assert bwd[(i, chunks - 1)] == fwd[(i, chunks - 1)]  # the last chunk turns around in the same tick
    # the stash: a chunk input waits for its backward at most 2pv - 2 ticks, so 2pv - 1 slots by forward tick
    assert max(bwd[k] - fwd[k] for k in fwd) == 2 * (chunks - 1) < schedule.stash_slots(p, v)
    # busy chunk ticks per device: m*v forwards + m*v backwards over the ticks; bubble as stated
    assert min(fwd.values()) == 0 and max(bwd.values()) == n - 1
    steady = n - 2 * schedule.warmup_ticks(p, v)
    stage_ticks = (steady + schedule.warmup_ticks(p, v)) / v  # warm-up + cool-down make one full F+B tick each
    assert stage_ticks == pytest.approx(m + (p - 1) / v)
    assert 1 - m / stage_ticks == pytest.approx(schedule.bubble_fraction(p, v, m))


def test_plain_1f1b_is_the_existing_schedule():
    p, m = 4, 6
    assert schedule.ticks(p, 1, m) == m + 2 * p - 2
    for i, s in itertools.product(range(m), range(p)):
        assert schedule.forward_tick(i, s, p, 1) == i + s
        assert _backward_tick(i, s, p, 1) == i + 2 * p - 2 - s


def test_traced_indices_equal_python_ones():
    p, v, m = 4, 2, 8
    for t, s in itertools.product(range(schedule.ticks(p, v, m)), range(p)):
        for f in (schedule.forward_at, schedule.backward_at):
            want = f(t, s, p, v, m)
            got = f(jnp.int32(t), jnp.int32(s), p, v, m)
            assert bool(got[2]) == bool(want[2])
            if want[2]:
                assert (int(got[0]), int(got[1])) == want[:2]


def test_m_not_a_multiple_of_p_is_refused_with_interleaving():
    schedule.check(4, 1, 6)
    with pytest.raises(ValueError, match="microbatches=6 is not a multiple of it; use 4 or 8"):
        schedule.check(4, 2, 6)


def test_describe_states_the_schedule_and_its_bubble():
    line = schedule.describe("1f1b", 4, 2, 8, recompute=False)
    assert "interleaved 1F1B, 2 virtual stages" in line and "ring of 15 residuals" in line
    assert f"{3 / 19:.3f}" in line
    assert schedule.describe("1f1b", 4, 1, 8, recompute=True).startswith("1F1B, 4 stages, 8 microbatches, a ring of 7")
    assert f"{3 / 11:.3f}" in schedule.describe("gpipe", 4, 1, 8, recompute=False)
