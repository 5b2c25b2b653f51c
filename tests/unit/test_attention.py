"""Attention implementations (jaxpar.config.attention, jaxpar.model.attention): which one `model.attention` picks on
each platform, the XLA path's document masking against a per-document reference, cuDNN's packed layout built from
segment ids, and the model and step passing segment ids through. The cuDNN kernel itself runs on NVIDIA GPUs only:
its compiled form is checked by tests/system/test_plan_gpu.py, its numbers by tools/check_gpu_configs.py.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import ConfigError, load_config
from jaxpar.config.attention import resolve_attention
from jaxpar.model import build_model, dot_product_attention
from jaxpar.model.attention import packed_segments
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.plan import build_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_YAML = os.path.join(ROOT, "configs", "tiny.yaml")


def _qkv(b=2, t=24, h=4, g=2, k=8, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, (b, t, h, k), jnp.float32),
        jax.random.normal(kk, (b, t, g, k), jnp.float32),
        jax.random.normal(kv, (b, t, g, k), jnp.float32),
    )


def _runs(row: np.ndarray) -> list[tuple[int, int]]:
    starts = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1]] + [len(row)]
    return list(zip(starts[:-1], starts[1:]))


# Documents of 5, 7, 1 and 11 tokens; a single document; ids that repeat across rows and are not increasing.
SEGMENTS = np.array([[3] * 5 + [1] * 7 + [9] + [4] * 11, [2] * 24], np.int32)


# grouped-query in the default suite; multi-head and multi-query (the two ends of the same code) in the slow one
@pytest.mark.parametrize(
    "heads",
    [pytest.param((4, 4), marks=pytest.mark.slow), (4, 2), pytest.param((4, 1), marks=pytest.mark.slow)],
    ids=["mha", "gqa", "mqa"],
)
def test_xla_attention_with_segment_ids_equals_each_document_alone(heads):
    """Each document's output equals causal attention over that document alone. fp32; the masked keys add
    exactly 0 (exp(-inf)), so the only difference is the summation order over more terms: 1e-6 absolute on
    outputs of order 1 (measured ~1e-7)."""
    h, g = heads
    q, k, v = _qkv(h=h, g=g)
    seg = jnp.asarray(SEGMENTS)
    out = dot_product_attention(q, k, v, implementation="xla", segment_ids_BT=seg)
    ref = np.zeros(out.shape, np.float32)
    for b in range(SEGMENTS.shape[0]):
        for start, end in _runs(SEGMENTS[b]):
            sl = slice(start, end)
            ref[b, sl] = dot_product_attention(
                q[b : b + 1, sl], k[b : b + 1, sl], v[b : b + 1, sl], implementation="xla"
            )[0]
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-6, rtol=0)
    # The mask matters: without segment ids the later documents see the earlier ones.
    unmasked = dot_product_attention(q, k, v, implementation="xla")
    assert float(jnp.max(jnp.abs(unmasked[0, 5:] - out[0, 5:]))) > 1e-2
    np.testing.assert_array_equal(np.asarray(unmasked[1]), np.asarray(out[1]))  # one document: the same program


def test_packed_layout_lists_each_run_of_equal_ids():
    offsets, lengths, overflow = packed_segments(jnp.asarray(SEGMENTS), 6)
    np.testing.assert_array_equal(np.asarray(offsets), [[0, 5, 12, 13, -1, -1, -1], [0, -1, -1, -1, -1, -1, -1]])
    np.testing.assert_array_equal(np.asarray(lengths), [[5, 7, 1, 11, -1, -1], [24, -1, -1, -1, -1, -1]])
    np.testing.assert_array_equal(np.asarray(overflow), [False, False])
    _, _, overflow = packed_segments(jnp.asarray(SEGMENTS), 3)  # 4 documents in row 0 do not fit 3 slots
    np.testing.assert_array_equal(np.asarray(overflow), [True, False])


def test_auto_is_cudnn_on_a_gpu_with_16_bit_compute_and_xla_otherwise():
    assert resolve_attention("auto", "gpu", "bfloat16", 128) == "cudnn"
    assert resolve_attention("auto", "gpu", "float32", 128) == "xla"  # cuDNN's kernel is 16-bit only
    assert resolve_attention("auto", "gpu", "bfloat16", 12) == "xla"  # head width not a multiple of 8
    assert resolve_attention("auto", "cpu", "bfloat16", 128) == "xla"
    assert resolve_attention("auto", "tpu", "bfloat16", 128) == "xla"
    assert resolve_attention("xla", "gpu", "bfloat16", 128) == "xla"
    assert resolve_attention("cudnn", "gpu", "bfloat16", 64) == "cudnn"
    with pytest.raises(ValueError, match="NVIDIA GPUs only.*model.attention=auto"):
        resolve_attention("cudnn", "cpu", "bfloat16", 64)
    with pytest.raises(ValueError, match="bfloat16 or float16, not float32.*compute_dtype=bfloat16"):
        resolve_attention("cudnn", "gpu", "float32", 64)
    with pytest.raises(ValueError, match="multiples of 8 up to 128 on this GPU .256 on Hopper and newer., not 160"):
        resolve_attention("cudnn", "gpu", "bfloat16", 160)
    # Hopper (compute capability 9.0) and newer take heads up to 256: MLA's kernel width 192
    assert resolve_attention("auto", "gpu", "bfloat16", 192, capability=(9, 0)) == "cudnn"
    assert resolve_attention("auto", "gpu", "bfloat16", 192, capability=(8, 0)) == "xla"
    with pytest.raises(ValueError, match="up to 256 on Hopper and newer, not 264"):
        resolve_attention("cudnn", "gpu", "bfloat16", 264, capability=(10, 0))


def test_cudnn_on_cpu_devices_is_refused_before_any_device_work(devices8):
    cfg = load_config(TINY_YAML, ["model.attention=cudnn", "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"])
    with pytest.raises(ConfigError, match="model.attention=cudnn runs on NVIDIA GPUs only, and this step runs on cpu"):
        build_plan(cfg, build_mesh(cfg, devices8))
    with pytest.raises(ConfigError, match="model.attention='flash' is not one of auto, xla, cudnn"):
        load_config(TINY_YAML, ["model.attention=flash"])
    with pytest.raises(ConfigError, match="model.max_segments"):
        load_config(TINY_YAML, ["model.max_segments=0"])


@pytest.mark.slow  # compiles the whole model four times (about 5 s on 2 cores)
def test_the_model_masks_attention_across_documents():
    """Through the whole Llama (embedding, scanned blocks with remat, head): one segment id everywhere is the
    unmasked model bit for bit; two documents change the second one's logits and leave the first one's (causal:
    the first document never sees the second) equal."""
    cfg = load_config(TINY_YAML, ["model.remat=dots"]).model
    model = build_model(cfg, 0)
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, cfg.vocab_size)
    plain = model(tokens)
    one = model(tokens, segment_ids_BT=jnp.zeros((2, 32), jnp.int32))
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(one))
    two = model(tokens, segment_ids_BT=jnp.asarray([[0] * 12 + [1] * 20] * 2, jnp.int32))
    np.testing.assert_allclose(np.asarray(two[:, :12]), np.asarray(plain[:, :12]), atol=1e-6, rtol=0)
    assert float(jnp.max(jnp.abs(two[:, 12:] - plain[:, 12:]))) > 1e-3


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--platform", "cpu", "model.attention=cudnn"], "runs on NVIDIA GPUs only, and this step runs on cpu"),
        (["precision.compute_dtype=float32", "model.attention=cudnn"], "bfloat16 or float16, not float32"),
        (["model.attention=cudnn", "model.head_dim=512"], "multiples of 8 up to 256 on Hopper and newer, not 512"),
    ],
)
def test_jaxpar_plan_refuses_cudnn_where_it_cannot_run(overrides, message, capsys):
    from jaxpar.cli import plan as plan_cli

    assert plan_cli.main([TINY_YAML, *overrides]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and message in err and "Traceback" not in err
    assert plan_cli.main([TINY_YAML, "--json"]) == 0
    assert '"attention": "cudnn"' in capsys.readouterr().out  # auto on the default platform, gpu


def test_segment_positions_restart_at_each_document():
    from jaxpar.model.attention import segment_positions

    seg = jnp.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], jnp.int32)
    np.testing.assert_array_equal(segment_positions(seg), [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))])


def _banded_reference(q, k, v, window: int, segments=None, scale=None, softcap=None) -> np.ndarray:
    """Causal attention with an explicit [T, T] mask: key s visible to query t when t - window < s <= t (and the
    same document), the scores scaled by `scale` (default K ** -0.5) and capped at `softcap`, in numpy float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, kw = q.shape
    g = k.shape[2]
    pos = np.arange(t)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)  # [t, s]
    mask = np.broadcast_to(mask, (b, t, t))
    if segments is not None:
        mask = mask & (segments[:, :, None] == segments[:, None, :])
    kk, vv = np.repeat(k, h // g, axis=2), np.repeat(v, h // g, axis=2)
    scores = np.einsum("bthk,bshk->bhts", q, kk) * (kw**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    scores = np.where(mask[:, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshk->bthk", p, vv)


@pytest.mark.parametrize("packed", [False, True], ids=["one_document", "packed"])
def test_sliding_window_sees_the_window_keys_itself_included(packed):
    """`window` W: query t sees keys t - W < s <= t (transformers' Mistral mask), within its document when packed
    (the documents of SEGMENTS, whose lengths 5, 7, 1, 11 straddle W = 4). fp32 against float64: 1e-6."""
    q, k, v = _qkv()
    seg = SEGMENTS if packed else None
    out = dot_product_attention(
        q, k, v, implementation="xla", window=4, segment_ids_BT=None if seg is None else jnp.asarray(seg)
    )
    np.testing.assert_allclose(np.asarray(out), _banded_reference(q, k, v, 4, seg), atol=1e-6, rtol=0)
    # the window matters, and one as long as the sequence is plain causal attention
    plain = dot_product_attention(q, k, v, implementation="xla")
    assert float(jnp.max(jnp.abs(out - plain))) > 1e-2
    whole = dot_product_attention(q, k, v, implementation="xla", window=24)
    np.testing.assert_allclose(np.asarray(whole), np.asarray(plain), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="window 0 must be >= 1"):
        dot_product_attention(q, k, v, implementation="xla", window=0)


@pytest.mark.parametrize("packed", [False, True], ids=["one_document", "packed"])
def test_soft_capped_scores_with_their_own_scale(packed):
    """Gemma 2's attention: scores scaled by 24 ** -0.5 then capped at 2 (the visible scores of these random inputs
    reach 2.6 and a tenth exceed 1, where the cap bends them by over 8%), with a window of 5 and documents; fp32
    against float64: 1e-6."""
    q, k, v = _qkv()
    seg = SEGMENTS if packed else None
    kw = dict(implementation="xla", window=5, scale=24**-0.5, softcap=2.0)
    out = dot_product_attention(q, k, v, segment_ids_BT=None if seg is None else jnp.asarray(seg), **kw)
    want = _banded_reference(q, k, v, 5, seg, scale=24**-0.5, softcap=2.0)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-6, rtol=0)
    uncapped = dot_product_attention(q, k, v, implementation="xla", window=5, scale=24**-0.5)
    assert float(jnp.max(jnp.abs(out - uncapped))) > 1e-2
    with pytest.raises(ValueError, match="runs on xla only"):
        dot_product_attention(q, k, v, implementation="cudnn", softcap=2.0)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.sliding_window=0"], "model.sliding_window=0 must be a positive number of tokens"),
        (["model.sliding_window=8", "mesh.context=2"], "context parallelism's attention (both strategies)"),
        (["model.name=mixtral"], "model.name=mixtral is a mixture of experts: set model.moe.num_experts"),
        (["model.name=mistral", "model.moe.num_experts=4"], "use model.name=mixtral for experts"),
        (["model.attention_softcap=50", "model.attention=cudnn"], "cuDNN's fused attention has no soft-capping"),
        (["model.attention_softcap=50", "mesh.context=2"], "cannot honour soft-capped scores"),
        (["model.attention_softcap=-1"], "model.attention_softcap=-1.0 must be > 0, or null"),
        (["model.name=gemma2", "model.n_layers=3"], "must be a multiple of 2 for model.name=gemma2"),
        (["model.name=gemma2", "model.n_layers=6", "mesh.pipeline=2"], "3 units of gemma2's stack"),
    ],
    ids=[
        "window_zero",
        "window_context",
        "mixtral_dense",
        "mistral_experts",
        "softcap_cudnn",
        "softcap_context",
        "softcap_negative",
        "gemma2_odd",
        "gemma2_pipeline",
    ],
)
def test_jaxpar_plan_refuses_a_window_or_family_it_cannot_honour(overrides, message, capsys):
    from jaxpar.cli import plan as plan_cli

    assert plan_cli.main([TINY_YAML, *overrides]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and message in err and "Traceback" not in err


@pytest.mark.requires_gpu_compile
def test_cudnn_runs_the_window_in_its_fused_kernel():
    """Compiled for an H100 without one: the window reaches cuDNN's forward and backward kernels as their
    `sliding_window_length` (W keys, itself included: jax's (W - 1, 0) local window plus one). The packed layout
    cannot be compiled here (jax asks the local GPU whether it is a Hopper); the GPU acceptance run compares both
    with XLA's on a GPU (`jaxpar.analysis.gpu.acceptance.attention_parity`)."""
    import re

    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpar.analysis.gpu.deviceless import compile_devices
    from jaxpar.analysis.gpu.targets import cluster

    replicated = NamedSharding(Mesh(compile_devices(cluster("h100", 1, 1)), ("x",)), P())
    q = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.bfloat16, sharding=replicated)
    kv = jax.ShapeDtypeStruct((2, 1024, 2, 128), jnp.bfloat16, sharding=replicated)

    def loss(q, k, v):
        return jnp.sum(dot_product_attention(q, k, v, implementation="cudnn", window=256).astype(jnp.float32))

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile().as_text()
    calls = [line for line in hlo.splitlines() if "custom-call(" in line and "fmha" in line]
    targets = sorted(re.search(r'custom_call_target="([^"]+)"', c).group(1) for c in calls)
    assert targets == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"]
    assert all(re.search(r'"sliding_window_length":\s*"?256\b', c) for c in calls)
