"""The zero-bubble schedule tables (jaxpar.parallel.zero_bubble) and their checker (jaxpar.parallel.schedule_table),
pure Python: every table passes the checker; the bubble counted from the table's idle slots equals the lockstep
formula for p in {1, 2, 3, 4, 8} and m below, at and above p; in-flight counts reach their stated bounds; each
rule of the checker fails a table that breaks it, with a message naming the violation."""

import dataclasses

import pytest

from jaxpar.parallel import schedule_table, zero_bubble
from jaxpar.parallel.schedule_table import Op

# (schedule, p, v, microbatches): m < p, m = p, m > p for each p; interleaving needs m a multiple of p
CASES = [
    (name, p, v, m)
    for name, vs in (("1f1b", (1, 2)), ("zb-h1", (1, 2)), ("zb-v", (2,)))
    for v in vs
    for p in (1, 2, 3, 4, 8)
    for m in sorted({max(1, p // 2), p, p + 1, 2 * p, 3 * p})
    if v == 1 or name == "zb-v" or m % p == 0
]
TIMES = [(1.0, 1.0, 1.0), (1.0, 2.0, 0.5)]  # the papers' unit times, and a backward-heavy split


@pytest.mark.parametrize("name,p,v,m", CASES)
def test_tables_pass_and_their_idle_slots_give_the_stated_bubble(name, p, v, m):
    table = zero_bubble.build(name, p, m, v)
    schedule_table.check(table)
    for times in TIMES:
        want = zero_bubble.bubble(name, p, v, *times)
        assert [schedule_table.idle_time(table, s, *times) for s in range(p)] == pytest.approx([want] * p)
        assert schedule_table.step_time(table, *times) == pytest.approx(m * sum(times) + want)
    held = schedule_table.in_flight(table)
    assert all(h <= b for h, b in zip(held, table.in_flight_bound, strict=True))
    if m >= 2 * p:  # the bounds are reached
        assert held == list(table.in_flight_bound)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_bubbles_against_the_papers(p):
    """1F1B's lockstep bubble is the paper's; ZB-H1 pays (p - 1) T_W more than the paper's asynchronous figure
    (W cannot hide in another device's F or B slot), and ZB-V, zero in the paper, pays ZB-H1's lockstep bubble;
    ZB-H1 over two chunks per device reaches the paper's one-chunk ZB-H1 figure at T_F = T_B = T_W."""
    for times in TIMES:
        t_w = times[2]
        assert zero_bubble.bubble("1f1b", p, 1, *times) == zero_bubble.paper_bubble("1f1b", p, 1, *times)
        assert (
            zero_bubble.bubble("zb-h1", p, 1, *times) == zero_bubble.paper_bubble("zb-h1", p, 1, *times) + (p - 1) * t_w
        )
        assert zero_bubble.bubble("zb-v", p, 2, *times) == zero_bubble.bubble("zb-h1", p, 1, *times)
    assert zero_bubble.paper_bubble("zb-v", p, 2) == 0.0
    assert zero_bubble.bubble("zb-h1", p, 2) == zero_bubble.paper_bubble("zb-h1", p, 1) == p - 1
    assert zero_bubble.bubble_fraction("zb-h1", p, p) == pytest.approx(2 / 3 * (p - 1) / (p + 2 / 3 * (p - 1)))


@pytest.mark.parametrize(
    "name,v,hops", [("1f1b", 2, "p-1"), ("zb-h1", 1, "p-1"), ("zb-h1", 2, "p-1"), ("zb-v", 2, "2p-2")]
)
def test_forward_slots_meet_the_lower_bound_of_their_placement(name, v, hops):
    """Ticks that pay for F: m*v plus the hops the module docstring's lower bound counts (ring p - 1, V 2(p-1))."""
    p, m = 4, 8
    table = zero_bubble.build(name, p, m, v)
    h = p - 1 if hops == "p-1" else 2 * (p - 1)
    paid = schedule_table.paid(table)
    assert sum("F" in k for k in paid) == sum("B" in k for k in paid) == m * v + h
    assert sum("W" in k for k in paid) == m * v if name != "1f1b" else m * v + h


def test_phases_are_the_static_loops():
    p, m = 4, 8
    f, fb, fbw, bw = frozenset("F"), frozenset("FB"), frozenset("FBW"), frozenset("BW")
    assert schedule_table.phases(zero_bubble.build("1f1b", p, m)) == [(0, 3, f), (3, 11, fbw), (11, 14, bw)]
    assert schedule_table.phases(zero_bubble.build("zb-h1", p, m)) == [
        (0, 3, f),
        (3, 6, fb),
        (6, 11, fbw),
        (11, 14, bw),
    ]


def test_permute_directions():
    """1F1B sends activations +1 and gradients -1 (the ring wraps with interleaving); the V sends both ways, with
    all four permutes in some ticks, and never wraps from device p - 1 to 0."""
    p, m = 4, 8
    used = {
        (name, v): set().union(*schedule_table.permutes(zero_bubble.build(name, p, m, v)))
        for name, v in (("1f1b", 1), ("1f1b", 2), ("zb-h1", 1), ("zb-v", 2))
    }
    one_way = {("activation", 1), ("gradient", -1)}
    assert used["1f1b", 1] == used["1f1b", 2] == used["zb-h1", 1] == one_way
    both = {(k, d) for k in ("activation", "gradient") for d in (1, -1)}
    assert used["zb-v", 2] == both
    assert any(per_tick == both for per_tick in schedule_table.permutes(zero_bubble.build("zb-v", p, m, 2)))


def _tiny():
    """1F1B over 2 devices, 2 microbatches: F(i, s) = i + s, B(i, s) = W(i, s) = i + 2 - s."""
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
    (lambda: _move(_tiny(), "F", 1, 0, tick=0), "device 0 runs two F in tick 0"),
    (lambda: _move(_tiny(), "F", 0, 1, tick=0), "before chunk 0's output arrives"),
    (lambda: _move(_tiny(), "B", 0, 1, tick=0), "before its F"),
    (lambda: _move(_tiny(), "B", 0, 0, tick=1), "before chunk 1's gradient arrives"),
    (lambda: _move(_tiny(), "W", 1, 0, tick=0), "W of microbatch 1 chunk 0 in tick 0 before its B"),
    (lambda: _move(_tiny(), "F", 0, 1, device=0), "off its device"),
    (lambda: _move(_tiny(), "W", 0, 0, kind="X"), "is not an F, B or W"),
    (lambda: dataclasses.replace(_tiny(), in_flight_bound=(1, 1)), "device 0 holds 2 chunk-microbatches"),
    (lambda: dataclasses.replace(zero_bubble.build("zb-h1", 4, 8), in_flight_bound=(7, 5, 3, 1)), "device 1 holds 6"),
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


def test_grid_reads_the_table():
    grid = zero_bubble.build("zb-v", 2, 1, 2).grid()
    assert grid[0] == [{"F": (0, 0), "B": None, "W": None}, {"F": None, "B": None, "W": None}]
    assert grid[3][0] == {"F": (0, 3), "B": (0, 3), "W": None}  # the last chunk turns around on device 0
    assert Op("W", 6, 0, 0, 0) in zero_bubble.build("zb-v", 2, 1, 2).ops


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_v_holds_at_most_1f1b_stages_and_zb_h1_its_peak(p):
    """In stage-microbatches (a ZB-V chunk is half a stage): ZB-V's peak is at most lockstep 1F1B's 2p - 1 and
    ZB-H1's equals it, on device 0."""
    m = 4 * p
    one_f_one_b = max(schedule_table.in_flight(zero_bubble.build("1f1b", p, m)))
    assert one_f_one_b == 2 * p - 1
    assert schedule_table.in_flight(zero_bubble.build("zb-h1", p, m))[0] == one_f_one_b
    assert max(schedule_table.in_flight(zero_bubble.build("zb-v", p, m, 2))) / 2 <= one_f_one_b
