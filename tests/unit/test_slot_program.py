"""The slot program (jaxpar.parallel.slot_program), pure Python: every schedule's table lowers to instructions
whose symbolic run reads exactly the value each op needs and never writes over a live one, with rings as small as
the most values live at once; the fields of a small case by hand; the permute directions of the ring and the V;
and the symbolic run catches each kind of broken instruction."""

import dataclasses

import numpy as np
import pytest

from jaxpar.parallel import slot_program, zero_bubble
from jaxpar.parallel.slot_program import ACT, GRAD, B, F, W

CASES = [
    (name, p, v, m)
    for name, vs in (("1f1b", (1, 2)), ("zb-h1", (1, 2)), ("zb-v", (2,)))
    for v in vs
    for p in (1, 2, 3, 4, 8)
    for m in sorted({1, p, p + 1, 2 * p, 3 * p, 8})
    if v == 1 or name == "zb-v" or m % p == 0
]


@pytest.mark.parametrize("name,p,v,m", CASES)
def test_programs_run_symbolically_with_the_least_rings(name, p, v, m):
    table = zero_bubble.build(name, p, m, v)
    prog = slot_program.program(table)
    for field in slot_program.FIELDS:
        a = getattr(prog, field)
        assert a.shape == (table.slots, p) and a.dtype == np.int32, field
    live = slot_program.simulate(prog, table)
    assert {r: getattr(prog, f"{r}_slots") for r in slot_program.RINGS} == {r: max(1, n) for r, n in live.items()}


def test_fields_of_1f1b_over_two_devices_by_hand():
    """1F1B, p = 2, m = 1: F(0,0) in slot 0 on device 0, F(0,1), B(0,1), W(0,1) in slots 1-3 on device 1,
    B(0,0), W(0,0) in slots 4-5 on device 0. With p = 2 both neighbours are one device: every send goes up."""
    prog = slot_program.program(zero_bubble.build("1f1b", 2, 1))
    expect = {
        "kind": [[F, 0], [0, F], [0, B], [0, W], [B, 0], [W, 0]],
        "chunk_local": [[0, 0]] * 6,
        "is_first": [[1, 0], [0, 0], [0, 0], [0, 0], [1, 0], [1, 0]],
        "is_last": [[0, 0], [0, 1], [0, 1], [0, 1], [0, 0], [0, 0]],
        "send": [[1, 0], [0, 0], [0, 1], [0, 0], [0, 0], [0, 0]],
        "recv_up_kind": [[0, ACT], [0, 0], [GRAD, 0], [0, 0], [0, 0], [0, 0]],
        "recv_up_slot": [[-1, 0], [-1, -1], [0, -1], [-1, -1], [-1, -1], [-1, -1]],
        "act_read": [[-1, -1], [-1, 0], [-1, -1], [-1, -1], [-1, -1], [-1, -1]],
        "seed_write": [[-1, -1], [-1, 0], [-1, -1], [-1, -1], [-1, -1], [-1, -1]],
        "seed_read": [[-1, -1], [-1, -1], [-1, 0], [-1, -1], [-1, -1], [-1, -1]],
        "grad_read": [[-1, -1], [-1, -1], [-1, -1], [-1, -1], [0, -1], [-1, -1]],
        "w_read": [[-1, -1], [-1, -1], [-1, -1], [-1, 0], [-1, -1], [0, -1]],
    }
    for field, rows in expect.items():
        assert getattr(prog, field).tolist() == rows, field
    assert (prog.recv_down_kind == 0).all() and (prog.local_act_write == -1).all()
    assert [prog.act_slots, prog.grad_slots, prog.stash_slots, prog.seed_slots, prog.w_slots] == [1] * 5


def _sends(prog, kind):
    """{send} over the ops of `kind`, and whether any of them hands its output over locally."""
    mask = prog.kind == kind
    local = (prog.local_act_write if kind == F else prog.local_grad_write)[mask]
    return set(prog.send[mask].tolist()), bool((local >= 0).any())


def test_permute_directions():
    """The ring sends activations up and gradients down (the wrap included); the V sends both ways and hands
    chunk p - 1's output to chunk p on device p - 1; one device keeps everything local."""
    ring = slot_program.program(zero_bubble.build("zb-h1", 4, 8, 2))
    assert _sends(ring, F) == ({0, 1}, False) and _sends(ring, B) == ({0, -1}, False)
    v = slot_program.program(zero_bubble.build("zb-v", 4, 8, 2))
    assert _sends(v, F) == ({0, 1, -1}, True) and _sends(v, B) == ({0, 1, -1}, True)
    assert (v.recv_up_kind[:, 0] != ACT).all() and (v.recv_down_kind[:, 3] != ACT).all()  # no wrap
    one = slot_program.program(zero_bubble.build("zb-v", 1, 4, 2))
    assert (one.send == 0).all() and (one.local_act_write >= 0).any()


def test_ring_sizes_for_four_devices_and_eight_microbatches():
    sizes = {
        (name, v): [
            getattr(slot_program.program(zero_bubble.build(name, 4, 8, v)), f"{r}_slots")
            for r in "act grad stash seed w".split()
        ]
        for name, v in (("1f1b", 1), ("1f1b", 2), ("zb-h1", 1), ("zb-h1", 2), ("zb-v", 2))
    }
    assert sizes == {
        ("1f1b", 1): [1, 1, 4, 1, 1],
        ("1f1b", 2): [2, 2, 11, 1, 1],
        ("zb-h1", 1): [1, 1, 4, 1, 4],
        ("zb-h1", 2): [3, 1, 8, 1, 7],
        ("zb-v", 2): [1, 1, 8, 3, 8],
    }


def _first(prog, kind, field, device=None):
    """(slot, device) of the first op of `kind` with `field` >= 0 (on `device` when given)."""
    for t, s in zip(*np.nonzero((prog.kind == kind) & (getattr(prog, field) >= 0))):
        if device is None or s == device:
            return int(t), int(s)
    raise AssertionError(f"no {kind} with {field}")


def _edit(prog, field, t, s, value):
    a = getattr(prog, field).copy()
    a[t, s] = value
    return dataclasses.replace(prog, **{field: a})


def _broken(how):
    table = zero_bubble.build("zb-h1", 4, 8, 2)  # act ring 3, stash ring 8
    prog = slot_program.program(table)
    if how == "reads":
        t, s = _first(prog, F, "act_read")
        prog = _edit(prog, "act_read", t, s, (prog.act_read[t, s] + 1) % prog.act_slots)
    elif how == "overwrites":
        stash = prog.stash_write[prog.kind[:, 0] == F, 0]
        t = int(np.nonzero((prog.kind[:, 0] == F) & (prog.stash_write[:, 0] == stash[1]))[0][0])
        prog = _edit(prog, "stash_write", t, 0, stash[0])  # F(0, 0)'s stash is not read yet
    elif how == "unused":
        t, s = _first(prog, F, "stash_write")
        prog = _edit(prog, "w_write", t, s, 0)
    elif how == "sends":
        t, s = _first(prog, F, "stash_write", device=1)
        prog = _edit(prog, "send", t, s, -1)
    elif how == "receives":
        t, s = map(int, np.argwhere(prog.recv_up_kind == ACT)[0])
        prog = _edit(prog, "recv_up_kind", t, s, 0)
    else:  # the program of another table
        prog = slot_program.program(zero_bubble.build("1f1b", 4, 8, 2))
    return prog, table


@pytest.mark.parametrize(
    "how,message",
    [
        ("reads", "act_read .* needs"),
        ("overwrites", "over a value not yet read"),
        ("unused", "does not use"),
        ("sends", "sends"),
        ("receives", "receives"),
        ("other", "where the table runs"),
    ],
)
def test_simulate_catches_broken_instructions(how, message):
    prog, table = _broken(how)
    with pytest.raises(AssertionError, match=message):
        slot_program.simulate(prog, table)
