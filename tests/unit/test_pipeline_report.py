"""Pipeline schedule arithmetic (`jaxpar.analysis.planner.pipeline`): pure integer/float checks, no compilation."""

import pytest

from jaxpar.analysis.planner.pipeline import (
    activation_bytes,
    bubble_fraction,
    format_table,
    ideal_time_ratio,
    report_row,
    stage_inputs_in_flight,
    tick_counts,
)
from jaxpar.parallel import schedule


@pytest.mark.parametrize("p,m,expected", [(1, 8, 0.0), (2, 4, 1 / 5), (4, 4, 3 / 7), (4, 32, 3 / 35), (8, 1, 7 / 8)])
def test_bubble_fraction(p, m, expected):
    assert bubble_fraction(p, m) == pytest.approx(expected)


@pytest.mark.parametrize("p,m,v,expected", [(2, 4, 2, 1 / 9), (4, 8, 2, 3 / 19), (4, 4, 4, 3 / 19), (2, 2, 3, 1 / 7)])
def test_interleaved_bubble_fraction(p, m, v, expected):
    """(p - 1)/(v*m + p - 1) (arXiv 2104.04473 section 2.2.2), the schedule's own formula; with v > 1, m must be
    a multiple of p (the schedule runs microbatches in groups of p)."""
    assert bubble_fraction(p, m, v) == pytest.approx(expected) == schedule.bubble_fraction(p, v, m)
    with pytest.raises(ValueError, match="multiple of"):
        bubble_fraction(p, p + 1, v)


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 4, 32])
def test_1f1b_ticks_match_the_loop_and_the_formula(p, m):
    t = tick_counts("1f1b", p, m)
    assert t["ticks"] == schedule.ticks(p, 1, m) == m + 2 * p - 2
    assert t["half_ticks"] == 2 * (p - 1)
    # two half ticks make one full tick: (ticks - half) + half / 2 = m + p - 1, the GPipe/1F1B formula
    assert t["full_equivalent"] == t["ticks"] - t["half_ticks"] + t["half_ticks"] // 2 == t["formula"] == m + p - 1


def test_gpipe_ticks_are_a_forward_and_a_backward_pass():
    assert tick_counts("gpipe", 4, 8) == {"ticks": 22, "half_ticks": 22, "full_equivalent": 11, "formula": 11}


def test_stage_inputs_in_flight():
    # 1F1B: the ring has 2p - 1 slots whatever m; stage 0 holds min(m, 2p - 1) live inputs
    assert stage_inputs_in_flight("1f1b", 4, 32) == {"allocated": 7, "live": 7}
    assert stage_inputs_in_flight("1f1b", 4, 4) == {"allocated": 7, "live": 4}
    assert stage_inputs_in_flight("1f1b", 2, 16) == {"allocated": 3, "live": 3}
    # GPipe: one saved stage input per tick, m of them real microbatches
    assert stage_inputs_in_flight("gpipe", 4, 32) == {"allocated": 35, "live": 32}


def test_1f1b_live_inputs_follow_the_tick_schedule():
    """Stage 0 stashes microbatch i at tick i and frees it at its backward, tick i + 2p - 2: count the most
    stashed inputs alive at any tick by simulating the schedule."""
    for p in (1, 2, 3, 4):
        for m in (1, 2, 5, 16):
            alive = max(sum(1 for i in range(m) if i <= k <= i + 2 * p - 2) for k in range(m + 2 * p - 2))
            assert stage_inputs_in_flight("1f1b", p, m)["live"] == alive


def test_activation_bytes():
    assert activation_bytes(2, 32, 64, 4) == 16384
    assert report_row("1f1b", 4, 32, 2, 32, 64, 4)["in_flight_bytes"] == 7 * 16384
    assert report_row("gpipe", 4, 32, 2, 32, 64, 2)["in_flight_bytes"] == 32 * 8192


def test_ideal_time_ratio():
    assert ideal_time_ratio("gpipe", 1, 8) == pytest.approx(1.0)
    assert ideal_time_ratio("gpipe", 4, 8) == pytest.approx(1 / (1 - bubble_fraction(4, 8)))
    # pipeline.recompute=true: the stage forward runs twice.
    assert ideal_time_ratio("1f1b", 1, 8, recompute=True) == pytest.approx(4 / 3)
    assert ideal_time_ratio("1f1b", 2, 4, recompute=True) == pytest.approx(4 * 5 / 12)
    # Residuals kept (the default): the tick ratio, as GPipe.
    assert ideal_time_ratio("1f1b", 2, 4) == pytest.approx(5 / 4) == ideal_time_ratio("gpipe", 2, 4)


@pytest.mark.parametrize(
    "call",
    [lambda: tick_counts("zb", 2, 4), lambda: bubble_fraction(0, 4), lambda: stage_inputs_in_flight("1f1b", 2, 0)],
)
def test_bad_arguments_raise(call):
    with pytest.raises(ValueError):
        call()


def test_format_table_shows_measured_columns_and_dashes():
    row = report_row("1f1b", 2, 4, 2, 32, 64, 4)
    text = format_table([dict(row, temp_bytes=2048, time_ratio=1.5, flops_ratio=1.25), row])
    lines = text.splitlines()
    assert len(lines) == 3 and "bubble" in lines[0]
    assert "2.0" in lines[1] and "1.50" in lines[1] and "3/3" in lines[1] and "6 (2)" in lines[1]
    # Measured bubbles: 1 - 1/1.25 from FLOPs, 1 - 1/1.5 from time; the tick ratio (m + p - 1)/m = 5/4.
    assert "0.200" in lines[1] and "0.333" in lines[1] and "1.250" in lines[1]
    assert report_row("1f1b", 2, 4, 2, 32, 64, 4, recompute=True)["schedule"] == "1f1b-rc"
    assert "-" in lines[2].split()
