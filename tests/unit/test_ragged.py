"""The ragged all-to-all of dropless expert parallelism (`jaxpar.parallel.ragged`, `jaxpar.parallel.expert`): the
emulation against a numpy model of `jax.lax.ragged_all_to_all`'s semantics, the dispatch's offsets (round trip,
receive-buffer overflow dropped and counted), gradients through the emulated dispatch and combine against the layer
without expert parallelism, the transport's resolution per platform, and (`requires_gpu_compile`) the GPU
compile's ragged-all-to-all ops.

Simulated CPU devices (tests/conftest.py). Letters: n ranks, A assignments per device, R receive rows, El local
experts, D model width.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from step_helpers import make_plan

from jaxpar.config import load_config
from jaxpar.config.errors import ConfigError
from jaxpar.config.moe import resolve_all_to_all
from jaxpar.model.moe import dropless_experts
from jaxpar.parallel.expert import ExpertParallel, receive_rows
from jaxpar.parallel.ragged import ragged_all_to_all

TINY_YAML = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "configs", "tiny.yaml")
AXES = ("data", "fsdp")  # two mesh axes: the ops take a tuple of axis names, ranks major to minor


def _mesh(devices, shape=(2, 4)) -> Mesh:
    return Mesh(np.asarray(devices[: np.prod(shape)]).reshape(shape), AXES)


def _ragged_reference(operand, output, in_off, send, out_off, recv):
    """`jax.lax.ragged_all_to_all`'s docstring in numpy over the n devices' stacked arguments ([n, ...] each):
    every device's `output` with each slice i of each sender s written on device i // m at the sender's
    out_off[s, i]; `recv` must agree with `send`."""
    n, k = send.shape
    m = k // n
    result = output.copy()
    for s in range(n):
        for i in range(k):
            d, c, size = i // m, i % m, send[s, i]
            assert recv[d, s * m + c] == size
            result[d, out_off[s, i] : out_off[s, i] + size] = operand[s, in_off[s, i] : in_off[s, i] + size]
    return result


def _random_ragged(rng, n, m, rows_in, rows_out):
    """Valid random arguments for n devices, m slices per destination: each receiver's incoming slices (sizes
    from 0 up, many zero) packed in a random order with random gaps inside its `rows_out` rows; each sender's
    slices from random offsets of its `rows_in` rows (slices may overlap on the sender)."""
    k = n * m
    send = np.zeros((n, k), np.int32)
    in_off, out_off, recv = np.zeros_like(send), np.zeros_like(send), np.zeros_like(send)
    for d in range(n):
        total = rng.integers(0, rows_out + 1)
        cuts = np.sort(rng.integers(0, total + 1, n * m - 1))
        sizes = np.minimum(np.diff(np.concatenate([[0], cuts, [total]])), rows_in)  # per (source, c), sum <= R
        gaps = rng.multinomial(rows_out - sizes.sum(), np.ones(n * m + 1) / (n * m + 1))
        at = 0
        for j, slot in enumerate(rng.permutation(n * m)):  # slot = s * m + c
            s, c = divmod(int(slot), m)
            at += gaps[j]
            send[s, d * m + c] = recv[d, slot] = sizes[slot]
            out_off[s, d * m + c] = at
            in_off[s, d * m + c] = rng.integers(0, rows_in - sizes[slot] + 1)
            at += sizes[slot]
    return in_off, send, out_off, recv


def _per_device(mesh, fn, *args):
    """fn on each device's slice of the stacked args ([n, ...] each; leading dim split over AXES)."""
    spec = P(AXES)
    body = jax.shard_map(
        lambda *a: fn(*(x[0] for x in a))[None], mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec
    )
    return np.asarray(jax.jit(body)(*args))


@pytest.mark.parametrize("m", [1, 2])
def test_emulation_equals_the_ragged_semantics(devices8, m):
    """Random sizes with zero-size slices, a nonzero `output` prefill (kept where nothing lands), m slices per
    destination, over two mesh axes."""
    rng = np.random.default_rng(m)
    n, rows_in, rows_out = 8, 6, 13
    in_off, send, out_off, recv = _random_ragged(rng, n, m, rows_in, rows_out)
    assert (send == 0).any() and (send > 0).any()
    operand = rng.normal(size=(n, rows_in, 3)).astype(np.float32)
    output = rng.normal(size=(n, rows_out, 3)).astype(np.float32) + 10.0  # prefill, far from operand's values

    def emulated(*a):
        return ragged_all_to_all(*a, AXES, emulate=True)

    got = _per_device(_mesh(devices8), emulated, operand, output, in_off, send, out_off, recv)
    want = _ragged_reference(operand, output, in_off, send, out_off, recv)
    np.testing.assert_array_equal(got, want)
    assert (got == output).any() and (got != output).any()  # some rows untouched, some written


def _dispatch_reference(counts, r):
    """numpy model of the dispatch's offsets: counts[s, d, j] assignments of source s for destination d's local
    expert j. Each destination takes its sources source-major and keeps the first R rows. Returns (kept[s, d, j],
    dropped per source)."""
    n, _, el = counts.shape
    kept = np.zeros_like(counts)
    for d in range(n):
        room = r
        for s in range(n):
            for j in range(el):
                kept[s, d, j] = min(counts[s, d, j], room)
                room -= kept[s, d, j]
    return kept, counts.sum(axis=(1, 2)) - kept.sum(axis=(1, 2))


@pytest.mark.parametrize("receive_factor", [0.0, 1.5])
def test_dispatch_then_combine_returns_every_kept_row(devices8, receive_factor):
    """Skewed routing (device 0's experts take most assignments): with receive_factor 0 (R = n * A) every row
    comes back; with 1.5 (R = 1.5 A) the overflow at device 0 is dropped (zeros back) and counted exactly as the
    numpy model says. The dispatched rows are every kept row, grouped by local expert (then by source), padding
    zero."""
    n, a, el, d = 8, 12, 2, 2
    rng = np.random.default_rng(0)
    experts = np.sort(np.where(rng.random((n, a)) < 0.6, rng.integers(0, el, (n, a)), rng.integers(0, n * el, (n, a))))
    sizes = np.stack([np.bincount(e, minlength=n * el) for e in experts]).astype(np.int32)  # [n, E]
    xs = np.stack([np.arange(n)[:, None].repeat(a, 1), np.arange(a)[None, :].repeat(n, 0)], -1) + 1.0  # unique rows
    xs = xs.astype(np.float32)
    r = receive_rows(n, a, receive_factor)
    ep = ExpertParallel(AXES, ragged=False, receive_factor=receive_factor)

    def body(xs_AD, sizes_E):
        rows, groups, routing = ep.dispatch_dropless(xs_AD, sizes_E)
        back = ep.combine_dropless(rows, routing)
        return rows, groups, back, routing.dropped

    spec = P(AXES)
    fn = jax.shard_map(
        lambda x, s: tuple(v[None] for v in body(x[0], s[0])),
        mesh=_mesh(devices8),
        in_specs=(spec, spec),
        out_specs=(spec,) * 4,
    )
    rows, groups, back, dropped = (np.asarray(v) for v in jax.jit(fn)(xs, sizes))

    kept, want_dropped = _dispatch_reference(sizes.reshape(n, n, el), r)
    np.testing.assert_array_equal(dropped, want_dropped)
    assert (want_dropped > 0).any() == (receive_factor > 0)
    assert rows.shape == (n, r, d)
    np.testing.assert_array_equal(groups, kept.sum(axis=0))
    for dst in range(n):  # the rows received: local expert-major, then source-major, the kept prefix of each
        want = [
            xs[s][np.flatnonzero(experts[s] == dst * el + j)[: kept[s, dst, j]]] for j in range(el) for s in range(n)
        ]
        want = np.concatenate(want)
        np.testing.assert_array_equal(rows[dst, : len(want)], want)
        assert not rows[dst, len(want) :].any()
    for s in range(n):  # back home: the kept rows of each (destination, expert), zeros for the dropped ones
        keep = np.zeros(a, bool)
        for e in range(n * el):
            keep[np.flatnonzero(experts[s] == e)[: kept[s, e // el, e % el]]] = True
        np.testing.assert_array_equal(back[s], np.where(keep[:, None], xs[s], 0.0))


def test_gradients_through_the_emulated_dispatch_equal_the_layer_without_experts_split(devices8):
    """The layer's output and its gradients (input, the three expert weights) with the experts over 2 x 4 devices
    (each device: 2 of the 8 experts, its own rows) equal the one-device layer at fp32 tolerance (1e-5: the
    grouped matmuls sum in another order)."""
    b, t, d, e, k, f = 8, 6, 4, 8, 2, 5
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (b, t, d))
    idx = jax.random.randint(keys[1], (b, t, k), 0, e)
    w = (
        jax.random.normal(keys[2], (e, d, f)) / 2,
        jax.random.normal(keys[3], (e, d, f)) / 2,
        jax.random.normal(keys[4], (e, f, d)) / 2,
    )
    cot = jax.random.normal(keys[5], (b, t, k, d))
    ep = ExpertParallel(AXES, ragged=False)
    spec = P(AXES)

    def split_loss(x, w_gate, w_up, w_down, cot):
        # this device's part of the loss: each device seeds its own; the collectives' transposes carry them
        y, dropped = dropless_experts(x, idx_split(x), w_gate, w_up, w_down, ep)
        return jnp.sum(y * cot), dropped

    def idx_split(x):  # this device's rows of idx
        r = jax.lax.axis_index(AXES)
        return jax.lax.dynamic_slice_in_dim(idx, r * x.shape[0], x.shape[0])

    def split(x, wg, wu, wd, cot):
        (loss, dropped), grads = jax.value_and_grad(split_loss, argnums=(0, 1, 2, 3), has_aux=True)(x, wg, wu, wd, cot)
        return jax.lax.psum(loss, AXES), jax.lax.psum(dropped, AXES), grads

    fn = jax.jit(
        jax.shard_map(
            split, mesh=_mesh(devices8), in_specs=(spec,) * 5, out_specs=(P(), P(), (spec,) * 4), check_vma=False
        )
    )
    assert "all-to-all" in fn.lower(x, *w, cot).as_text(dialect="hlo")  # the experts really travel
    loss, dropped, grads = fn(x, *w, cot)

    def whole(x, wg, wu, wd):
        return jnp.sum(dropless_experts(x, idx, wg, wu, wd)[0] * cot)

    want_loss, want_grads = jax.value_and_grad(whole, argnums=(0, 1, 2, 3))(x, *w)
    assert int(dropped) == 0
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_transport_follows_the_platform():
    assert resolve_all_to_all("auto", "gpu") == resolve_all_to_all("auto", "tpu") == "ragged"
    assert resolve_all_to_all("auto", "cpu") == resolve_all_to_all("emulated", "gpu") == "emulated"
    with pytest.raises(ConfigError, match=r"model\.moe\.all_to_all=ragged.*set model\.moe\.all_to_all=auto"):
        resolve_all_to_all("ragged", "cpu")


MOE = ("model.moe.num_experts=8", "model.moe.expert_axes=[data,fsdp]", "mesh.data=2", "mesh.fsdp=4")


def test_the_plan_resolves_the_transport_for_its_devices(devices8):
    """On CPU devices `auto` is the emulation, in the model config the plan builds the model from; `ragged` is
    refused there, naming the fix. (On GPU devices: the test below.)"""
    assert make_plan(MOE, devices8).mdef.cfg.moe.all_to_all == "emulated"
    with pytest.raises(ConfigError, match=r"model\.moe\.all_to_all=ragged needs .* runs on cpu"):
        make_plan([*MOE, "model.moe.all_to_all=ragged"], devices8)
    moe = make_plan([*MOE, "model.moe.receive_factor=2"], devices8).mdef.cfg.moe
    assert ExpertParallel.of(moe) == ExpertParallel(AXES, ragged=False, receive_factor=2.0)


@pytest.mark.parametrize(
    "overrides, warns",
    [
        ((*MOE, "mesh.tensor=1"), False),
        ((*MOE, "mesh.tensor=1", "model.moe.routing=capacity"), True),
        (("model.moe.num_experts=8",), True),  # no expert axes
        (("model.moe.num_experts=8", "model.moe.expert_axes=[fsdp]", "mesh.data=4", "mesh.fsdp=1"), True),  # size 1
        (("model.moe.expert_axes=[fsdp]",), True),  # a dense model
    ],
)
def test_a_receive_factor_that_sizes_nothing_warns(caplog, overrides, warns):
    with caplog.at_level("WARNING", logger="jaxpar.config.moe"):
        load_config(TINY_YAML, [*overrides, "model.moe.receive_factor=2"], num_devices=8)
    assert ("model.moe.receive_factor=2.0 has no effect" in caplog.text) == warns, caplog.text


@pytest.mark.requires_gpu_compile
def test_gpu_compile_sends_ragged_all_to_alls_and_no_padded_buffer():
    """The layer's forward and backward with experts over data=2 x fsdp=4 on 8 compile-only H100s: four
    ragged-all-to-alls (dispatch and combine, and their transposes), and every dense all-to-all is one of the
    int32 offsets' (no [n, A, D] padded buffer)."""
    from jaxpar.analysis.gpu.deviceless import compile_devices
    from jaxpar.analysis.gpu.targets import cluster

    devices = compile_devices(cluster("h100", 1, 8))
    assert ExpertParallel.of(make_plan(MOE, devices).mdef.cfg.moe) == ExpertParallel(AXES, ragged=True)
    mesh = _mesh(devices)
    b, t, d, e, k, f = 8, 16, 64, 8, 2, 32
    ep = ExpertParallel(AXES, ragged=True)
    spec = P(AXES)

    def loss(x, idx, wg, wu, wd):  # this device's part
        return jnp.sum(dropless_experts(x, idx, wg, wu, wd, ep)[0].astype(jnp.float32) ** 2)

    grad = jax.shard_map(
        jax.grad(loss, argnums=(0, 2, 3, 4)), mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec,) * 4, check_vma=False
    )
    shapes = [(b, t, d), (b, t, k), (e, d, f), (e, d, f), (e, f, d)]
    dtypes = [jnp.bfloat16, jnp.int32, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16]
    args = [
        jax.ShapeDtypeStruct(s, dt, sharding=jax.sharding.NamedSharding(mesh, spec))
        for s, dt in zip(shapes, dtypes, strict=True)
    ]
    lines = jax.jit(grad).lower(*args).compile().as_text().splitlines()
    a = b // 8 * t * k  # one device's assignments
    ragged = [s for s in lines if re.search(r"\sragged-all-to-all(-start)?\(", s)]
    assert len(ragged) == 4, ragged  # forward dispatch and combine, and their transposes in the backward
    # each sends its own rows ([A, D] dispatch, [R, D] = [8 A, D] combine) into the other's buffer, over all 8
    rows = sorted(re.search(r"\(\(bf16\[(\d+),64\]", s).group(1) for s in ragged)
    assert rows == sorted([str(a), str(a), str(8 * a), str(8 * a)]), rows
    assert all("replica_groups={{0,1,2,3,4,5,6,7}}" in s for s in ragged)
    dense = [s.split(" all-to-all")[0] for s in lines if re.search(r"\sall-to-all(-start)?\(", s)]
    assert dense and all("bf16" not in s and "f32" not in s for s in dense), dense  # offsets only, int32
