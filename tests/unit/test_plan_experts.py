"""The planner with expert parallelism (`model.moe.expert_axes`): per-device model state, the collectives without
the experts' gathers over expert axes, the MoE all-to-all bytes, a sweep over the expert axes, and the two
cluster-sized MoE configs. Every expected number is computed here by hand from the model's shape.

Analytic only: the MoE layer that splits the experts over mesh axes is not in this checkout, so nothing is
compared with a compiled step here (without expert axes the plan is unchanged, and tests/unit/test_plan.py
compares that with compiled steps).
"""

from __future__ import annotations

import math
import os

import pytest

from jaxpar.analysis.hlo.ring import ring_bytes
from jaxpar.analysis.planner.comm import collective_terms
from jaxpar.analysis.planner.dims import param_leaves, rank_params_split
from jaxpar.analysis.planner.plan import plan, state_bytes
from jaxpar.analysis.sweep.report import write_markdown
from jaxpar.analysis.sweep.run import load_sweep, points, run_point
from jaxpar.config import load_config, resolve_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_MOE = os.path.join(ROOT, "configs", "tiny_moe.yaml")
# tiny_moe: 4 blocks, every 2nd MoE (2 MoE blocks), E = 8 experts of width F_e = 128, D = 128, top-2, T = 128,
# 16 sequences per step; fp32 layout (4 bytes params and grads, 8 optimizer state), remat none.
E, F_E, D, T, K, MOE_BLOCKS = 8, 128, 128, 128, 2, 2
P_E = MOE_BLOCKS * 3 * E * D * F_E  # routed experts' weights: w_gate, w_up [E, D, F_e], w_down [E, F_e, D]


def _cfg(mesh: dict, zero: int, axes: str, *extra: str):
    overrides = [f"mesh.{a}={n}" for a, n in mesh.items()]
    overrides += [f"optimizer.zero_stage={zero}", f"model.moe.expert_axes={axes}", *extra]
    return resolve_config(load_config(TINY_MOE, overrides, validate=False), math.prod(mesh.values()))


def _total_params(cfg) -> int:
    return sum(x.size for x in param_leaves(cfg.model))


def test_expert_leaves_are_the_routed_weights():
    cfg = _cfg({"data": 2, "fsdp": 4, "tensor": 1, "pipeline": 1}, 1, "[fsdp]")
    experts = {x.path for x in param_leaves(cfg.model) if x.expert}
    assert experts == {f"blocks/moe/mlp/{w}" for w in ("w_gate", "w_up", "w_down")}  # not the router nor shared
    assert sum(x.size for x in param_leaves(cfg.model) if x.expert) == P_E


@pytest.mark.parametrize(
    "mesh, zero, axes, expected",
    [
        # data=2 x fsdp=4, ZeRO-1, experts over both (ep = 8): an expert's state is split by ep alone.
        # dense: params, grads /F; optimizer state /(F*N). experts: every kind /ep.
        (
            {"data": 2, "fsdp": 4, "tensor": 1, "pipeline": 1},
            1,
            "[data,fsdp]",
            lambda pd: {
                "params": 4 * (pd / 4 + P_E / 8),
                "grads": 4 * (pd / 4 + P_E / 8),
                "opt": 8 * (pd / 8 + P_E / 8),
            },
        ),
        # data=4 x fsdp=2, ZeRO-1, experts over data (ep = 4): the experts' embed still split over fsdp, their
        # optimizer state not over data (no data replicas of an expert).
        (
            {"data": 4, "fsdp": 2, "tensor": 1, "pipeline": 1},
            1,
            "[data]",
            lambda pd: {
                "params": 4 * (pd / 2 + P_E / 8),
                "grads": 4 * (pd / 2 + P_E / 8),
                "opt": 8 * (pd / 8 + P_E / 8),
            },
        ),
        # data=4 x fsdp=2, ZeRO-2, experts over fsdp (ep = 2): grads and optimizer state over data as well.
        (
            {"data": 4, "fsdp": 2, "tensor": 1, "pipeline": 1},
            2,
            "[fsdp]",
            lambda pd: {
                "params": 4 * (pd / 2 + P_E / 2),
                "grads": 4 * (pd / 8 + P_E / 8),
                "opt": 8 * (pd / 8 + P_E / 8),
            },
        ),
        # No expert axes: the experts are dense parameters, /F (and /N where ZeRO partitions).
        (
            {"data": 4, "fsdp": 2, "tensor": 1, "pipeline": 1},
            1,
            "[]",
            lambda pd: {"params": 4 * (pd + P_E) / 2, "grads": 4 * (pd + P_E) / 2, "opt": 8 * (pd + P_E) / 8},
        ),
    ],
)
def test_state_bytes_by_hand(mesh, zero, axes, expected):
    cfg = _cfg(mesh, zero, axes)
    want = expected(_total_params(cfg) - P_E)
    got = state_bytes(cfg)
    assert (got["params"], got["grads"], got["opt_state"]) == pytest.approx(
        (want["params"], want["grads"], want["opt"]), rel=1e-12
    )
    assert got["total"] == pytest.approx(sum(want.values()), rel=1e-12)
    ep = math.prod(mesh[a] for a in axes.strip("[]").split(",") if a)
    assert got["n_expert_params"] == P_E // ep


def test_state_bytes_with_tensor():
    """tensor=2 splits each expert's F_e: the experts' state is P_e/(ep*t) per device, with no fsdp split when
    fsdp is the expert axis; the dense part is P per rank (`rank_params_split`, tensor-split leaves 1/t) over fsdp."""
    mesh = {"data": 2, "fsdp": 2, "tensor": 2, "pipeline": 1}
    cfg = _cfg(mesh, 0, "[fsdp]")
    dense_rank = sum(rank_params_split(cfg.model, mesh)) - P_E // 2  # without expert axes: the experts at 1/t
    expert = P_E / (2 * 2)
    got = state_bytes(cfg)
    assert got["params"] == pytest.approx(4 * (dense_rank / 2 + expert), rel=1e-12)
    assert got["opt_state"] == pytest.approx(8 * (dense_rank / 2 + expert), rel=1e-12)
    assert got["experts"] == pytest.approx(16 * expert, rel=1e-12)


def _term(terms, name):
    (t,) = [t for t in terms if t.name == name]
    return t


@pytest.mark.parametrize(
    "routing, remat, platform",
    [
        ("capacity", "none", "gpu"),
        ("dropless", "none", "gpu"),
        ("dropless", "full", "gpu"),
        ("dropless", "none", "cpu"),
    ],
)
def test_all_to_all_bytes_by_hand(routing, remat, platform):
    """Per MoE block 2 all-to-alls forward, 2 backward, 2 more under remat full (the re-run dispatch and combine).
    Capacity routing sends (ep-1)/ep of E*C*b*D; dropless on gpu is a ragged all-to-all of the A = b*T*K local
    assignments, (ep-1)/ep of A*D with balanced routing, all of it in the worst case; dropless on cpu is the emulation's
    dense all-to-all of ep*A*D (receive_factor 0: R = ep*A). Elements of the compute dtype (bf16 on gpu, fp32 on
    cpu); the dispatch offsets are int32 all-to-alls of their own."""
    mesh = {"data": 2, "fsdp": 4, "tensor": 1, "pipeline": 1}
    cfg = _cfg(mesh, 1, "[fsdp]", f"model.moe.routing={routing}", f"model.remat={remat}")
    b, ep, width = 16 // 8, 4, 2 if platform == "gpu" else 4
    a = b * T * K
    c = math.ceil(1.25 * T * K / E)  # capacity_factor 1.25
    ragged = routing == "dropless" and platform == "gpu"
    elements = {"capacity": E * c * b * D, "dropless": a * D if ragged else ep * a * D}[routing]
    count = MOE_BLOCKS * (4 if remat == "none" else 6)
    kind = "ragged-all-to-all" if ragged else "all-to-all"
    term = _term(collective_terms(cfg, platform), f"MoE dispatch/combine ({routing})")
    assert (term.axes, term.kind, term.count, term.group_size) == (("fsdp",), kind, count, ep)
    assert term.bytes == count * elements * width * (ep - 1) / ep
    p = plan(cfg, platform)
    offsets = [t for t in collective_terms(cfg, platform) if t.name == "MoE dispatch offsets (int32)"]
    assert p["by_axis"][f"fsdp {kind}"] == term.bytes + (0 if ragged else sum(t.bytes for t in offsets))
    assert p["experts"]["all_to_all_bytes"] == term.bytes + sum(t.bytes for t in offsets)
    assert bool(offsets) == (routing == "dropless")
    worst = p["experts"]["all_to_all_worst_bytes"] - p["experts"]["all_to_all_bytes"]
    assert worst == pytest.approx(count * elements * width / ep if ragged else 0.0)
    rows = ep * a if routing == "dropless" else E * c * b  # R: the receive buffer's or the capacity buffer's rows
    assert p["experts"]["receive_buffer_bytes"] == rows * D * width
    # One MoE block's backward (`jaxpar.analysis.planner.experts`), in the compute dtype: 4 hidden-width and 3
    # model-width buffers of the R rows its experts run, the padded all-to-all's two buffers, and with El = E/ep = 2
    # local experts on the dropless path the grouped matmul's backward expanded per expert (4 El and 3 + 2 El).
    hidden, model = (4 * 2, 3 + 2 * 2) if routing == "dropless" else (4, 3)
    dense = 0 if ragged else 2 * elements
    assert p["memory"]["temp_estimate"]["moe_working"] == (hidden * rows * F_E + model * rows * D + dense) * width


def test_no_all_to_all_without_expert_axes():
    cfg = _cfg({"data": 2, "fsdp": 4, "tensor": 1, "pipeline": 1}, 1, "[]")
    assert not [t for t in collective_terms(cfg, "gpu") if "all-to-all" in t.kind]
    p = plan(cfg, "gpu")
    assert p["experts"]["all_to_all_bytes"] == 0
    # the experts still run: dropless, every local assignment once (R = b*T*k, b = 16/8 rows per device; all 8
    # experts local, so the grouped matmul's backward is expanded 8 ways)
    assert p["memory"]["temp_estimate"]["moe_working"] == (4 * 8 * F_E + (3 + 2 * 8) * D) * 2 * T * K * 2


def test_expert_weights_are_not_gathered_over_expert_axes():
    """fsdp=4 as the expert axis: the layer gathers and reduce-scatters over fsdp lose exactly the experts'
    share; ZeRO-3 over data=2 still gathers the experts' E/ep (whole embed) over data."""
    mesh = {"data": 2, "fsdp": 4, "tensor": 1, "pipeline": 1}
    blocks = sum(x.size for x in param_leaves(_cfg(mesh, 1, "[]").model) if x.in_blocks)
    plain = collective_terms(_cfg(mesh, 1, "[]"), "gpu")
    split = collective_terms(_cfg(mesh, 1, "[fsdp]"), "gpu")
    for name in ("layer weights", "layer gradients"):
        assert _term(split, name).size_bytes == pytest.approx(
            _term(plain, name).size_bytes * (blocks - P_E) / blocks, rel=1e-12
        )
    assert not [t for t in split if t.name.startswith("expert ")]
    zero3 = collective_terms(_cfg(mesh, 3, "[fsdp]"), "gpu")
    gather = _term(zero3, "expert weights")
    # 2 gathers per layer and step (forward, backward), 4 layers; the experts' E/ep = 2 at full D, bf16
    assert (gather.axes, gather.kind, gather.group_size) == (("data",), "all-gather", 2)
    assert gather.size_bytes == 2 * 4 * (P_E / 4 / 4) * 2


@pytest.mark.parametrize("axes, expert_grads", [("[fsdp]", True), ("[data,fsdp]", False)])
def test_data_reduction_skips_experts_on_data(axes, expert_grads):
    """ZeRO-1: the gradients' all-reduce over data carries the experts' (E/ep, not split over fsdp as the expert
    axis) only when data is not an expert axis; fp32 reduce dtype."""
    mesh = {"data": 2, "fsdp": 4, "tensor": 1, "pipeline": 1}
    cfg = _cfg(mesh, 1, axes)
    dense = _total_params(cfg) - P_E
    ep = 4 if axes == "[fsdp]" else 8
    want = (dense / 4 + (P_E / ep if expert_grads else 0)) * 4
    assert _term(collective_terms(cfg, "gpu"), "gradients").size_bytes == pytest.approx(want, rel=1e-12)


def test_sweep_over_expert_axes(tmp_path):
    sweep = load_sweep(os.path.join(ROOT, "configs", "sweeps", "tiny_moe_experts.yaml"))
    pts = points(sweep)
    keys = {o for p in pts for o in p["overrides"] if o.startswith("model.moe.expert_axes=")}
    assert keys == {"model.moe.expert_axes=[]", "model.moe.expert_axes=[fsdp]", "model.moe.expert_axes=[data,fsdp]"}
    recs = [run_point(sweep, p) for p in pts]
    assert all(r["status"] == "ok" for r in recs)
    by_axes = {tuple(r["planned"]["expert_axes"]): r["planned"]["all_to_all_bytes"] for r in recs}
    assert by_axes[()] == 0 and 0 < by_axes[("fsdp",)] < by_axes[("data", "fsdp")]
    write_markdown(
        str(tmp_path / "results.md"),
        {
            "sweep": sweep.path,
            "base": sweep.base,
            "objective": sweep.objective,
            "budget_bytes": None,
            "measure_steps": 0,
            "settings": {},
            "target": None,
        },
        recs,
    )
    text = (tmp_path / "results.md").read_text()
    assert "all-to-all/step planned" in text and "| data,fsdp |" in text


# The two cluster-sized configs: experts' model state per device by hand, bf16 16p layout (2 + 2 + 12 bytes per
# parameter), experts over data (no data split of their state), embed over fsdp=2.
BIG = {
    # 32 blocks / 4 stages = 8 per stage, E/ep = 1 expert of 3 * 4096 * 14336
    "mixtral_8x7b.yaml": (8 * 1 * 3 * 4096 * 14336, 46_702_792_704),
    # 58 MoE blocks stored over 16 stages as 64 rows = 4 per stage, E/ep = 256/64 = 4 experts of 3 * 7168 * 2048
    "deepseek_v3.yaml": (4 * 4 * 3 * 7168 * 2048, 671_026_419_200),
}


def _deepseek_v3_count() -> tuple[int, int]:
    """(parameters in all, activated per token without the input embedding) of DeepSeek-V3 from the published
    shapes (arXiv 2412.19437, section 4.2; the released config.json), written out here independently of the
    model: MLA's down- and up-projections and latent norms, 3 dense blocks of FFN width 18432, 58 MoE blocks of 256
    routed experts and 1 shared of width 2048 with the router and its balancing bias, embedding, head, norms."""
    d, v, h, x, z, n, r, u, f, fe, e, k = 7168, 129280, 128, 1536, 512, 128, 64, 128, 18432, 2048, 256, 8
    mla = d * x + x + x * h * (n + r) + d * (z + r) + z + z * h * (n + u) + h * u * d
    dense = mla + 2 * d + 3 * d * f
    moe = mla + 2 * d + (e + 1) * 3 * d * fe + d * e + e
    total = 2 * v * d + d + 3 * dense + 58 * moe
    return total, total - 58 * (e - k) * 3 * d * fe - v * d


def test_deepseek_v3_counts_as_published():
    """671B parameters in all (the report's Table 1, within 0.5%) and 36.6B activated per token without the input
    embedding (37.6B with it: the report's "37B" is rounded to whole billions)."""
    cfg = load_config(os.path.join(ROOT, "configs", "deepseek_v3.yaml"), validate=False)
    planned = plan(cfg, "gpu")
    params = planned["params"]
    # 58 MoE blocks over 16 stages: the first also runs the 3 dense blocks (each worth an MoE block's FLOPs), the
    # last the head (0.97 of a block)
    balance = planned["pipeline"]["stage_balance"]
    assert sum(balance["balanced_split"]) == 58 and balance["balanced_split"][0] == 1
    assert balance["split"] == balance["balanced_split"] and balance["balanced"] < 1.05
    total, active = _deepseek_v3_count()
    assert params["total"] == total and abs(total / 671e9 - 1) < 0.005
    assert params["active_without_input_embedding"] == active and round(active / 1e9) == 37
    assert params["active"] == active + 129280 * 7168


@pytest.mark.parametrize("name", sorted(BIG))
def test_cluster_configs_plan(name):
    """Planned without validation: the planner takes pipeline + MoE, which check_moe may still refuse."""
    cfg = load_config(os.path.join(ROOT, "configs", name), validate=False)
    p = plan(cfg, "gpu")
    p_e, total = BIG[name]
    assert p["params"]["total"] == total
    assert p["experts"]["expert_params_per_rank"] == p_e
    assert p["memory"]["expert_state"] == pytest.approx(16 * p_e / 2, rel=1e-12)
    assert p["experts"]["all_to_all_bytes"] > 0 and "data all-to-all" in p["by_axis"]
    assert p["memory"]["peak_estimate"] < 80e9  # the 80 GB GPUs they are sized for


def test_edge_gradients_fold_into_one_all_reduce_on_gpu():
    """Under ZeRO-1 with a pipeline, XLA's GPU compiler folds the embedding's and head's all-reduce over pipeline and
    their all-reduce over data into one over data x pipeline; XLA:CPU keeps both (`jaxpar.analysis.planner.comm`).
    The deviceless H100 compile of configs/mixtral_8x7b.yaml measured 1,015,823,872 B over data,pipeline and
    1,175,552,000 B over data (all-reduce) and 523,267,584 B over data (all-gather), the gpu plan's bytes exactly."""
    cfg = load_config(os.path.join(ROOT, "configs", "mixtral_8x7b.yaml"), num_devices=64)
    gpu, cpu = plan(cfg, "gpu")["by_axis"], plan(cfg, "cpu")["by_axis"]
    edge = (2 * 32000 * 4096 + 4096) // 2 * 4  # embedding, head and final norm, split over fsdp=2, fp32 gradients
    assert gpu["data,pipeline all-reduce"] == pytest.approx(ring_bytes("all-reduce", edge, 32), rel=1e-12)
    assert gpu["data,pipeline all-reduce"] == 1_015_823_872 and gpu["data all-reduce"] == 1_175_552_000
    assert gpu["data all-gather"] == 523_267_584  # ZeRO-1's gather of the updated parameters keeps the edge leaves
    assert "pipeline all-reduce" not in gpu
    assert cpu["pipeline all-reduce"] == pytest.approx(ring_bytes("all-reduce", edge, 4), rel=1e-12)
    assert "data,pipeline all-reduce" not in cpu
    # the data all-reduce loses exactly the edge leaves' share
    assert cpu["data all-reduce"] - gpu["data all-reduce"] == pytest.approx(ring_bytes("all-reduce", edge, 8))
