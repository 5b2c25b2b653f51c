"""The schedule tables of the mixed slot model (jaxpar.parallel.zero_bubble) and their checker and lockstep costs
(jaxpar.parallel.schedule_table), pure Python: every table passes the checker; the bubble counted from the table
is the closed form for p in {1, 2, 3, 4, 8} and m below, at and above p (1F1B's the paper's, ZB-H1's and ZB-V's
the least any table can have); in-flight and W-pending counts reach their stated values; each rule of the checker
fails a table that breaks it, with a message naming the violation."""

import dataclasses

import pytest

from jaxpar.parallel import schedule_table, zero_bubble
from jaxpar.parallel.schedule_table import Op

# (schedule, p, v, microbatches): m < p, m = p, m > p for each p; the interleaved ring needs m a multiple of p
CASES = [
    (name, p, v, m)
    for name, vs in (("1f1b", (1, 2)), ("zb-h1", (1, 2)), ("zb-v", (2,)))
    for v in vs
    for p in (1, 2, 3, 4, 8)
    for m in sorted({1, max(1, p // 2), p, p + 1, 2 * p, 3 * p, 8, 16})
    if v == 1 or name == "zb-v" or m % p == 0
]


@pytest.mark.parametrize("name,p,v,m", CASES)
def test_tables_pass_and_their_bubble_is_the_closed_form(name, p, v, m):
    table = zero_bubble.build(name, p, m, v)
    schedule_table.check(table)
    idle = schedule_table.idle_time(table)
    if name == "zb-v" and m < p:
        assert idle >= p - 1  # no closed form below p microbatches
    else:
        assert idle == zero_bubble.unit_bubble(name, p, m, v)
    assert schedule_table.step_time(table) == table.slots == 3 * m * v + idle  # no slot idle on every device
    held = schedule_table.in_flight(table)
    if name == "zb-v":
        assert max(held) == min(2 * m, 2 * p) and all(h <= 2 * p for h in held)
    else:
        assert held == list(table.in_flight_bound)  # every device reaches its bound


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m", [8, 16])
def test_bubble_fractions_at_unit_times(p, m):
    """1F1B (p-1)/(vm+p-1) (2104.04473 section 2.2.2); ZB-H1 (p-1)/(3vm+p-1) (2401.10241 section 2.1 at v = 1);
    ZB-V (p-1)/(6m+p-1)."""
    for v in (1, 2):
        assert zero_bubble.bubble_fraction("1f1b", p, m, v) == pytest.approx((p - 1) / (v * m + p - 1))
        assert zero_bubble.bubble_fraction("zb-h1", p, m, v) == pytest.approx((p - 1) / (3 * v * m + p - 1))
    assert zero_bubble.bubble_fraction("zb-v", p, m, 2) == pytest.approx((p - 1) / (6 * m + p - 1))


@pytest.mark.parametrize("p", [2, 4, 8])
def test_bubbles_against_the_papers(p):
    """At T_F = T_B = T_W 1F1B's and ZB-H1's bubbles are the papers' (asynchronous) figures; ZB-V, zero in the
    papers (each device counted from its first op to its last), keeps the p - 1 slots device p - 1 waits for
    its first input; ZB-H1 over two chunks per device has the same p - 1 chunk slots."""
    m = 2 * p
    for v in (1, 2):
        assert schedule_table.idle_time(zero_bubble.build("1f1b", p, m, v)) == zero_bubble.paper_bubble("1f1b", p, v)
    assert schedule_table.idle_time(zero_bubble.build("zb-h1", p, m)) == zero_bubble.paper_bubble("zb-h1", p) == p - 1
    assert zero_bubble.paper_bubble("zb-v", p, 2) == 0.0
    assert schedule_table.idle_time(zero_bubble.build("zb-v", p, m, 2)) == p - 1
    assert schedule_table.idle_time(zero_bubble.build("zb-h1", p, m, 2)) == p - 1
    with pytest.raises(ValueError, match="give no bubble"):
        zero_bubble.paper_bubble("zb-h1", p, 2)


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("1f1b", 2), ("zb-h1", 1), ("zb-h1", 2), ("zb-v", 2)])
def test_device_p_minus_1_waits_p_minus_1_slots(name, v):
    """The lower bound: chunk p - 1's first F waits for p - 1 earlier chunks', so device p - 1 idles p - 1 slots
    and, every device being busy equally long, so does every device; the ZB tables have no other bubble."""
    p, m = 4, 8
    table = zero_bubble.build(name, p, m, v)
    assert min(op.slot for op in table.ops if op.device == p - 1) == p - 1
    assert schedule_table.idle_time(table) == (3 * (p - 1) if name == "1f1b" else p - 1)


def test_lockstep_cost_takes_the_longest_op_of_each_slot():
    """1F1B over 2 devices, 1 microbatch: the unsplit backward hands chunk 0 its gradient after chunk 1's W;
    ZB-H1 runs chunk 0's B beside chunk 1's W, in a slot that costs the longer of the two."""
    one = zero_bubble.build("1f1b", 2, 1)
    assert sorted(one.ops, key=lambda op: op.slot) == [
        Op("F", 0, 0, 0, 0),
        Op("F", 1, 1, 0, 1),
        Op("B", 2, 1, 0, 1),
        Op("W", 3, 1, 0, 1),
        Op("B", 4, 0, 0, 0),
        Op("W", 5, 0, 0, 0),
    ]
    times = (1.0, 2.0, 0.5)
    assert schedule_table.step_time(one, *times) == 1 + 1 + 2 + 0.5 + 2 + 0.5
    assert schedule_table.idle_time(one, *times) == 7 - 3.5
    zb = zero_bubble.build("zb-h1", 2, 1)
    assert {op for op in zb.ops if op.slot == 3} == {Op("B", 3, 0, 0, 0), Op("W", 3, 1, 0, 1)}
    assert schedule_table.step_time(zb, *times) == 1 + 1 + 2 + 2 + 0.5
    assert schedule_table.bubble_fraction(zb, *times) == pytest.approx(1 - 3.5 / 6.5)


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_w_pending(p):
    """Deferred W's (B run, W not): 1 per device under 1F1B, s + 1 under ZB-H1, p + s + 1 under ZB-V."""
    m = 2 * p
    assert schedule_table.w_pending(zero_bubble.build("1f1b", p, m)) == [1] * p
    assert schedule_table.w_pending(zero_bubble.build("zb-h1", p, m)) == [s + 1 for s in range(p)]
    assert schedule_table.w_pending(zero_bubble.build("zb-v", p, m, 2)) == [p + s + 1 for s in range(p)]


def test_zb_v_runs_device_p_minus_1_in_pairs():
    """p = 2, m = 2: device 1's pair string F F B B W W; F(i, c) = 2 phi_i + c, B(i, c) = 2 beta_i + 3 - c."""
    table = zero_bubble.build("zb-v", 2, 2, 2)
    at = {(op.kind, op.microbatch, op.chunk): op.slot for op in table.ops}
    assert [at["F", i, c] for i in (0, 1) for c in range(4)] == [0, 1, 2, 3, 2, 3, 4, 5]
    assert [at["B", i, c] for i in (0, 1) for c in range(4)] == [7, 6, 5, 4, 9, 8, 7, 6]
    assert table.placement == (0, 1, 1, 0)
    bottom = sorted((op for op in table.ops if op.device == 1), key=lambda op: op.slot)
    assert "".join(op.kind for op in bottom) == "FFFFBBBBWWWW"  # pairs F F B B W W, from slot p - 1 = 1 on
    assert [op.slot for op in bottom] == list(range(1, 13))
    assert table.grid()[3][0] == Op("F", 3, 0, 0, 3)  # the last chunk, back on device 0


def _tiny():
    """1F1B over 2 devices, 2 microbatches (slots: F(1,0) 1, B(0,1) 2, B(0,0) 4, B(1,0) 7, device 0 idle in 2)."""
    return zero_bubble.build("1f1b", 2, 2)


def _move(table, which, i, c, **change):
    """`table` with the op `which` (F, B or W) of microbatch i, chunk c changed."""
    ops = tuple(
        op._replace(**change) if (op.kind, op.microbatch, op.chunk) == (which, i, c) else op for op in table.ops
    )
    return dataclasses.replace(table, ops=ops)


def _ring_breaker():
    """4 devices with chunks 0 and 1 two devices apart."""
    base = zero_bubble.build("1f1b", 4, 1)
    place = (0, 2, 1, 3)
    ops = tuple(op._replace(device=place[op.chunk]) for op in base.ops)
    return dataclasses.replace(base, placement=place, ops=ops)


BROKEN = [
    (lambda: dataclasses.replace(_tiny(), ops=_tiny().ops[1:]), "never runs"),
    (lambda: dataclasses.replace(_tiny(), ops=_tiny().ops + _tiny().ops[:1]), "runs twice"),
    (lambda: _move(_tiny(), "F", 1, 0, slot=0), "device 0 runs two ops in slot 0"),
    (lambda: _move(_tiny(), "F", 0, 1, slot=0), "chunk 1 in slot 0, not after chunk 0's F"),
    (lambda: _move(_tiny(), "B", 0, 1, slot=0), "chunk 1 in slot 0, not after its F"),
    (lambda: _move(_tiny(), "B", 0, 0, slot=2), "chunk 0 in slot 2, not after chunk 1's B"),
    (lambda: _move(_tiny(), "W", 1, 0, slot=2), "W of microbatch 1 chunk 0 in slot 2, not after its B"),
    (lambda: _move(_tiny(), "F", 0, 1, device=0), "off its device"),
    (lambda: _move(_tiny(), "W", 0, 0, kind="X"), "is not an F, B or W"),
    (lambda: dataclasses.replace(_tiny(), in_flight_bound=(1, 1)), "device 0 holds 2 chunk-microbatches"),
    (lambda: dataclasses.replace(zero_bubble.build("zb-h1", 4, 8), in_flight_bound=(4, 3, 4, 4)), "device 1 holds 4"),
    (_ring_breaker, "not ring neighbours"),
]


@pytest.mark.parametrize("make,message", BROKEN)
def test_checker_names_each_violation(make, message):
    with pytest.raises(ValueError, match=message):
        schedule_table.check(make())


@pytest.mark.parametrize(
    "name,p,m,v,message",
    [
        ("zb-v", 4, 8, 1, "use virtual_stages=2"),
        ("zb-v", 4, 0, 2, "any m >= 1 works"),
        ("zb-h1", 4, 6, 2, "use 4 or 8"),
        ("1f1b", 4, 10, 2, "use 8 or 12"),
        ("gpipe", 4, 8, 1, "use one of 1f1b, zb-h1, zb-v"),
    ],
)
def test_sizes_a_schedule_cannot_run_are_refused(name, p, m, v, message):
    with pytest.raises(ValueError, match=message):
        zero_bubble.build(name, p, m, v)
    with pytest.raises(ValueError, match=message):
        zero_bubble.bubble_fraction(name, p, m, v)
