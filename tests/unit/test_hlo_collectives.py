"""Golden check of the collectives in the compiled train step, per scanned layer, of the HLO parser, and of
the collectives XLA:CPU's backend passes widen.

The tiny model (2 layers, fp32) is compiled on (tensor=2) and (fsdp=2, tensor=2), sequence parallelism off and
on. The layers run in two while loops (trip count = n_layers): the forward scan (op_name `.../jvp()/while`) and
the backward scan (`.../transpose(jvp())/while`); `model.remat=none`. Counts are per loop body, i.e. per layer.

Where each expected count comes from (jaxpar/parallel/tensor.py, jaxpar/model/layers.py):
  tensor, no SP   forward: 2 all-reduces of [b, T, D] (attention out-projection and MLP down-projection exits,
                  `_reduce_from_tensor`); backward: 2 all-reduces (the attention and MLP enters, Megatron f,
                  `_copy_bwd`). XLA's all-reduce combiner does not merge the two of a loop body (each depends on
                  the previous one's consumer), so the honest count is 2 + 2.
  tensor, SP      forward: 2 all-gathers over T (enters) + 2 reduce-scatters over T (exits); backward: the
                  transposes, 2 reduce-scatters + 2 all-gathers; no all-reduce over tensor in either loop.
  fsdp            forward: 9 all-gathers over fsdp, one per block parameter (attn_norm, wq, wk, wv, wo,
                  mlp_norm, w_gate, w_up, w_down; `jaxpar.parallel.gather`); backward: their 9 gradient
                  reduce-scatters over fsdp, and the 9 re-gathers of the weights (see BACKWARD_REGATHERS).
Outside the loops the embedding/head/cross-entropy collectives and the optimizer's compiler-inserted reductions
run once; the combiner merges some of them into tuple all-reduces (e.g. the head's backward all-reduce with a
grad-norm partial sum), so they are only checked in total by benchmarks/tensor_collectives.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from step_helpers import FP32, compile_fast, device_batch, host_batch, make_plan

from jaxpar.analysis.hlo.collectives import (
    classify_groups,
    collectives_by_axis,
    parse_collectives,
    parse_replica_groups,
    while_loops,
)
from jaxpar.analysis.hlo.ring import ring_bytes
from jaxpar.analysis.planner.compiled import PARTITIONER_PASS, read_partitioned_hlo
from jaxpar.training.state import abstract_state
from jaxpar.training.step import make_train_step

N_LAYERS = 2  # step_helpers.TINY
BLOCK_PARAMS = 9  # attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down
# With remat=none the all-gathered block weights are not kept for the backward (FSDP's memory saving): the
# backward loop all-gathers each of them again. (An earlier "save anything except the named gathered weight"
# policy gave 0 re-gathers: the unnamed gather output, and casts or reshapes of it, were saved instead.)
BACKWARD_REGATHERS = BLOCK_PARAMS


def _layer_loops(hlo_text: str) -> tuple[str, str]:
    """(forward body, backward body) of the scanned layers."""
    loops = [w for w in while_loops(hlo_text) if w.op_name.endswith("/while") and w.trip_count == N_LAYERS]
    fwd = [w.body for w in loops if "transpose(" not in w.op_name]
    bwd = [w.body for w in loops if "transpose(" in w.op_name]
    assert len(fwd) == 1 and len(bwd) == 1, [(w.name, w.op_name) for w in loops]
    return fwd[0], bwd[0]


def _counts(hlo_text, mesh, body) -> dict:
    """{(axes, kind): count} of the collectives in one loop body (static: once per layer)."""
    table = collectives_by_axis(hlo_text, mesh, per_step=False, computations={body})
    return {key: v["count"] for key, v in table.items()}


@pytest.mark.parametrize("fsdp", [1, 2])
@pytest.mark.parametrize("sp", [False, True])
def test_layer_collectives(fsdp, sp):
    devices = jax.devices()[: 2 * fsdp]
    plan = make_plan(
        [*FP32, "mesh.data=1", f"mesh.fsdp={fsdp}", "mesh.tensor=2", f"tensor.sequence_parallel={str(sp).lower()}"],
        devices,
    )
    batch = device_batch(plan, host_batch([8] * 8, 8, seed=0))
    text = compile_fast(make_train_step(plan), abstract_state(plan), batch).as_text()
    fwd, bwd = _layer_loops(text)
    tensor = ("tensor",)
    if sp:
        want_tensor = {(tensor, "all-gather"): 2, (tensor, "reduce-scatter"): 2}
    else:
        want_tensor = {(tensor, "all-reduce"): 2}
    want_fwd, want_bwd = dict(want_tensor), dict(want_tensor)
    if fsdp > 1:
        want_fwd[(("fsdp",), "all-gather")] = BLOCK_PARAMS
        want_bwd[(("fsdp",), "reduce-scatter")] = BLOCK_PARAMS
        if BACKWARD_REGATHERS:
            want_bwd[(("fsdp",), "all-gather")] = BACKWARD_REGATHERS
    assert _counts(text, plan.mesh, fwd) == want_fwd
    assert _counts(text, plan.mesh, bwd) == want_bwd
    # Per step, each loop body runs once per layer.
    per_step = collectives_by_axis(text, plan.mesh, computations={fwd, bwd})
    assert per_step[(tensor, "reduce-scatter" if sp else "all-reduce")]["count"] == 2 * 2 * N_LAYERS
    # The activation collectives carry [b, T, D] (b = 8 rows per device / fsdp): ring bytes
    # (`jaxpar.analysis.hlo.ring.ring_bytes`).
    x_bytes = 8 // fsdp * 8 * 64 * 4
    for c in parse_collectives(text):
        if c.computation in (fwd, bwd) and classify_groups(c.groups, plan.mesh) == tensor:
            size = c.size_bytes
            assert size == x_bytes, (c.name, c.kind, size)
            assert c.bytes_per_device == (x_bytes if c.kind == "all-reduce" else x_bytes / 2)


def test_partition_ids_are_mesh_positions():
    """Replica-group ids are positions in mesh.devices.flat, not jax.Device.id: a mesh over a permuted device
    list gives the same groups as one over the devices in order."""
    devices = np.array(jax.devices())[[3, 0, 6, 5, 1, 7, 2, 4]].reshape(2, 4)
    mesh = Mesh(devices, ("a", "b"))
    body = lambda x: jax.lax.psum(x, "a") + jax.lax.all_gather(x, "b", tiled=True).sum()  # noqa: E731
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("a", "b"), out_specs=P("a", "b")))
    found = {c.kind: c for c in parse_collectives(f.lower(jnp.ones((4, 8))).compile().as_text())}
    assert found["all-reduce"].groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert classify_groups(found["all-reduce"].groups, mesh) == ("a",)
    assert classify_groups(found["all-gather"].groups, mesh) == ("b",)


def test_a_permute_between_some_stages_runs_over_their_axis():
    """A collective-permute's groups are the components of its pairs; one that moves data between two of four
    pipeline stages (interleaved 1F1B's chunk-order permutes, chunk 0 staying on device 0) runs over
    `pipeline`, though no axis induces its components as an all-reduce's groups."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "pipeline"))
    groups = parse_replica_groups("source_target_pairs={{0,0},{1,2},{4,4},{5,6}}", 8)
    assert sorted(groups) == [(0,), (1, 2), (4,), (5, 6)]
    assert classify_groups(groups, mesh, "collective-permute") == ("pipeline",)
    assert classify_groups(groups, mesh) is None
    across = parse_replica_groups("source_target_pairs={{1,5},{5,1}}", 8)
    assert classify_groups(across, mesh, "collective-permute") == ("data",)
    to_itself = parse_replica_groups("source_target_pairs={{0,0},{5,5}}", 8)
    assert classify_groups(to_itself, mesh, "collective-permute") == ()


def test_cpu_backend_widens_bf16_collectives(tmp_path):
    """Which collectives XLA:CPU rewrites, seen in HLO: one bf16 all-reduce, reduce-scatter, all-gather and
    collective-permute each stay bf16 in the partitioned program (after the SPMD partitioner, before any backend
    pass) and are fp32 in the CPU executable (AllReducePromotion BF16 -> F32 for the first two, FloatNormalization
    for the others), the same ops in the same groups; fp32 ones are untouched. jaxpar.analysis.planner.plan's cpu
    platform counts collectives this way (`jaxpar.analysis.planner.dims.collective_bytes`)."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))

    def body(a, b):
        out = [
            jax.lax.psum(a, "x"),
            jax.lax.psum_scatter(a, "x", tiled=True),
            jax.lax.all_gather(a, "x", tiled=True),
            jax.lax.ppermute(a, "x", [(i, (i + 1) % 4) for i in range(4)]),
        ]
        return [*out, jax.lax.psum(b, "x")]

    def collectives(a, b):
        return jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"))(a, b)

    lowered = jax.jit(collectives).lower(jnp.ones((16, 8), jnp.bfloat16), jnp.ones((16, 8), jnp.float32))
    executable = lowered.compile(
        {"xla_dump_to": str(tmp_path), "xla_dump_hlo_pass_re": PARTITIONER_PASS, "xla_dump_hlo_as_text": True}
    )

    def table(text):
        """{(kind, dtype): elements of the operands}, and the number of all-reduce instructions."""
        out: dict = {}
        found = parse_collectives(text)
        for c in found:
            assert c.groups == ((0, 1, 2, 3),), c
            for a in c.operands:
                out[(c.kind, a.dtype)] = out.get((c.kind, a.dtype), 0) + math.prod(a.shape)
        return out, sum(c.kind == "all-reduce" for c in found)

    program, compiled = table(read_partitioned_hlo(str(tmp_path), "collectives")), table(executable.as_text())
    kinds, shard = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute"), 16 * 8 // 4
    assert program == ({**{(k, "bf16"): shard for k in kinds}, ("all-reduce", "f32"): shard}, 2)
    # The same elements, all in fp32; the two all-reduces are one tuple all-reduce there (combined, not resized).
    assert compiled == ({**{(k, "f32"): shard for k in kinds}, ("all-reduce", "f32"): 2 * shard}, 1)


def test_replica_group_forms():
    assert parse_replica_groups("replica_groups={{0,1},{2,3}}, dimensions={0}", 4) == ((0, 1), (2, 3))
    assert parse_replica_groups("replica_groups={}, to_apply=%add", 4) == ((0, 1, 2, 3),)
    assert parse_replica_groups("replica_groups=[2,4]<=[8], dimensions={0}", 8) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert parse_replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), x", 8) == ((0, 4), (1, 5), (2, 6), (3, 7))
    # Mesh-axes form as XLA prints it for compiler-combined reductions (seen on data=2 fsdp=2 tensor=2): the mesh
    # [2,4] holds iota(8).reshape(2,2,2).transpose(1,0,2), i.e. rows [0,1,4,5] and [2,3,6,7]; groups run along
    # axis_0.
    attrs = "replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_0'}, use_global"
    assert parse_replica_groups(attrs, 8) == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert parse_replica_groups("replica_groups=mesh['x'=2,'y'=2] {'y'}", 4) == ((0, 1), (2, 3))
    assert parse_replica_groups("source_target_pairs={{0,1},{1,0},{2,3},{3,2}}", 4) == ((0, 1), (2, 3))
    with pytest.raises(ValueError):
        parse_replica_groups("replica_groups=mesh['x'=4] {'x':(1)2}", 4)


def test_ring_bytes():
    assert ring_bytes("all-reduce", 1000, 4) == 1500
    assert ring_bytes("all-gather", 1000, 4) == 750
    assert ring_bytes("reduce-scatter", 1000, 4) == 750
    assert ring_bytes("all-reduce", 1000, 1) == 0
    with pytest.raises(ValueError):
        ring_bytes("broadcast", 1, 2)


def test_permute_bytes_and_trip_count_fallback():
    """A collective-permute inside a while loop whose trip count is only in the condition's compare."""
    text = """HloModule m, num_partitions=4

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %cp = f32[8]{0} collective-permute(%x), channel_id=1, source_target_pairs={{0,0},{1,2},{2,1},{3,3}}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %cp)
}

%cond (p.1: (s32[], f32[8])) -> pred[] {
  %p.1 = (s32[], f32[8]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%z, %a)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[8]{0} get-tuple-element(%w), index=1
}
"""
    (c,) = parse_collectives(text)
    assert c.kind == "collective-permute" and c.computation == "body"
    assert c.times_per_step == 5 and c.trip_count_known
    assert c.bytes_per_device == 32  # f32[8], sent whole by each device that moves it
