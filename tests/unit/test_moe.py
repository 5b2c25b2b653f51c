"""The mixture-of-experts layer (`jaxpar.model.moe`), its config checks, metrics and FLOPs count.

Shape letters: B batch, T sequence, D model width, E experts, K top_k, F expert width.
"""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import load_config
from jaxpar.config.errors import ConfigError
from jaxpar.config.validate import sequence_parallel
from jaxpar.model import flops, init_params
from jaxpar.model.llama import Llama
from jaxpar.model.moe import capacity, capacity_experts, dropless_experts, route
from jaxpar.training.moe_loss import moe_metrics

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir)
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
TINY_MOE = os.path.join(ROOT, "configs", "tiny_moe.yaml")
B, T, D, E, K, F = 3, 10, 8, 4, 2, 6


def _inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (B, T, D))
    router = jax.random.normal(keys[1], (D, E))
    w_gate, w_up = (jax.random.normal(k, (E, D, F)) / 3 for k in keys[2:4])
    w_down = jax.random.normal(keys[4], (E, F, D)) / 3
    return x, router, (w_gate, w_up, w_down)


def _expert(x_D, e, weights):
    w_gate, w_up, w_down = (np.asarray(w, np.float64) for w in weights)
    g, u = x_D @ w_gate[e], x_D @ w_up[e]
    return (g / (1 + np.exp(-g)) * u) @ w_down[e]


def test_dropless_equals_each_token_through_its_experts():
    """The sorted grouped matmul (jax.lax.ragged_dot) gives every (token, choice) its own expert's SwiGLU."""
    x, router, weights = _inputs()
    _, idx, _, _ = route(x, router, K)
    got = np.asarray(dropless_experts(x, idx, *weights)[0])
    xs, ids = np.asarray(x, np.float64), np.asarray(idx)
    want = np.stack(
        [[[_expert(xs[b, t], ids[b, t, j], weights) for j in range(K)] for t in range(T)] for b in range(B)]
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _keep_reference(ids, c):
    """Capacity priority by hand: every first choice in sequence order, then every second choice, ..."""
    keep = np.zeros(ids.shape, bool)
    for b in range(ids.shape[0]):
        used = np.zeros(E, int)
        for j in range(ids.shape[2]):
            for t in range(ids.shape[1]):
                e = ids[b, t, j]
                keep[b, t, j] = used[e] < c
                used[e] += 1
    return keep


def test_capacity_drops_by_priority_and_per_sequence():
    """Over capacity, the dropped assignments are the ones the GShard priority drops; each sequence is its own
    group, so any split of the rows (as data / fsdp / microbatches split them) drops the same ones; kept
    assignments equal the dropless output and dropped ones are zero."""
    x, router, weights = _inputs(1)
    _, idx, _, _ = route(x, router, K)
    y, keep = capacity_experts(x, idx, *weights, 0.5)
    c = capacity(T, K, E, 0.5)
    assert c == 3
    keep = np.asarray(keep)
    np.testing.assert_array_equal(keep, _keep_reference(np.asarray(idx), c))
    assert 0 < (~keep).sum() < keep.size  # some, not all, dropped
    for rows in (slice(0, 1), slice(1, 3)):
        _, keep_part = capacity_experts(x[rows], idx[rows], *weights, 0.5)
        np.testing.assert_array_equal(np.asarray(keep_part), keep[rows])
    full = np.asarray(dropless_experts(x, idx, *weights)[0])
    np.testing.assert_allclose(np.asarray(y)[keep], full[keep], rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(y)[~keep] == 0)


def test_capacity_without_overflow_equals_dropless():
    x, router, weights = _inputs(2)
    _, idx, _, _ = route(x, router, K)
    y, keep = capacity_experts(x, idx, *weights, float(E))  # C = T * K: nothing drops
    assert np.asarray(keep).all()
    want = dropless_experts(x, idx, *weights)[0]
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_router_gates_and_losses():
    """Gates renormalise the top-k probabilities (top_k > 1) or keep the raw one (top_k == 1); the
    load-balancing loss is E * sum f_i P_i (Switch eq. 4): E when every token goes to one expert with
    probability ~1, 1 for a uniform router; z is (log sum exp logits)^2 (ST-MoE eq. 5)."""
    x, router, _ = _inputs(3)
    gates, idx, probs, stats = route(x, router, K)
    np.testing.assert_allclose(np.asarray(gates.sum(-1)), 1.0, rtol=1e-6)
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    z = np.log(np.exp(logits).sum(-1)) ** 2
    np.testing.assert_allclose(np.asarray(stats["z_BT"]), z, rtol=1e-5)
    gates1, _, probs1, _ = route(x, router, 1)
    np.testing.assert_allclose(np.asarray(gates1[..., 0]), np.asarray(probs1.max(-1)), rtol=1e-6)
    assert np.asarray(stats["load_E"]).sum() == B * T * K

    collapsed = jnp.zeros((D, E)).at[:, 0].set(1.0) * 1e3
    x_pos = jnp.abs(x) + 0.1  # every logit of expert 0 is huge
    _, _, _, stats = route(x_pos, collapsed, 1)
    np.testing.assert_allclose(np.asarray(stats["aux_B"]), E, rtol=1e-5)
    _, _, _, stats = route(x, jnp.zeros((D, E)), E)  # uniform probabilities, every expert chosen once
    np.testing.assert_allclose(np.asarray(stats["aux_B"]), 1.0, rtol=1e-6)


def test_metrics_from_sums():
    load = jnp.array([[4.0, 4.0, 4.0, 4.0], [8.0, 4.0, 2.0, 2.0]])
    m = moe_metrics({"aux": jnp.float32(3.0), "z": jnp.float32(1.0), "load": load, "dropped": jnp.float32(8.0)})
    assert float(m["moe_aux_loss"]) == 1.5 and float(m["moe_z_loss"]) == 0.5
    assert float(m["moe_dropped_fraction"]) == 8.0 / 32.0
    assert float(m["moe_load_max_mean"]) == pytest.approx((1.0 + 2.0) / 2)


def test_default_model_is_dense_and_unchanged():
    """Without model.moe the block stack is the dense one: no router or expert parameters, one block per layer."""
    cfg = load_config(TINY, ["mesh.tensor=1", "mesh.data=1"], num_devices=1).model
    assert not cfg.moe.enabled and cfg.stack_depth == cfg.n_layers
    params = jax.eval_shape(lambda: init_params(cfg, 0))
    assert set(params["blocks"]) == {"attn", "attn_norm", "mlp", "mlp_norm"}
    assert set(params["blocks"]["mlp"]) == {"w_gate", "w_up", "w_down"}


def test_moe_groups_in_the_stack():
    """every=2 on 4 layers: 2 stacked units of (one dense block, one MoE block); the planner's count is
    the parameters' count."""
    cfg = load_config(TINY_MOE, num_devices=8).model
    params = jax.eval_shape(lambda: init_params(cfg, 0))
    blocks = params["blocks"]
    assert set(blocks) == {"dense_0", "moe"}
    assert blocks["moe"]["mlp"]["w_up"].shape == (2, 8, cfg.d_model, 128)
    assert blocks["moe"]["mlp"]["router"].shape == (2, cfg.d_model, 8)
    assert blocks["moe"]["mlp"]["shared"]["w_up"].shape == (2, cfg.d_model, 128)
    assert blocks["dense_0"]["mlp"]["w_up"].shape == (2, cfg.d_model, cfg.d_ff)


def test_active_parameters_for_flops():
    """MFU counts a token's active parameters: all but the (E - k) unused experts of each MoE block."""
    cfg = load_config(TINY_MOE, num_devices=8).model
    params = jax.eval_shape(lambda: init_params(cfg, 0))
    total = flops.count_non_embedding_params(params)
    experts = math.prod(params["blocks"]["moe"]["mlp"]["w_up"].shape) * 3  # gate, up, down
    active = flops.active_non_embedding_params(params, cfg)
    assert active == total - experts * (8 - 2) // 8
    dense = load_config(TINY, ["mesh.tensor=1", "mesh.data=1"], num_devices=1).model
    dense_params = jax.eval_shape(lambda: init_params(dense, 0))
    assert flops.active_non_embedding_params(dense_params, dense) == flops.count_non_embedding_params(dense_params)


def test_capacity_forward_flops_match_xla_cost_analysis():
    """Forward FLOPs of an MoE block stack under capacity routing, counted by XLA, against the analytic
    count: 2 * active parameters per token for the dense matmuls, plus the attention's 2 * 2sHK, plus the
    capacity slots' padding (E * C slots of 3 experts' matmuls instead of T * K). One unit, so the scan is
    inlined; with C * E == T * K the padding term is zero and the count is the 6N rule's forward third."""
    b, t = 2, 16
    cfg = load_config(
        TINY,
        [
            "model.n_layers=1",
            "model.d_model=64",
            "model.d_ff=128",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.moe.num_experts=4",
            "model.moe.top_k=2",
            "model.moe.routing=capacity",
            "model.moe.capacity_factor=1.0",
            "model.moe.shared_experts=1",
            "mesh.data=1",
            "mesh.tensor=1",
        ],
        num_devices=8,
    ).model
    graphdef, state = nnx.split(Llama(cfg, nnx.Rngs(0)))
    fwd = jax.jit(lambda s, x: nnx.merge(graphdef, s).run_blocks(x))
    analysis = fwd.lower(state, jnp.ones((b, t, cfg.d_model))).compile().cost_analysis()
    measured = (analysis[0] if isinstance(analysis, list) else analysis)["flops"]
    params = nnx.state(Llama(cfg, nnx.Rngs(0)), nnx.Param)
    params = {k: v for k, v in nnx.to_pure_dict(params).items() if k == "blocks"}
    n_active = flops.active_non_embedding_params(params, cfg)
    assert capacity(t, 2, 4, 1.0) * 4 == t * 2
    h, k = cfg.n_heads, cfg.head_width
    analytic = 2 * n_active + 2 * 2 * t * h * k  # per token
    assert measured / (b * t) == pytest.approx(analytic, rel=0.05)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["model.moe.num_experts=1"], "at least 2"),
        (["model.moe.num_experts=4", "model.moe.top_k=5"], "top_k=5"),
        (["model.moe.num_experts=4", "model.moe.every=3"], "divide model.n_layers"),
        (["model.moe.num_experts=4", "model.moe.routing=sorted"], "routing"),
        (["model.moe.num_experts=4", "model.moe.capacity_factor=0"], "capacity_factor"),
        (["model.moe.num_experts=4", "model.moe.aux_loss_weight=-1"], "aux_loss_weight"),
        (
            ["model.moe.num_experts=4", "model.moe.every=4", "mesh.pipeline=2", "mesh.tensor=1"],
            r"4 / 4 = 1 MoE units .* must be divisible by mesh\.pipeline \* pipeline\.virtual_stages = 2 \* 1",
        ),
        (["model.moe.num_experts=4", "model.moe.d_expert=3"], "divisible by mesh.tensor=2"),
        (["model.moe.num_experts=4", "model.moe.nonsense=3"], "unknown config key model.moe.nonsense"),
        (["model.moe.num_experts=4", "model.moe.expert_axes=[tensor]"], "data and fsdp"),
        (["model.moe.num_experts=4", "model.moe.expert_axes=[fsdp,fsdp]"], "names an axis twice"),
        (["model.moe.num_experts=6", "model.moe.expert_axes=[data,fsdp]"], "multiple of 4"),
        (["model.moe.num_experts=4", "model.moe.expert_axes=fsdp"], "YAML list"),
        (["model.moe.num_experts=0", "model.moe.expert_axes=[tensor]"], "data and fsdp"),  # named even when dense
    ],
)
def test_config_refusals(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY, overrides, num_devices=8)


def test_expert_axes_of_a_dense_model_warn(caplog):
    with caplog.at_level("WARNING", logger="jaxpar.config.moe"):
        cfg = load_config(TINY, ["model.moe.expert_axes=[fsdp]"], num_devices=8)
    assert not cfg.model.moe.enabled and "has no effect" in caplog.text


def test_sequence_parallel_defaults_on_with_moe_as_without():
    cfg = load_config(TINY_MOE, num_devices=8)
    assert cfg.mesh.tensor == 2 and cfg.tensor.sequence_parallel is None
    assert sequence_parallel(cfg, 2) and sequence_parallel(load_config(TINY, num_devices=8), 2)


def test_hugging_face_export_refuses_moe():
    from jaxpar.model.hf.config import HFConfigError, hf_config_from_model

    cfg = load_config(TINY_MOE, num_devices=8).model
    with pytest.raises(HFConfigError, match="LlamaForCausalLM is dense"):
        hf_config_from_model(cfg, "float32")
