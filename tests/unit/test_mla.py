"""Multi-head Latent Attention (`jaxpar.model.mla`) against a reference written from DeepSeek-V3's equations (arXiv
2412.19437, section 2.1.1, equations 1-11), tensor-parallel against one device, its config keys, its FLOPs, the
cuDNN kernel in a deviceless GPU compile, and (slow suite) a whole train step on 8 devices against one.

Shape letters: B batch, T sequence, D model width, H heads, N and R the queries' and keys' widths without and with
rotary embedding, E the values' width, Q and C the query and key/value latents' widths.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from parity.test_tensor_layers import _act_spec, bind, check_block, module_parts
from step_helpers import FP32_RTOL, assert_tree_close

from jaxpar.config import load_config
from jaxpar.config.errors import ConfigError
from jaxpar.config.schema import ModelConfig
from jaxpar.model.flops import attention_width, flops_per_token
from jaxpar.model.llama import make_attention
from jaxpar.model.mla import MLA

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

B, T, D, H = 2, 8, 16, 4
THETA = 10_000.0
EPS = 1e-6
# (Q, C, N, R, E): a query latent, values narrower than q/k (v padded for the kernel); no query latent, values
# wider than q/k (q and k padded)
SHAPES = {"qlora-v-narrow": (12, 8, 8, 4, 6), "no-qlora-v-wide": (None, 8, 4, 4, 12)}


def _mla(q, c, n, r, e, **kw) -> MLA:
    return MLA(D, H, c, q, n, r, e, THETA, 0.3, nnx.Rngs(0), norm_eps=EPS, implementation="xla", **kw)


# --- the reference: DeepSeek-V3 equations 1-11, float64 numpy, nothing of jaxpar's ---


def _rope_matrix(position: int, width: int) -> np.ndarray:
    """RoFormer's rotation (Su et al. 2021, eq. 13-15) of one position as a [width, width] matrix: pair j turns by
    position * THETA ** (-2j / width). The pair is (j, j + width/2), the rotate-half order jaxpar uses (a fixed
    permutation of the paper's (2j, 2j + 1); `jaxpar.model.mla` docstring)."""
    m = np.zeros((width, width))
    half = width // 2
    for j in range(half):
        angle = position * THETA ** (-2.0 * j / width)
        c, s = np.cos(angle), np.sin(angle)
        m[j, j], m[j, j + half], m[j + half, j], m[j + half, j + half] = c, -s, s, c
    return m


def _rms_norm(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * scale


def reference_mla(p: dict, x_BTD: np.ndarray, n: int, r: int, segment_ids_BT: np.ndarray | None) -> np.ndarray:
    """u_t of equations 1-11 for every token, one token and one head at a time; scores scaled by (N + R) ** -0.5.
    The rotary positions count from each document's first token; token t sees tokens s <= t of its document."""
    p = {k: np.asarray(v, np.float64) if not isinstance(v, dict) else {"scale": np.asarray(v["scale"], np.float64)}
         for k, v in p.items()}  # fmt: skip
    x = np.asarray(x_BTD, np.float64)
    b_, t_, _ = x.shape
    seg = np.zeros((b_, t_), int) if segment_ids_BT is None else np.asarray(segment_ids_BT)
    c_width = p["kv_norm"]["scale"].shape[0]
    out = np.zeros_like(x)
    for b in range(b_):
        starts = [max(s for s in range(t + 1) if s == 0 or seg[b, s] != seg[b, s - 1]) for t in range(t_)]
        pos = [t - starts[t] for t in range(t_)]
        q_C, q_R, k_C, k_R, v = {}, {}, {}, {}, {}
        for t in range(t_):
            h_t = x[b, t]
            c_kv = _rms_norm(h_t @ p["wkv_a"][:, :c_width], p["kv_norm"]["scale"])  # eq. 1 (V3's norm on c_KV)
            k_R[t] = _rope_matrix(pos[t], r) @ (h_t @ p["wkv_a"][:, c_width:])  # eq. 3: one key for all heads
            if "wq_a" in p:
                c_q = _rms_norm(h_t @ p["wq_a"], p["q_norm"]["scale"])  # eq. 6
                q_all = np.einsum("q,qhw->hw", c_q, p["wq_b"])
            else:
                q_all = np.einsum("d,dhw->hw", h_t, p["wq"])
            for i in range(H):
                q_C[t, i] = q_all[i, :n]  # eq. 7
                q_R[t, i] = _rope_matrix(pos[t], r) @ q_all[i, n:]  # eq. 8
                k_C[t, i] = c_kv @ p["wkv_b"][:, i, :n]  # eq. 2
                v[t, i] = c_kv @ p["wkv_b"][:, i, n:]  # eq. 5
        for t in range(t_):
            o = []
            for i in range(H):
                keys = [s for s in range(t + 1) if seg[b, s] == seg[b, t]]
                # eq. 4 and 9: q = [q_C; q_R], k = [k_C; k_R], so q . k = q_C . k_C + q_R . k_R
                scores = np.array([q_C[t, i] @ k_C[s, i] + q_R[t, i] @ k_R[s] for s in keys]) / np.sqrt(n + r)
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                o.append(sum(w * v[s, i] for w, s in zip(weights, keys, strict=True)))  # eq. 10
            out[b, t] = np.concatenate(o) @ p["wo"].reshape(-1, x.shape[-1])  # eq. 11
    return out


def _params(module: nnx.Module, seed: int) -> dict:
    """The module's parameters as a pure dict, redrawn with numpy (std 0.3: scores of order 1, so the softmax
    is far from uniform and the mask matters; norm scales around 1 so a wrong scale shows)."""
    rng = np.random.default_rng(seed)
    state = nnx.to_pure_dict(nnx.state(module))
    return jax.tree.map(lambda a: (0.3 * rng.standard_normal(a.shape) + (a.ndim == 1)).astype(np.float32), state)


@pytest.mark.parametrize("packed", [False, True], ids=["one-doc", "packed"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_mla_equals_the_papers_equations(shape, packed):
    q, c, n, r, e = SHAPES[shape]
    module = _mla(q, c, n, r, e)
    params = _params(module, seed=1)
    state = nnx.state(module)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(module, state)
    x = np.random.default_rng(2).standard_normal((B, T, D)).astype(np.float32)
    seg = np.repeat(np.arange(3, dtype=np.int32), (3, 4, 1))[None].repeat(B, 0) if packed else None
    got = module(jnp.asarray(x), segment_ids_BT=None if seg is None else jnp.asarray(seg))
    want = reference_mla(params, x, n, r, seg)
    # fp32 against float64 on the same math in another order: sums of at most max(D, Q, C) = 16 products and a
    # softmax over <= 8 keys, each a few fp32 roundings (~6e-8) of order-1 values: ~1e-6, well inside 1e-5.
    assert_tree_close(np.asarray(got), want, FP32_RTOL)
    # the reference really depends on what MLA adds: without the rotary key the output moves far
    no_rope = dict(params, wkv_a=params["wkv_a"].copy())
    no_rope["wkv_a"][:, c:] = 0
    assert np.linalg.norm(reference_mla(no_rope, x, n, r, seg) - want) > 100 * FP32_RTOL * np.linalg.norm(want)


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_mla_tensor_parallel_equals_one_device(sp):
    """t = 2 (with and without sequence parallelism) against one device: output and every gradient, fp32 1e-5
    (`parity.test_tensor_layers.check_block`: replicated weights' gradients whole on each rank, or under sequence
    parallelism each rank's part summed as the train step sums them)."""
    q, c, n, r, e = SHAPES["qlora-v-narrow"]
    graphdef, template, params, pspecs = module_parts(lambda: _mla(q, c, n, r, e), std=0.3, seed=30)
    # heads split over tensor; the down-projections and latent norms whole on every rank
    assert pspecs["wq_b"] == P(None, "tensor", None) and pspecs["wkv_b"] == P(None, "tensor", None)
    assert pspecs["wo"] == P("tensor", None, None)
    assert (
        pspecs["wq_a"] == P(None, None) and pspecs["wkv_a"] == P(None, None) and pspecs["kv_norm"]["scale"] == P(None)
    )
    params["q_norm"]["scale"] = params["q_norm"]["scale"] + 1.0  # around 1, as trained norms are
    params["kv_norm"]["scale"] = params["kv_norm"]["scale"] + 1.0
    seg = jnp.asarray(np.repeat(np.arange(2, dtype=np.int32), (5, 3))[None].repeat(B, 0))

    def fn(tp, params, x):
        return bind(graphdef, template, params)(x, tp, seg)

    x = jnp.asarray(np.random.default_rng(31).standard_normal((B, T, D)), jnp.float32)
    # check_block asserts that wq_b, wkv_b and wo were seen as [.., H/2, ..] shards on each rank
    check_block(fn, (params, x), (pspecs, _act_spec(sp)), _act_spec(sp), 2, sp, n_diff=2)


def _config(*overrides: str):
    return load_config(None, list(overrides), num_devices=8)


def test_mla_config_builds_mla_and_refuses_what_it_cannot_run(caplog):
    cfg = _config("model.kv_lora_rank=32", "model.q_lora_rank=48", "model.qk_rope_head_dim=8")
    assert cfg.model.mla and cfg.model.mla_widths == (32, 8, 32)  # nope and v default to the head width 128 / 4
    attn = make_attention(cfg.model, nnx.Rngs(0))
    assert isinstance(attn, MLA) and attn.wq_b is not None and attn.wq_b.shape == (48, 4, 40)
    assert not isinstance(make_attention(_config().model, nnx.Rngs(0)), MLA)
    refusals = {
        ("model.kv_lora_rank=32", "mesh.context=2", "data.seq_len=64"): "mesh.context=1",
        ("model.kv_lora_rank=32", "model.n_kv_heads=2"): "model.n_kv_heads=null",
        ("model.kv_lora_rank=30", "mesh.data=1", "mesh.fsdp=8"): "model.kv_lora_rank=30 must be divisible by",
        ("model.kv_lora_rank=32", "precision.fp8.enabled=true"): "precision.fp8.enabled=false",
        ("model.kv_lora_rank=32", "model.attention=cudnn", "model.v_head_dim=260"): "model.attention=xla",
    }
    for overrides, fix in refusals.items():
        with pytest.raises(ConfigError, match=fix.replace(".", r"\.")):
            _config(*overrides)
    with pytest.raises(ConfigError, match=r"model\.name=llama"):
        make_attention(dataclasses.replace(cfg.model, name="qwen3"), nnx.Rngs(0), variant=_variant("qwen3"))
    with caplog.at_level(logging.WARNING, logger="jaxpar.config.mla"):
        _config("model.v_head_dim=64")
    assert "have no effect without model.kv_lora_rank" in caplog.text


def _variant(name: str):
    from jaxpar.model.llama import VARIANTS

    return VARIANTS[name]


def test_mla_flops_count_its_widths():
    """Per token and layer the forward's scores cost 2*T*H*(N + R) and the values 2*T*H*E; training is 3x."""
    m = ModelConfig(d_model=64, n_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    assert attention_width(m) == 4 * (8 + 4 + 6)
    t, layers = 32, 2
    want = 6 * 1000 + 3 * layers * (2 * t * 4 * (8 + 4) + 2 * t * 4 * 6)
    assert flops_per_token(1000, layers, 64, t, attention_width(m)) == want
    assert attention_width(ModelConfig()) is None  # the usual attention: PaLM's 12*L*D*T
    assert flops_per_token(1000, layers, 64, t) == 6 * 1000 + 12 * layers * 64 * t


@pytest.mark.requires_gpu_compile
def test_mla_runs_cudnn_fused_attention_at_bf16():
    """Compiled for an H100 without one: MLA's forward and backward reach cuDNN's fused attention kernels at
    DeepSeek-V3's kernel width 192 (N + R = 128 + 64, v 128 padded to 192). jax lets a width above 128 through only
    after asking the local GPU whether it is a Hopper: the checks answer for the H100 target
    (`jaxpar.parallel.jax_private.cudnn_compute_capability`, as the deviceless compile of a step does)."""
    import re

    from jax.sharding import Mesh, NamedSharding

    from jaxpar.analysis.gpu.deviceless import compile_devices
    from jaxpar.analysis.gpu.targets import cluster
    from jaxpar.parallel.jax_private import cudnn_compute_capability

    replicated = NamedSharding(Mesh(compile_devices(cluster("h100", 1, 1)), ("x",)), P())
    module = MLA(256, 4, 64, 96, 128, 64, 128, THETA, 0.02, nnx.Rngs(0), implementation="cudnn")
    graphdef, state = nnx.split(module)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=replicated), state)
    x = jax.ShapeDtypeStruct((2, 256, 256), jnp.bfloat16, sharding=replicated)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x).astype(jnp.float32))

    with cudnn_compute_capability(cluster("h100", 1, 1).target.compute_capability):
        lowered = jax.jit(jax.grad(loss)).lower(abstract, x)
    hlo = lowered.compile().as_text()
    calls = [line for line in hlo.splitlines() if "custom-call(" in line and "fmha" in line]
    targets = sorted(re.search(r'custom_call_target="([^"]+)"', c).group(1) for c in calls)
    assert targets == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"]
    assert all("bf16[2,256,4,192]" in c for c in calls if "Backward" not in c)


# --- a whole train step: a tiny llama with MLA on data 2 x fsdp 2 x tensor 2 against one device ---

STEP_VALID = (16, 16, 3, 0, 12, 16, 1, 9)  # valid tokens per row (uneven, as tests/parity/test_families.py)
STEP_MLA = ("model.kv_lora_rank=32", "model.q_lora_rank=48", "model.qk_rope_head_dim=8", "model.v_head_dim=24")


@pytest.mark.slow  # two train-step compiles, ~20 s
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "optimizer.zero_stage=3"), id="dp2-fsdp2-tp2-sp"),
        pytest.param(
            ("mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2", "tensor.sequence_parallel=false")
            + ("pipeline.microbatches=2", "optimizer.zero_stage=1"),
            id="pp2-fsdp2-tp2-nosp",
        ),
    ],
)
def test_mla_train_step_equals_one_device(layout):
    """One Adam step of a 2-layer llama whose attention is MLA (packed documents in the batch), on tensor 2 with
    sequence parallelism, fsdp and data (ZeRO-3), or without it on a 1F1B pipeline with fsdp (ZeRO-1), against one
    device: fp32 whole-model parity (`step_helpers.FP32_RTOL`)."""
    from step_helpers import (
        FIRST_STEP_AT_PEAK,
        FP32,
        assert_step_equals,
        compile_fast,
        host_batch,
        make_plan,
        shard_shape,
        stepped,
        to_host,
    )

    from jaxpar.training.state import init_state
    from jaxpar.training.step import make_train_step

    base = [*FP32, *FIRST_STEP_AT_PEAK, "optimizer.grad_clip_norm=0", "data.seq_len=16", "model.n_layers=2"]
    base += [f"train.global_batch_size={len(STEP_VALID)}", "mesh.data=1", "mesh.fsdp=1", "model.n_kv_heads=null"]
    base += STEP_MLA
    batch = host_batch(STEP_VALID, 16, 7)
    batch["segment_ids"] = np.broadcast_to(np.repeat(np.arange(3, dtype=np.int32), (7, 4, 5)), (8, 16)).copy()

    def run(plan, host_state):
        device_batch = {k: jax.device_put(v, plan.batch_sharding) for k, v in batch.items()}
        state = jax.device_put(host_state, plan.state_shardings)
        return stepped(compile_fast(make_train_step(plan), state, device_batch), state, device_batch)

    ref_plan = make_plan(base, jax.devices()[:1])
    host_state = to_host(init_state(ref_plan, 7))
    attn = host_state["params"]["blocks"]["attn"]
    rng = np.random.default_rng(7)
    for norm in ("q_norm", "kv_norm"):  # random scales: a scale on the wrong latent entries would show
        attn[norm]["scale"] = (1 + 0.1 * rng.standard_normal(attn[norm]["scale"].shape)).astype(np.float32)
    ref = {"host_state": host_state, **run(ref_plan, host_state)}

    plan = make_plan([*base, *layout], jax.devices())
    state = init_state(plan, 7)
    blocks = state["params"]["blocks"]["attn"]
    assert shard_shape(blocks["wq_b"])[2] == 2, "wq_b [L, Q, H, N + R] keeps H / tensor heads per device"
    assert shard_shape(blocks["wkv_a"])[-1] == 32 + 8, "wkv_a's latent and rotary key are whole on every device"
    del state
    got = run(plan, ref["host_state"])
    assert_step_equals(plan, got, ref, FP32_RTOL)


@pytest.mark.slow  # three train-step compiles, ~30 s
def test_mla_under_zero_bubble_schedules_over_uneven_stages(need_devices):
    """5 MLA layers over 2 stages (pipeline.balance_stages: stored as 6 rows, the last zero) under zb-h1 and zb-v:
    the split backward (B and W, `jaxpar.parallel.split_backward`) through MLA's latents and padded kernel equals
    one device's step at fp32 parity (`step_helpers.FP32_RTOL`)."""
    from step_helpers import (
        FIRST_STEP_AT_PEAK,
        FP32,
        assert_step_equals,
        compile_fast,
        device_batch,
        host_batch,
        make_plan,
        stepped,
        to_host,
    )

    from jaxpar.training.state import init_state
    from jaxpar.training.step import make_train_step

    need_devices(2)
    model = (*FP32, *FIRST_STEP_AT_PEAK, *STEP_MLA, "model.n_layers=5", "model.n_kv_heads=4", "data.seq_len=16")
    model += ("optimizer.grad_clip_norm=0", "train.global_batch_size=8", "mesh.data=1", "mesh.fsdp=1")
    valid = STEP_VALID
    ref_plan = make_plan(list(model), jax.devices()[:1])
    state = init_state(ref_plan, 5)
    host = to_host(state)
    batch = device_batch(ref_plan, host_batch(valid, 16, 5))
    ref = {**stepped(compile_fast(make_train_step(ref_plan), state, batch), state, batch), "host_state": host}
    for schedule in (("pipeline.schedule=zb-h1",), ("pipeline.schedule=zb-v", "pipeline.virtual_stages=2")):
        split = ("mesh.pipeline=2", "pipeline.microbatches=4", "pipeline.balance_stages=true", *schedule)
        plan = make_plan([*model, *split], jax.devices()[:2])
        assert plan.stack_rows == 6
        state = init_state(plan, params=host["params"])
        batch = device_batch(plan, host_batch(valid, 16, 5))
        got = stepped(compile_fast(make_train_step(plan), state, batch), state, batch)
        for key in ("params", "mu", "nu"):
            assert not any(np.any(a[5:]) for a in jax.tree.leaves(got[key]["blocks"]))  # the zero row stays zero
            got[key] = {**got[key], "blocks": jax.tree.map(lambda a: a[:5], got[key]["blocks"])}
        assert_step_equals(plan, got, ref, FP32_RTOL)
