"""The planner (jaxpar.analysis.planner.plan, jaxpar.analysis.planner.comm) for interleaved 1F1B,
`pipeline.virtual_stages` v > 1 (`jaxpar.parallel.schedule`): memory and collectives by hand, the edge parts' ticks
against the schedule's own tick functions, and the collectives against the compiled step.

Shapes as in tests/unit/test_plan.py (D = 64, F = 128, s = 8, 4 heads of 16, 2 key/value heads, V = 264), with
L = 4 layers on p = 2 stages, v = 2 (chunks of L/(pv) = 1 layer), m = 4 microbatches of b = 1 row. One layer
has 36,992 parameters (norms 2 x 64, q 64 x 64, k and v 64 x 32 each, out 64 x 64, gate, up, down 64 x 128
each).

The compiled checks compile the train step on 4 simulated CPU devices (a few seconds each, nothing runs). A
static reading of the HLO counts a collective inside a `lax.cond` each time the cond is evaluated; interleaved
1F1B evaluates the embedding's cond in each of its m*v + p - 1 forward ticks and the head's in each of its
m*v + p - v*p steady ticks, while the first stage takes the embedding's branch in m + p - 1 of them and the last
stage the head's in m. So the compiled rows are compared with the plan counted that way (`by_axis_hlo`, like
with like: equal within the bounds of tests/unit/test_plan.py), and the plan itself (`by_axis`, what the stages
run) is checked to sit below it by exactly the untaken branches' bytes, counted here from the model.
"""

from __future__ import annotations

import json
import os

import pytest

from jaxpar.analysis.planner.comm import _edge_ticks, collective_terms
from jaxpar.analysis.planner.dims import param_leaves
from jaxpar.analysis.planner.plan import activation_bytes, plan, temp_bytes
from jaxpar.cli import plan as plan_cli
from jaxpar.config import load_config, resolve_config
from jaxpar.parallel import schedule

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_YAML = os.path.join(ROOT, "configs", "tiny.yaml")
SMALL = [
    "model.n_layers=4",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=128",
    "data.seq_len=8",
    "train.global_batch_size=8",
    "mesh.tensor=1",
    "mesh.pipeline=2",
    "pipeline.microbatches=4",
]
LAYER_PARAMS = 2 * 64 + 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128  # 36,992
V2 = ["pipeline.virtual_stages=2"]


def _cfg(overrides, devices=4):
    return resolve_config(load_config(TINY_YAML, [*SMALL, *overrides], validate=False), devices)


def test_layer_size_from_the_model():
    leaves = [x for x in param_leaves(_cfg(["mesh.data=2", "mesh.fsdp=1"]).model) if x.in_blocks]
    assert len(leaves) == 9 and sum(x.size for x in leaves) == 4 * LAYER_PARAMS


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (2, 3, 2), (4, 2, 4), (4, 4, 8), (2, 1, 3), (4, 1, 2)])
def test_edge_ticks_follow_the_schedule(p, v, m):
    """The embedding's and head's runs per loop (`plan_comm._edge_ticks`) against the schedule's tick functions:
    the first stage embeds in the forward ticks of its chunk 0 (and back-propagates into the table in the
    backward ticks of it), the last runs the head in the steady ticks of its last chunk."""
    warm, total = schedule.warmup_ticks(p, v), schedule.ticks(p, v, m)
    last_forward = schedule.forward_tick(m - 1, p * v - 1, p, v)
    forward, steady, backward = range(0, last_forward + 1), range(warm, last_forward + 1), range(warm, total)
    embed = sum(schedule.forward_at(t, 0, p, v, m)[1] == 0 for t in forward)
    embed_bwd = sum(schedule.backward_at(t, 0, p, v, m)[1] == 0 for t in backward)
    head = sum(schedule.forward_at(t, p - 1, p, v, m)[1] == v - 1 for t in steady)
    assert embed == embed_bwd and _edge_ticks(p, v, m, "taken") == (embed, head) == (m + p - 1, m)
    assert _edge_ticks(p, v, m, "evaluated") == (len(forward), len(steady))
    assert len(forward) == len(backward) == m * v + p - 1
    with pytest.raises(ValueError, match="branches must be one of"):
        _edge_ticks(p, v, m, "all")


def test_interleaved_activations_by_hand():
    """remat full, bf16 on gpu: a layer keeps its block input b*s*D*2 = 1,024 bytes, the stage input is as big.
    Keeping residuals: a ring of 2pv - 1 = 7 chunk-microbatches of L/(pv) = 1 layer (3.5 stages' worth, against
    2p - 1 = 3 microbatches of L/p = 2 layers for v = 1); recomputing: a ring of 7 chunk inputs and one chunk's
    layer (1/v = 0.5 stages' worth)."""
    mesh = ["mesh.data=2", "mesh.fsdp=1", "model.remat=full"]
    one = 1 * 8 * 64 * 2
    plain = activation_bytes(_cfg(mesh), "gpu")
    assert (plain["layers"], plain["in_flight"], plain["stage_inputs"]) == (3 * 2 * one, 3, 0)
    keep = activation_bytes(_cfg([*mesh, *V2]), "gpu")
    assert (keep["layers"], keep["in_flight"], keep["stage_inputs"], keep["layers_held"]) == (7 * one, 3.5, 0, 7)
    assert "2pv-1=7 chunk-microbatches" in keep["formula"] and "L/(pv)=1" in keep["formula"]
    assert keep["korthikanti"] == 7 * 2 * 8 * 1 * 64  # Table 2, full recomputation: 2sbh per layer held
    rc = activation_bytes(_cfg([*mesh, *V2, "pipeline.recompute=true"]), "gpu")
    assert (rc["layers"], rc["in_flight"], rc["stage_inputs"], rc["layers_held"]) == (one, 0.5, 7 * one, 1)
    assert "2pv-1=7 chunk inputs" in rc["formula"]


@pytest.mark.parametrize("layout, param_bytes", [("fp32", 4), ("16p", 2)])
def test_chunk_order_copies_are_temporaries(layout, param_bytes):
    """The step's chunk-order copy of the stage's 2 layers (the local shard, here fsdp = 2: half of each) in the
    parameter dtype, and of their gradients in the reduce dtype (fp32); none for v = 1."""
    mesh = ["mesh.data=1", "mesh.fsdp=2", f"precision.layout={layout}"]
    t1, t2 = temp_bytes(_cfg(mesh)), temp_bytes(_cfg([*mesh, *V2]))
    assert t1["chunk_order"] == 0
    assert t2["chunk_order"] == 2 * LAYER_PARAMS // 2 * (param_bytes + 4)
    parts = [k for k in t2 if k not in ("total", "attention_working", "head_working")]
    assert t2["total"] == sum(t2[k] for k in parts) + max(t2["attention_working"], t2["head_working"])


def test_interleaved_collectives_by_hand():
    """data = 2, fp32 on cpu. Pipeline permutes: the activation ring once per forward and once per backward
    chunk tick, 2 x (m*v + p - 1) = 18 of b*s*D*4 = 2,048 bytes (p = 2: every loop is several ticks long, so
    none loses an unread shift), and the step's chunk-order permutes: chunk 1 moves from device 0 to 1, chunk 2
    from 1 to 0 (chunks 0 and 3 stay), one ppermute each per layer leaf, for the parameters and again for the
    gradients: 2 x 2 x 9 ops of one layer's leaf."""
    cfg = _cfg(["mesh.data=2", "mesh.fsdp=1", *V2])
    terms = {t.name: t for t in collective_terms(cfg, "cpu")}
    ring = terms["stage activations and their gradients (ring)"]
    assert (ring.count, ring.size_bytes, ring.axes) == (18, 18 * 2048, ("pipeline",))
    for name in ("layer parameters into chunk order", "layer gradients back"):
        assert (terms[name].count, terms[name].size_bytes) == (2 * 9, 2 * LAYER_PARAMS * 4)
    out = plan(cfg, "cpu")
    assert out["by_axis"]["pipeline collective-permute"] == 18 * 2048 + 4 * LAYER_PARAMS * 4
    assert out["by_axis_hlo"] == out["by_axis"]  # no fsdp or tensor collectives in the edge conds
    assert out["pipeline"]["virtual_stages"] == 2 and out["pipeline"]["bubble"] == pytest.approx(1 / 9)


def test_interleaved_weight_gathers_by_hand():
    """fsdp = 2: each layer's 9 leaves are gathered in every forward and every backward chunk tick (9 each, one
    layer per chunk): 162 gathers of the layer's leaves; with recompute and one layer per chunk the rebuilt
    forward's gathers merge with the backward's (2 per tick still). With 2 layers per chunk recompute gathers
    3 times per tick: 3 x 9 x 2 layers x 9 leaves."""
    base = ["mesh.data=1", "mesh.fsdp=2", *V2]

    def layer_gathers(cfg):
        return next(t for t in collective_terms(cfg, "cpu") if t.name == "layer weights").count

    assert layer_gathers(_cfg(base)) == 2 * 9 * 9
    assert layer_gathers(_cfg([*base, "pipeline.recompute=true"])) == 2 * 9 * 9
    assert layer_gathers(_cfg([*base, "pipeline.recompute=true", "model.n_layers=8"])) == 3 * 9 * 2 * 9


def test_report_states_virtual_stages_and_bubble(capsys):
    args = [TINY_YAML, *SMALL, "mesh.data=1", "mesh.fsdp=2", "--devices", "4"]
    assert plan_cli.main([*args, *V2]) == 0
    out = capsys.readouterr().out
    assert "pipeline 1f1b p=2 m=4 virtual stages v=2 (interleaved), bubble (p-1)/(v*m+p-1) = 0.111" in out
    assert "chunk-order copies of the stage's layers and their gradients" in out
    assert plan_cli.main(args) == 0
    assert "pipeline 1f1b p=2 m=4, bubble (p-1)/(v*m+p-1) = 0.200" in capsys.readouterr().out


# ---- planned vs compiled -------------------------------------------------------------------------------------

COMPILED = {  # name -> (overrides, devices); about 3 s each
    "v2_data2": (["mesh.data=2", "mesh.fsdp=1", *V2], 4),
    "v2_fsdp2": (["mesh.data=1", "mesh.fsdp=2", *V2], 4),
    # tensor with sequence parallelism, remat full and recompute: one layer per chunk, so XLA drops the rebuilt
    # forward's last exit and merges its first enter and its weight gathers with the backward's.
    "v2_fsdp2_tensor2_recompute": (
        ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", *V2, "pipeline.recompute=true", "model.remat=full"],
        8,
    ),
    # Zero-bubble schedules: a static reading counts every branch of the slot switch in every slot (the plan's
    # "evaluated" terms); the permutes, two per slot, exactly.
    "zbh1_fsdp2": (["mesh.data=1", "mesh.fsdp=2", "pipeline.schedule=zb-h1"], 4),
    "zbv_fsdp2": (["mesh.data=1", "mesh.fsdp=2", "pipeline.schedule=zb-v", *V2], 4),
}
_RESULTS: dict = {}


def _compiled(name, capsys) -> dict:
    if name not in _RESULTS:
        overrides, devices = COMPILED[name]
        args = [TINY_YAML, *SMALL, *overrides, "--devices", str(devices), "--compile", "--json", "--fast-compile"]
        assert plan_cli.main(args) == 0
        _RESULTS[name] = json.loads(capsys.readouterr().out)
    return _RESULTS[name]


def _assert_like_with_like(rows):
    """Every compiled (axes, kind) planned and vice versa; bytes against the plan as the HLO reading counts them:
    total within 1%, each row within 5% (grad-norm scalars in a combined all-reduce: tens of bytes)."""
    assert {r["key"] for r in rows if r["compiled_bytes"]} == {r["key"] for r in rows if r["planned_hlo_bytes"]}
    total = sum(r["compiled_bytes"] for r in rows)
    assert total == pytest.approx(sum(r["planned_hlo_bytes"] for r in rows), rel=0.01)
    for r in rows:
        assert r["compiled_bytes"] == pytest.approx(r["planned_hlo_bytes"], rel=0.05), r
        assert r["ratio"] == pytest.approx(1.0, rel=0.05), r


@pytest.mark.parametrize("name", list(COMPILED))
def test_planned_collectives_equal_compiled(name, capsys):
    """The plan for cpu against the XLA:CPU executable, and, except where one layer per chunk lets the backends
    merge the recomputed forward's weight gathers (the partitioned program still has them), the plan for gpu
    against the partitioned program."""
    out = _compiled(name, capsys)
    _assert_like_with_like(out["compiled"]["collectives"])
    assert set(out["compiled"]["scalars"]["kinds"]) <= {"all-reduce"}
    if "recompute" not in name:
        _assert_like_with_like(out["compiled"]["partitioned"]["collectives"])
    rows = {r["key"]: r for r in out["compiled"]["collectives"]}
    # The pipeline permutes are outside the edge conds: the plan itself matches, op for op.
    permutes = rows["pipeline collective-permute"]
    assert permutes["compiled_bytes"] == permutes["planned_bytes"]
    assert permutes["compiled_count"] == permutes["planned_count"]


def test_compiled_edge_conds_are_the_untaken_branches(capsys):
    """fsdp = 2: the compiled gathers and reduce-scatters exceed the plan by the embedding's cond in 9 - 5
    forward and backward ticks (the table, 264 x 64 fp32) and the head's in 6 - 4 steady ticks (final norm and
    output projection, 64 + 64 x 264), each a ring all-gather / reduce-scatter over 2 devices: half the array
    sent. The layer rows and the permutes are the plan's exactly."""
    out = _compiled("v2_fsdp2", capsys)
    rows = {r["key"]: r for r in out["compiled"]["collectives"]}
    embed, head = 264 * 64 * 4, (64 + 64 * 264) * 4
    extra = (9 - 5) * embed / 2 + (6 - 4) * head / 2
    for key in ("fsdp all-gather", "fsdp reduce-scatter"):
        assert rows[key]["compiled_bytes"] == rows[key]["planned_bytes"] + extra
        assert rows[key]["compiled_count"] == rows[key]["planned_count"] + (9 - 5) * 1 + (6 - 4) * 2
    assert rows["fsdp all-gather"]["planned_count"] == 2 * 9 * 9 + 5 * 1 + 4 * 2  # layers, embedding, head
