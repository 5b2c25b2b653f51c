"""DeepSeek-V3's routing (`jaxpar.model.moe.route` with model.moe.gating=sigmoid, `jaxpar.training.router_bias`)
against numpy references written from the technical report's equations (arXiv 2412.19437, section 2.1.2,
eq. 12-20), its config checks, and softmax routing unchanged.

Shape letters: B batch, T sequence, D model width, E experts, K top_k, F expert width.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import load_config
from jaxpar.config.errors import ConfigError
from jaxpar.config.schema import MoEConfig
from jaxpar.model.moe import MoE, route
from jaxpar.training.router_bias import next_params, spread, updated_bias

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir)
TINY_MOE = os.path.join(ROOT, "configs", "tiny_moe.yaml")
B, T, D, E, K, F = 3, 10, 8, 6, 2, 5
SCALE = 2.5  # DeepSeek-V3's routed_scaling_factor
BIAS = np.array([0.0, 0.3, -0.2, 0.0, 0.15, -0.05], np.float32)


def _inputs(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k1, (B, T, D)), jax.random.normal(k2, (D, E))


def _group_mask(choice, groups, chosen):
    """Node-limited routing by hand: per token, True at the experts of the `chosen` groups (of E / groups
    consecutive experts) whose two highest choice scores sum highest."""
    size = E // groups
    mask = np.zeros(choice.shape, bool)
    for pos in np.ndindex(choice.shape[:-1]):
        scores = [np.sort(choice[pos][g * size : (g + 1) * size])[-2:].sum() for g in range(groups)]
        for g in np.argsort(scores)[::-1][:chosen]:
            mask[pos][g * size : (g + 1) * size] = True
    return mask


def _reference(x, router, bias, k, scale, groups=1, chosen=0):
    """Eq. 12-20 in float64: s = sigmoid(u . e); the top-k of s + b (descending), among the experts of the
    token's `chosen` best groups when `chosen` > 0; g = s / sum of the chosen s, times the routed scale; per
    sequence f_i = E / (k T) * (tokens choosing i), P_i = mean_t s'_i with s' = s / sum over all experts of s;
    L = sum_i f_i P_i."""
    s = 1.0 / (1.0 + np.exp(-(np.asarray(x, np.float64) @ np.asarray(router, np.float64))))
    choice = s + bias
    if chosen:
        choice = np.where(_group_mask(choice, groups, chosen), choice, -np.inf)
    idx = np.argsort(-choice, axis=-1, kind="stable")[..., :k]
    top = np.take_along_axis(s, idx, axis=-1)
    gates = top / top.sum(-1, keepdims=True) * scale
    counts = np.stack([np.bincount(idx[b].ravel(), minlength=E) for b in range(x.shape[0])])  # [B, E]
    f = E / (k * x.shape[1]) * counts
    p = (s / s.sum(-1, keepdims=True)).mean(axis=1)
    return gates, idx, (f * p).sum(-1), counts.sum(0)


def test_sigmoid_router_matches_the_equations():
    """Choice on s + b, gates from s alone (top-k normalised, times routed_scale), the sequence-wise balance loss
    with the normalised affinities s'; the bias changes the choice, enters no gate and gets no gradient."""
    x, router = _inputs()
    gates, idx, probs, stats = route(x, router, K, gating="sigmoid", bias_E=jnp.asarray(BIAS), routed_scale=SCALE)
    want_gates, want_idx, want_aux, want_load = _reference(x, router, BIAS, K, SCALE)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_allclose(np.asarray(gates), want_gates, rtol=1e-6)  # fp32 vs float64 of a few ops
    np.testing.assert_allclose(np.asarray(gates).sum(-1), SCALE, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(stats["aux_B"]), want_aux, rtol=1e-5)  # sums over T*E terms
    np.testing.assert_array_equal(np.asarray(stats["load_E"]), want_load)
    np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, rtol=1e-6)
    assert not np.asarray(stats["z_BT"]).any() and stats["z_BT"].shape == (B, T)

    _, unbiased_idx, *_ = _reference(x, router, np.zeros(E), K, SCALE)
    assert (unbiased_idx != want_idx).any()  # the bias moved some choices (so the test sees it)

    def objective(bias):
        g, _, _, st = route(x, router, K, gating="sigmoid", bias_E=bias, routed_scale=SCALE)
        return jnp.sum(g * jnp.arange(K)) + jnp.sum(st["aux_B"])

    assert not np.asarray(jax.grad(objective)(jnp.asarray(BIAS))).any()


def test_node_limited_routing():
    """DeepSeek-V3's node-limited routing: E = 6 experts in 3 groups of 2, each token routes within its best
    group (k = 2, one group: both its experts), a group scored by the sum of its two highest s + b; softmax
    gating limited the same way on p."""
    x, router = _inputs(4)
    kw = {"gating": "sigmoid", "bias_E": jnp.asarray(BIAS), "routed_scale": SCALE, "expert_groups": 3}
    gates, idx, _, stats = route(x, router, K, group_top_k=1, **kw)
    want_gates, want_idx, want_aux, _ = _reference(x, router, BIAS, K, SCALE, groups=3, chosen=1)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_allclose(np.asarray(gates), want_gates, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(stats["aux_B"]), want_aux, rtol=1e-5)
    assert (np.asarray(idx) // 2 == np.asarray(idx)[..., :1] // 2).all()  # one group per token
    _, free_idx, *_ = route(x, router, K, group_top_k=0, **kw)
    assert (np.asarray(free_idx) // 2 != np.asarray(free_idx)[..., :1] // 2).any()  # the limit changed choices
    _, all_groups_idx, *_ = route(x, router, K, group_top_k=3, **kw)
    np.testing.assert_array_equal(np.asarray(all_groups_idx), np.asarray(free_idx))

    _, soft_idx, probs, _ = route(x, router, K, expert_groups=3, group_top_k=1)
    p = np.asarray(probs, np.float64)
    masked = np.where(_group_mask(p, 3, 1), p, -np.inf)
    np.testing.assert_array_equal(np.asarray(soft_idx), np.argsort(-masked, axis=-1, kind="stable")[..., :K])


def test_sigmoid_top1_gate_is_the_scale():
    """Top-k normalisation for every top_k (eq. 13): with k = 1 each gate is routed_scale (DeepSeek-V3 divides by
    the chosen affinity's own sum)."""
    x, router = _inputs(1)
    gates, *_ = route(x, router, 1, gating="sigmoid", routed_scale=SCALE)
    np.testing.assert_allclose(np.asarray(gates), SCALE, rtol=1e-6)


def test_softmax_default_is_unchanged():
    """The default routing is bitwise the softmax router's: p = softmax, top-k of p renormalised (k > 1), the
    Switch aux loss with p, z = logsumexp^2."""
    x, router = _inputs(2)
    gates, idx, probs, stats = route(x, router, K)
    logits = x @ router
    p = jax.nn.softmax(logits, axis=-1)
    top_p, want_idx = jax.lax.top_k(p, K)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
    np.testing.assert_array_equal(np.asarray(gates), np.asarray(top_p / jnp.sum(top_p, -1, keepdims=True)))
    np.testing.assert_array_equal(np.asarray(probs), np.asarray(p))
    np.testing.assert_array_equal(np.asarray(stats["z_BT"]), np.asarray(jax.nn.logsumexp(logits, axis=-1) ** 2))
    scaled, *_ = route(x, router, K, routed_scale=SCALE)
    np.testing.assert_allclose(np.asarray(scaled), SCALE * np.asarray(gates), rtol=1e-6)
    with pytest.raises(ValueError, match="gating"):
        route(x, router, K, gating="relu")


def _expert(x_D, w):
    g, u = x_D @ w[0], x_D @ w[1]
    return (g / (1 + np.exp(-g)) * u) @ w[2]


@pytest.mark.parametrize("routing", ["dropless", "capacity"])
def test_moe_block_combines_with_the_sigmoid_gates(routing):
    """Both expert paths take the sigmoid router's gates: y = sum_j g_j expert_{e_j}(x) with the choice on s + b
    within each token's 2 best of 3 expert groups (capacity routing with room for every assignment, so nothing
    drops)."""
    moe = MoEConfig(
        num_experts=E,
        top_k=K,
        gating="sigmoid",
        routed_scale=SCALE,
        routing=routing,
        capacity_factor=float(E),
        expert_groups=3,
        group_top_k=2,
    )
    block = MoE(D, F, moe, 0.3, nnx.Rngs(0))
    block.router_bias[...] = jnp.asarray(BIAS)
    x, _ = _inputs(3)
    y, stats = block(x)
    weights = [np.asarray(w[...], np.float64) for w in (block.w_gate, block.w_up, block.w_down)]
    gates, idx, _, _ = _reference(x, block.router[...], BIAS, K, SCALE, groups=3, chosen=2)
    xs = np.asarray(x, np.float64)
    want = np.zeros((B, T, D))
    for b in range(B):
        for t in range(T):
            for j in range(K):
                want[b, t] += gates[b, t, j] * _expert(xs[b, t], [w[idx[b, t, j]] for w in weights])
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-5)  # fp32 SwiGLU vs float64
    assert float(stats["dropped"]) == 0


def test_bias_parameter_only_with_sigmoid_gating():
    x = MoE(D, F, MoEConfig(num_experts=E, top_k=K), 0.02, nnx.Rngs(0))
    assert not hasattr(x, "router_bias")
    y = MoE(D, F, MoEConfig(num_experts=E, top_k=K, gating="sigmoid", z_loss_weight=0.0), 0.02, nnx.Rngs(0))
    assert y.router_bias[...].dtype == jnp.float32 and not np.asarray(y.router_bias[...]).any()
    assert y.router_bias.get_metadata()["logical_axes"] == (None,)


def test_bias_update_rule():
    """b_i <- b_i + gamma * sign(mean load - load_i): the overloaded expert's bias falls by gamma, the
    underloaded ones' rise by gamma, one at the mean keeps it; per MoE block (row)."""
    gamma = 0.001
    load = jnp.array([[10.0, 2.0, 4.0, 0.0], [4.0, 4.0, 4.0, 4.0]])  # means 4 and 4
    bias = jnp.array([[0.5, 0.0, -0.1, 0.0], [0.2, 0.0, 0.0, 0.0]])
    got = np.asarray(updated_bias(bias, load, gamma))
    want = np.asarray(bias) + gamma * np.array([[-1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    np.testing.assert_allclose(got, want, rtol=1e-7)

    before = {"blocks": {"moe": {"mlp": {"router_bias": bias, "router": jnp.ones((2, 3, 4))}}}}
    after = {"blocks": {"moe": {"mlp": {"router_bias": bias * 0.9, "router": jnp.zeros((2, 3, 4))}}}}
    stepped = next_params(after, before, load, gamma, jnp.bool_(True))
    np.testing.assert_allclose(np.asarray(stepped["blocks"]["moe"]["mlp"]["router_bias"]), want, rtol=1e-7)
    assert not np.asarray(stepped["blocks"]["moe"]["mlp"]["router"]).any()  # the optimizer's update kept
    skipped = next_params(after, before, load, gamma, jnp.bool_(False))
    np.testing.assert_array_equal(np.asarray(skipped["blocks"]["moe"]["mlp"]["router_bias"]), np.asarray(bias))
    np.testing.assert_allclose(float(spread(before)), (0.6 + 0.2) / 2, rtol=1e-6)
    with pytest.raises(ValueError, match="shape"):
        next_params(after, before, load[:, :3], gamma, jnp.bool_(True))
    # a stack stored with zero rows after its blocks (jaxpar.parallel.layer_split): the load covers the blocks,
    # the stored rows' biases stay as they were
    stepped = next_params(after, before, load[:1], gamma, jnp.bool_(True))
    np.testing.assert_allclose(np.asarray(stepped["blocks"]["moe"]["mlp"]["router_bias"]), [want[0], bias[1]])
    np.testing.assert_allclose(float(spread(before, blocks=1)), 0.6, rtol=1e-6)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["model.moe.gating=sigmoid"], "z_loss_weight"),  # the default z-loss weight 0.001
        (["model.moe.bias_update_rate=0.001"], "bias_update_rate"),  # softmax gating
        (["model.moe.gating=sparsemax"], "gating"),
        (["model.moe.routed_scale=0"], "routed_scale"),
        (["model.moe.expert_groups=3"], "expert_groups"),  # 8 experts
        (["model.moe.expert_groups=4", "model.moe.group_top_k=5"], "group_top_k"),
        (["model.moe.expert_groups=8", "model.moe.group_top_k=1"], "top_k"),  # 2 experts in 1 group of 1
    ],
)
def test_config_refuses(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY_MOE, ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", *overrides], num_devices=1)


def test_config_accepts_deepseek_v3_routing():
    cfg = load_config(
        TINY_MOE,
        [
            "mesh.data=1",
            "mesh.fsdp=1",
            "mesh.tensor=1",
            "model.moe.expert_axes=[]",
            "model.moe.gating=sigmoid",
            "model.moe.z_loss_weight=0",
            "model.moe.aux_loss_weight=0.0001",
            "model.moe.routed_scale=2.5",
            "model.moe.bias_update_rate=0.001",
            "model.moe.expert_groups=4",
            "model.moe.group_top_k=2",
        ],
        num_devices=1,
    )
    assert cfg.model.moe.gating == "sigmoid" and cfg.model.moe.bias_update_rate == 0.001
