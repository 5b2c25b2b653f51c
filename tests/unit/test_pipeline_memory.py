"""Temporary memory of the pipelined gradient computation: 1F1B stays flat in the number of microbatches,
GPipe grows with it.

The gradient function (`make_grad_fn`) for p = 4 stages (mesh pipeline=4 on 4 devices) is compiled, not run,
from abstract inputs, and `memory_analysis().temp_size_in_bytes` read per device. Model: L = 4 (one layer per
stage), D = 64, F = 128, T = 32, V = 264, fp32, so activations dominate the temporaries.

Two regimes, because the microbatch size b = G / M changes what "more microbatches" means:

* Fixed microbatch size (b = 2 rows, G = 2M): the claim. 1F1B keeps at most 2p - 1 stage inputs in its stash
  ring and accumulates weight gradients into running sums, so its temporaries do not depend on M: flat within
  5% (measured: identical to within 64 bytes). GPipe differentiates the whole forward loop, which keeps every
  tick's residuals (m + p - 1 ticks), so its temporaries grow linearly in M: a constant number of bytes per
  extra microbatch.
* Fixed global batch (G = 64): b shrinks as M grows, so every per-microbatch buffer shrinks. 1F1B's
  temporaries (stash of 2p - 1 microbatch inputs plus one tick's work, all proportional to b) fall about as 1/M;
  GPipe's hold about (M + p - 1) microbatches' residuals, i.e. (M + p - 1) / M times the whole batch's, so they
  fall too, towards a floor of one batch's residuals, and stay far above 1F1B's.

Measured on XLA:CPU with these compile options, bytes per device:

    M                    4            8           16           32
    fixed b = 2
      1F1B         916,616      916,616      916,616      916,680
      GPipe      2,808,224    4,003,232    6,393,248   11,173,280   (+298,752 per microbatch)
    fixed G = 64
      1F1B       6,149,704    3,170,888    1,713,224      916,680
      GPipe     20,976,800   15,396,000   12,605,600   11,173,280

Only M = 4 and M = 32 are compiled for the fixed-G regime here (M = 32 is the same program in both regimes).

Shape letters: G global batch, b microbatch rows, T sequence length, L layers, D model width, F mlp hidden
width, V vocabulary, M microbatches, p stages.
"""

import functools

import jax
import pytest
from step_helpers import FP32, compile_fast, make_plan, quick_compile, shard_shape

from jaxpar.data.batch import abstract_batch
from jaxpar.training.state import abstract_state
from jaxpar.training.step import make_grad_fn

P_STAGES = 4
T = 32
L = 4
B = 2  # rows per microbatch in the fixed-microbatch regime
MICROBATCHES = (4, 8, 16, 32)
G_FIXED = B * MICROBATCHES[-1]  # the fixed global batch: 64


def _temp_bytes(schedule: str, m: int, g: int, p: int = P_STAGES, layers: int = L, v: int = 1) -> int:
    """Temporary bytes per device of the gradient function, schedule "1f1b" (pipeline.recompute=false, the
    default), "1f1b-recompute" or "gpipe"."""
    recompute = schedule == "1f1b-recompute"
    schedule = schedule.removesuffix("-recompute")
    plan = make_plan(
        [
            *FP32,
            f"model.n_layers={layers}",
            f"data.seq_len={T}",
            "mesh.data=1",
            "mesh.fsdp=1",
            f"mesh.pipeline={p}",
            f"pipeline.virtual_stages={v}",
            f"pipeline.microbatches={m}",
            f"pipeline.schedule={schedule}",
            f"pipeline.recompute={str(recompute).lower()}",
            f"train.global_batch_size={g}",
        ],
        jax.devices()[:p],
    )
    params = abstract_state(plan)["params"]  # ShapeDtypeStructs with shardings: nothing is allocated
    w = params["blocks"]["mlp"]["w_up"]
    assert plan.mesh.shape["pipeline"] == p and shard_shape(w)[0] == layers // p  # L/p layers per stage
    batch = abstract_batch(g, T, plan.batch_sharding)
    compiled = compile_fast(jax.jit(make_grad_fn(plan)), params, batch)
    return int(compiled.memory_analysis().temp_size_in_bytes)


class _CompiledOnUse(dict):
    """A dict whose missing entry `key` is compiled on first use, `compute(*key)` under `quick_compile`, and
    kept: a test compiles only the programs it reads (the default suite's read two of each fixture's)."""

    def __init__(self, compute):
        super().__init__()
        self._compute = compute

    def __missing__(self, key):
        with quick_compile():
            self[key] = value = self._compute(*key)
        print(f"{key}: {value:,} temp bytes per device")
        return value


@pytest.fixture(scope="module")
def temp(need_devices) -> dict:
    """{(regime, schedule, M): temporary bytes per device}, regime "b" (fixed microbatch) or "G" (fixed batch);
    at M = 32 both regimes are one program."""
    need_devices(P_STAGES)
    temp_bytes = functools.cache(_temp_bytes)  # at M = 32 the two regimes' keys share one compile
    return _CompiledOnUse(lambda regime, schedule, m: temp_bytes(schedule, m, B * m if regime == "b" else G_FIXED))


@pytest.mark.slow  # compiles 8 pipelined steps (about 20 s on 2 cores)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "1f1b-recompute"])
def test_1f1b_temp_is_flat_in_microbatches_at_fixed_microbatch_size(temp, schedule):
    values = [temp["b", schedule, m] for m in MICROBATCHES]
    assert max(values) <= 1.05 * min(values), values


@pytest.mark.slow  # compiles 4 to 12 pipelined steps
@pytest.mark.timeout(300)
def test_1f1b_residual_stash_costs_what_it_keeps(temp):
    """Keeping residuals costs more memory than recomputing (2p - 1 microbatches' residuals instead of
    2p - 1 stage inputs) but stays below GPipe's, which keeps m + p - 1 ticks' residuals."""
    for m in MICROBATCHES:
        assert temp["b", "1f1b-recompute", m] < temp["b", "1f1b", m] < temp["b", "gpipe", m], m


@pytest.mark.slow  # compiles 4 to 12 pipelined steps
@pytest.mark.timeout(300)
def test_gpipe_temp_grows_linearly_in_microbatches_at_fixed_microbatch_size(temp):
    values = [temp["b", "gpipe", m] for m in MICROBATCHES]
    assert all(a < b for a, b in zip(values, values[1:])), values
    assert values[-1] > 2 * values[0], values
    # Linear: every extra microbatch keeps the same residuals (one more tick of the differentiated loop).
    slopes = [
        (b - a) / (mb - ma) for (a, ma), (b, mb) in zip(zip(values, MICROBATCHES), zip(values[1:], MICROBATCHES[1:]))
    ]
    assert max(slopes) <= 1.05 * min(slopes), slopes
    for m in MICROBATCHES:
        assert temp["b", "gpipe", m] > temp["b", "1f1b-recompute", m]


@pytest.mark.slow  # compiles 4 to 12 pipelined steps
@pytest.mark.timeout(300)
def test_temp_at_fixed_global_batch(temp):
    first, last = MICROBATCHES[0], MICROBATCHES[-1]
    # 1F1B: every buffer is proportional to the microbatch size G / M, which shrinks.
    for one in ("1f1b", "1f1b-recompute"):
        assert temp["G", one, last] <= temp["G", one, first]
    # GPipe: (M + p - 1) / M batches' residuals, shrinking towards one batch's; far above 1F1B with recompute
    # throughout. 1F1B keeping residuals holds 2p - 1 microbatches' residuals: at M = 4 = p as many
    # microbatches as GPipe's M + p - 1 ticks (about its memory), at M = 32 far fewer.
    assert temp["G", "gpipe", last] <= temp["G", "gpipe", first]
    for m in (first, last):
        assert temp["G", "gpipe", m] > 2 * temp["G", "1f1b-recompute", m]
    assert temp["G", "1f1b", first] < 1.1 * temp["G", "gpipe", first]
    assert temp["G", "gpipe", last] > 2 * temp["G", "1f1b", last]
    # The gap widens with M: GPipe keeps the whole batch, 1F1B only 2p - 1 ever smaller microbatches.
    for one in ("1f1b", "1f1b-recompute"):
        assert temp["G", "gpipe", last] / temp["G", one, last] > temp["G", "gpipe", first] / temp["G", one, first]


def _residual_bytes(p: int, layers: int, v: int = 1) -> tuple[int, int]:
    """(residual bytes of one chunk-microbatch that 1F1B without recompute stashes, `jaxpar.parallel.pipeline_1f1b.
    residual_bytes`; one stage input [b, T, D] fp32 in bytes) for p stages of `layers` layers, v chunks each."""
    from jax.sharding import PartitionSpec as P

    from jaxpar.parallel import pipeline_1f1b
    from jaxpar.training import pipelined

    plan = make_plan(
        [*FP32, f"model.n_layers={layers}", f"data.seq_len={T}", "mesh.data=1", "mesh.fsdp=1", f"mesh.pipeline={p}"],
        jax.devices()[:p],
    )
    d = plan.cfg.model.d_model
    got = {}

    def body(params):
        mb = {
            "inputs": jax.numpy.zeros((B, T), "int32"),
            "targets": jax.numpy.zeros((B, T), "int32"),
            "loss_mask": jax.numpy.zeros((B, T)),
        }
        stack, _ = pipelined.split_stack(params)
        chunk = jax.tree.map(lambda a: a[: a.shape[0] // v], stack)
        parts = pipelined.stage_parts(plan, params, plan.loss_fn)
        got["bytes"] = pipeline_1f1b.residual_bytes(parts, chunk, jax.numpy.zeros((B, T, d)), mb)
        return jax.numpy.zeros(())

    fn = jax.shard_map(body, mesh=plan.mesh, in_specs=(plan.specs["params"],), out_specs=P(), check_vma=False)
    jax.eval_shape(fn, abstract_state(plan)["params"])
    return got["bytes"], B * T * d * 4


@pytest.mark.timeout(300)
def test_residual_stash_bound(temp):
    """The stated stash bound of 1F1B without recompute: (2p - 1) x the residual bytes of one stage-microbatch
    (`jaxpar.parallel.pipeline_1f1b.residual_bytes`) in place of (2p - 1) stage inputs [b, T, D]: the temporaries of
    the two modes differ by that, within 10% (XLA's buffer reuse and the tick's working set)."""
    residual, stage_input = _residual_bytes(P_STAGES, L)
    assert residual > stage_input
    expected = (2 * P_STAGES - 1) * (residual - stage_input)
    measured = temp["b", "1f1b", MICROBATCHES[0]] - temp["b", "1f1b-recompute", MICROBATCHES[0]]
    assert measured == pytest.approx(expected, rel=0.1), (measured, expected, residual)


# Interleaved 1F1B (pipeline.virtual_stages = v): p = 2 stages of L = 8 layers, v = 2 chunks of 2 layers per
# device. Measured (bytes per device, fixed b = 2; the same model at v = 1 and v = 4 for comparison):
#
#     M                          4            8           16
#     recompute   v = 1  3,320,832    3,320,832    3,320,832
#                 v = 2  2,533,944    2,533,944    2,534,008
#                 v = 4  1,650,104    1,650,168    1,650,296
#     residuals   v = 1  4,569,832    4,569,832    4,569,832
#                 v = 2  4,937,184    4,937,184    4,937,248
#                 v = 4  4,147,936    4,148,000    4,148,128
#
# With recompute the stash grows from 2p - 1 to 2pv - 1 stage-input-sized chunk inputs, but the tick's working
# set (one chunk's forward and backward) shrinks by v, which weighs more here; keeping residuals the ring holds
# 2pv - 1 chunks of L/(pv) layers, (2pv - 1)/v stages' worth against 2p - 1.
V_STAGES, L_INTERLEAVED, P_INTERLEAVED = 2, 8, 2


@pytest.fixture(scope="module")
def interleaved_temp() -> dict:
    """{(schedule, M): temporary bytes per device} of interleaved 1F1B at fixed microbatch size."""
    return _CompiledOnUse(
        lambda schedule, m: _temp_bytes(schedule, m, B * m, p=P_INTERLEAVED, layers=L_INTERLEAVED, v=V_STAGES)
    )


@pytest.mark.slow  # compiles 8 interleaved steps (about 12 s on 2 cores)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "1f1b-recompute"])
def test_interleaved_temp_is_flat_in_microbatches(interleaved_temp, schedule):
    values = [interleaved_temp[schedule, m] for m in (4, 8, 16)]
    assert max(values) <= 1.05 * min(values), values


@pytest.mark.timeout(300)
def test_interleaved_residual_stash_bound(interleaved_temp):
    """Without recompute the ring holds 2pv - 1 chunk-microbatches' residuals in place of as many chunk inputs:
    the two modes' temporaries differ by (2pv - 1) x (chunk residual bytes - stage input bytes), within 10%."""
    residual, stage_input = _residual_bytes(P_INTERLEAVED, L_INTERLEAVED, V_STAGES)
    assert residual > stage_input
    expected = (2 * P_INTERLEAVED * V_STAGES - 1) * (residual - stage_input)
    measured = interleaved_temp["1f1b", 4] - interleaved_temp["1f1b-recompute", 4]
    assert measured == pytest.approx(expected, rel=0.1), (measured, expected, residual)


# Zero-bubble schedules (`jaxpar.parallel.pipeline_zb`): W's deferral keeps B's boundary per chunk-microbatch
# (`jaxpar.parallel.split_backward`, remat none: b T (8 D + 2 D_kv + 4 F + 2) + 2 D elements per layer) in a ring
# of `w_slots`, beside the stash ring of `stash_slots` residuals; both sizes come from the table. Both rings enter
# the slot switch read-only and are written after it (passed through it, XLA kept each twice, as the switch's
# operand and its result: zb-h1 at p = 4 measured 4,202,672 bytes). Measured (bytes per device, one layer per
# stage, fixed b = 2, M = 8): zb-h1 p = 2: 2,347,696 (rings 2 + 2); p = 4: 3,267,248 (rings 4 + 4); 1F1B p = 2:
# 1,225,768, p = 4: 1,914,344. Flat in M: see `test_zero_bubble_temp_is_flat_in_m`.


def _boundary_bytes_per_layer() -> int:
    """The split_backward formula (remat none) for this file's model, fp32: D 64, F 128, 4 heads, 2 kv heads."""
    d, f, d_kv, rows = 64, 128, 32, B * T
    return 4 * (rows * (8 * d + 2 * d_kv + 4 * f + 2) + 2 * d)


@pytest.fixture(scope="module")
def zb_temp() -> dict:
    """{(schedule, p, M): temporary bytes per device}, one layer per stage, fixed microbatch size."""
    return _CompiledOnUse(lambda schedule, p, m: _temp_bytes(schedule, m, B * m, p=p, layers=p))


@pytest.mark.timeout(300)
def test_w_deferral_memory(zb_temp, need_devices):
    """Going from p = 2 to p = 4 stages of one layer each, zb-h1's rings grow by the table's extra slots: the
    temporaries grow by (extra stash slots) x the residual bytes + (extra W slots) x the boundary bytes, within
    5% (the per-slot working set is the same one-layer chunk at both p; measured 0.3% over)."""
    from jaxpar.parallel import zero_bubble
    from jaxpar.parallel.slot_program import program

    need_devices(4)
    rings = {p: program(zero_bubble.build("zb-h1", p, 8)) for p in (2, 4)}
    residual, _ = _residual_bytes(2, 2)  # one layer's residuals
    d_stash = rings[4].stash_slots - rings[2].stash_slots
    d_w = rings[4].w_slots - rings[2].w_slots
    assert d_w > 0 and d_stash > 0
    expected = d_stash * residual + d_w * _boundary_bytes_per_layer()
    measured = zb_temp["zb-h1", 4, 8] - zb_temp["zb-h1", 2, 8]
    assert measured == pytest.approx(expected, rel=0.05), (measured, expected)


@pytest.mark.timeout(300)
def test_zero_bubble_temp_is_flat_in_m(need_devices):
    """zb-v's temporaries do not grow with the number of microbatches (rings sized by the table's peaks)."""
    need_devices(2)
    values = [_temp_bytes("zb-v", m, B * m, p=2, layers=4, v=2) for m in (4, 16)]
    assert max(values) <= 1.01 * min(values), values
