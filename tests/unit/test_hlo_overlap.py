"""The reader of asynchronous collectives in a scheduled HLO module (`jaxpar.analysis.hlo.overlap`), on a
hand-written module shaped like the GPU compiler's: a loop of 5 trips whose body starts a permute to the next
device, runs a GEMM fusion, waits, then starts and at once waits for a permute to the previous one; outside it an
all-gather under the loop and a synchronous all-reduce. The reader on a real GPU schedule is tested in
tests/system/test_plan_gpu.py (with the gpu-compile extra)."""

# ruff: noqa: E501  (HLO text is one instruction per line)

from jaxpar.analysis.hlo.collectives import called_computations
from jaxpar.analysis.hlo.overlap import async_collectives, format_rows, pipeline_permutes, summary

MODULE = """\
HloModule jit_f, is_scheduled=true, num_partitions=4

%gemm_computation (a: bf16[8,8], b: bf16[8,8]) -> bf16[8,8] {
  %a = bf16[8,8]{1,0} parameter(0)
  %b = bf16[8,8]{1,0} parameter(1)
  ROOT %d = bf16[8,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%add_computation (a.1: bf16[8,8], b.1: bf16[8,8]) -> bf16[8,8] {
  %a.1 = bf16[8,8]{1,0} parameter(0)
  %b.1 = bf16[8,8]{1,0} parameter(1)
  ROOT %s = bf16[8,8]{1,0} add(%a.1, %b.1)
}

%body (p: (s32[], bf16[8,8])) -> (s32[], bf16[8,8]) {
  %p = (s32[], bf16[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[8,8]{1,0} get-tuple-element(%p), index=1
  %collective-permute-start = (bf16[8,8]{1,0}, bf16[8,8]{1,0}) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3}}, metadata={op_name="jit(f)/while/body/ppermute"}
  %gemm_fusion = bf16[8,8]{1,0} fusion(%x, %x), kind=kCustom, calls=%gemm_computation
  %collective-permute-done = bf16[8,8]{1,0} collective-permute-done(%collective-permute-start)
  %collective-permute-start.1 = (bf16[8,8]{1,0}, bf16[8,8]{1,0}) collective-permute-start(%gemm_fusion), channel_id=2, source_target_pairs={{1,0},{2,1},{3,2}}
  %collective-permute-done.1 = bf16[8,8]{1,0} collective-permute-done(%collective-permute-start.1)
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  %loop_add_fusion = bf16[8,8]{1,0} fusion(%collective-permute-done, %collective-permute-done.1), kind=kLoop, calls=%add_computation
  ROOT %t = (s32[], bf16[8,8]{1,0}) tuple(%n, %loop_add_fusion)
}

%cond (q: (s32[], bf16[8,8])) -> pred[] {
  %q = (s32[], bf16[8,8]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %five = s32[] constant(5)
  ROOT %lt = pred[] compare(%j, %five), direction=LT
}

ENTRY %main (x.1: bf16[8,8]) -> bf16[16,8] {
  %x.1 = bf16[8,8]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %t0 = (s32[], bf16[8,8]{1,0}) tuple(%zero, %x.1)
  %all-gather-start = (bf16[8,8]{1,0}, bf16[16,8]{1,0}) all-gather-start(%x.1), channel_id=3, replica_groups={{0,1},{2,3}}, dimensions={0}
  %while = (s32[], bf16[8,8]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %all-gather-done = bf16[16,8]{1,0} all-gather-done(%all-gather-start)
  %all-reduce = bf16[8,8]{1,0} all-reduce(%x.1), channel_id=4, replica_groups={{0,1,2,3}}, to_apply=%add_computation
  ROOT %all-gather-done.1 = bf16[16,8]{1,0} copy(%all-gather-done)
}
"""


def test_each_collective_with_what_runs_under_it():
    rows = {r.name: r for r in async_collectives(MODULE)}
    up, down = rows["collective-permute-start"], rows["collective-permute-start.1"]
    assert (up.trips, up.direction, up.compute, up.gemms, up.overlapped) == (5, "up", 1, 1, True)
    assert (down.trips, down.direction, down.compute, down.gemms, down.overlapped) == (5, "down", 0, 0, False)
    assert up.op_name == "jit(f)/while/body/ppermute"
    gather = rows["all-gather-start"]  # the loop between start and done counts as one kernel, with a GEMM
    assert (gather.kind, gather.trips, gather.compute, gather.gemms) == ("all-gather", None, 1, 1)
    assert not rows["all-reduce"].asynchronous and not rows["all-reduce"].overlapped


def test_summary_and_the_pipeline_view():
    rows = async_collectives(MODULE)
    assert summary(rows) == {
        "collective-permute": {"count": 2, "overlapped": 1, "under_gemm": 1},
        "all-gather": {"count": 1, "overlapped": 1, "under_gemm": 1},
        "all-reduce": {"count": 1, "overlapped": 0, "under_gemm": 0},
    }
    ticks = pipeline_permutes(rows)
    assert [r.name for r in ticks] == ["collective-permute-start", "collective-permute-start.1"]
    table = format_rows(ticks).splitlines()
    assert len(table) == 3 and table[1].split()[:3] == ["5", "collective-permute", "up"]


def test_a_conditional_calls_its_true_and_false_computations():
    attrs = "true_computation=%region_1.2, false_computation=%region_3.4, metadata={}"
    assert called_computations(attrs) == [("true_computation", "region_1.2"), ("false_computation", "region_3.4")]
