"""A model family of one's own (`examples/gpt2.py`, written against `jaxpar.model` only) trains on every
layout exactly as one device does, and a model that does not follow the interface is refused before any device
work.

GPT-2 differs from the built-in llama in every part the interface touches (LayerNorm with bias, biased
projections, GELU MLP, learned positions, tied head). One train step of each layout is compared with the single
device step in fp32 at `step_helpers.FP32_RTOL` (reordered fp32 sums; that constant says why): loss, grad norm,
the gradients of `make_grad_fn`, Adam's moments and the update (`step_helpers.assert_adam_step_close`); the key
bias, whose gradient is zero in exact arithmetic, is only checked to be rounding noise. Layouts:
data x fsdp with accumulation under ZeRO 0-3, tensor with and without sequence parallelism, and pipeline=2 with
1F1B and GPipe; each test asserts that its layout really splits what it claims to.

Shape letters: G global batch, T sequence length, L layers, D model width, F mlp hidden width, V vocabulary.
"""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from optax import tree_utils as otu
from step_helpers import (
    CONFIG,
    FIRST_STEP_AT_PEAK,
    FP32,
    FP32_RTOL,
    TINY,
    VOCAB,
    adam_step_args,
    assert_adam_step_close,
    assert_scalar_close,
    assert_tree_close,
    device_batch,
    host_batch,
    one_adam_step,
    planner,
    shard_shape,
    spec_axes,
    to_host,
)

import jaxpar
import jaxpar.model as jm
from jaxpar.config import ConfigError, load_config
from jaxpar.data.packing import pack
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.plan import build_plan
from jaxpar.training.state import init_state
from jaxpar.training.step import make_grad_fn

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("gpt2", os.path.join(ROOT, "examples", "gpt2.py"))
gpt2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt2)  # registers model.name=gpt2

RTOL = FP32_RTOL
SEED = 5
T = 8
VALID = (8, 3, 8, 0, 5, 8, 1, 8, 8, 7, 2, 8, 8, 4, 8, 6)  # uneven valid tokens per row, one row fully masked
G = len(VALID)
GPT2 = ("model.name=gpt2", "model.n_kv_heads=null", "model.tie_embeddings=true")

# name: (overrides, marks). The default suite: ZeRO 1-3, every axis, 1F1B, accumulation; -m slow adds ZeRO-0,
# GPipe and the other splits of 8 devices.
LAYOUTS = {
    "data2_fsdp4_zero1_accum2": (
        ["mesh.data=2", "mesh.fsdp=4", "optimizer.zero_stage=1", "train.grad_accum_steps=2"],
        (),
    ),
    "data2_fsdp2_tensor2_sp_zero3": (
        ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "tensor.sequence_parallel=true", "optimizer.zero_stage=3"],
        (),
    ),
    "pipeline2_1f1b_data2_fsdp2_zero2": (
        [
            "mesh.pipeline=2",
            "mesh.data=2",
            "mesh.fsdp=2",
            "pipeline.microbatches=2",
            "pipeline.schedule=1f1b",
            "optimizer.zero_stage=2",
        ],
        (),
    ),
    "data8_zero0": (["mesh.data=8", "mesh.fsdp=1", "optimizer.zero_stage=0"], (pytest.mark.slow,)),
    "fsdp8_zero3": (["mesh.data=1", "mesh.fsdp=8", "optimizer.zero_stage=3"], (pytest.mark.slow,)),
    "data4_fsdp2_zero2": (["mesh.data=4", "mesh.fsdp=2", "optimizer.zero_stage=2"], (pytest.mark.slow,)),
    "data4_tensor2_zero1": (
        ["mesh.data=4", "mesh.fsdp=1", "mesh.tensor=2", "tensor.sequence_parallel=false", "optimizer.zero_stage=1"],
        (pytest.mark.slow,),
    ),
    "pipeline2_gpipe_data2_fsdp2_zero1": (
        [
            "mesh.pipeline=2",
            "mesh.data=2",
            "mesh.fsdp=2",
            "pipeline.microbatches=2",
            "pipeline.schedule=gpipe",
            "optimizer.zero_stage=1",
        ],
        (pytest.mark.slow,),
    ),
}


_plan = planner(*FP32, *FIRST_STEP_AT_PEAK, *GPT2, "mesh.data=1", "mesh.fsdp=1", f"train.global_batch_size={G}")


@pytest.fixture(scope="module")
def reference() -> dict:
    plan = _plan([], 1)
    state = init_state(plan, SEED)
    host_state = to_host(state)
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    return dict(one_adam_step(plan, state, batch), host_state=host_state, plan=plan)


def test_gpt2_is_its_own_family(reference):
    """The registered family builds GPT-2's parameters, not llama's: learned positions, biases, LayerNorm
    biases, no separate output projection; and its loss starts near log V."""
    params = reference["host_state"]["params"]
    assert reference["plan"].cfg.model.name == "gpt2" and "gpt2" in jm.registered_models()
    assert params["positions"]["table"].shape == (gpt2.MAX_POSITIONS, 64)
    assert set(params["blocks"]["mlp"]) == {"w_in", "b_in", "w_out", "b_out"}
    assert set(params["blocks"]["ln_1"]) == {"scale", "bias"} and "lm_head" not in params
    assert abs(reference["metrics"]["loss"] - np.log(VOCAB)) < 0.1


def _assert_layout(name: str, plan, state, batch) -> None:
    """The layout splits what its name says."""
    shape = plan.mesh.shape
    w = state["params"]["blocks"]["mlp"]["w_in"]  # [L, D, F]
    mu = otu.tree_get(state["opt_state"], "mu")["blocks"]["mlp"]["w_in"]
    L, D, F = w.shape
    zero = plan.cfg.optimizer.zero_stage
    params_over = shape["fsdp"] * (shape["data"] if zero == 3 else 1)
    opt_over = shape["fsdp"] * (shape["data"] if zero >= 1 else 1)
    assert shard_shape(w) == (L // shape["pipeline"], D // params_over, F // shape["tensor"])
    assert shard_shape(mu) == (L // shape["pipeline"], D // opt_over, F // shape["tensor"])
    assert shard_shape(batch["inputs"]) == (G // (shape["data"] * shape["fsdp"]), T)
    assert max(shape.values()) > 1 and len(w.sharding.device_set) == 8
    if shape["tensor"] > 1:
        assert shard_shape(state["params"]["embed"]["table"])[0] == VOCAB // shape["tensor"]
        assert plan.tensor_parallel.sequence_parallel == ("_sp" in name)
    if shape["pipeline"] > 1:
        assert "pipeline" in spec_axes(w.sharding) and plan.cfg.pipeline.schedule in name
    if "accum" in name:
        assert plan.cfg.train.grad_accum_steps == 2


@pytest.mark.parametrize("name", [pytest.param(n, marks=m) for n, (_, m) in LAYOUTS.items()])
def test_gpt2_step_equals_one_device(name, reference, need_devices):
    need_devices(8)
    plan = _plan(LAYOUTS[name][0], 8)
    state = jax.device_put(reference["host_state"], plan.state_shardings)  # identical init on every layout
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    _assert_layout(name, plan, state, batch)
    out = one_adam_step(plan, state, batch)
    m, ref_m = out["metrics"], reference["metrics"]
    assert m["tokens"] == ref_m["tokens"] == out["grad_tokens"] == sum(VALID)
    assert_scalar_close(m["loss"], ref_m["loss"], RTOL, "loss")
    assert_scalar_close(out["grad_loss"], ref_m["loss"], RTOL, "grad_fn loss")
    assert_scalar_close(m["grad_norm"], ref_m["grad_norm"], RTOL, "grad_norm")
    # The key bias's gradient is zero in exact arithmetic: adding b to every key adds q.b to all of a query's
    # scores, which the softmax ignores. Both sides hold rounding noise there (about 1e-10), which no relative
    # bound can compare, so it is checked to be noise and left out of the comparisons.
    for side in (out, reference):
        assert np.linalg.norm(side["grads"]["blocks"]["attn"]["bk"]) <= 1e-6 * ref_m["grad_norm"]
    got, want = _without_key_bias(out), _without_key_bias(reference)
    assert_tree_close(got["grads"], want["grads"], RTOL)
    args = adam_step_args(plan, m)
    args["decayed"] = _drop_bk(args["decayed"])
    assert_adam_step_close(got, want, got["params0"], RTOL, **args)


def _drop_bk(tree: dict) -> dict:
    attn = {k: v for k, v in tree["blocks"]["attn"].items() if k != "bk"}
    return {**tree, "blocks": {**tree["blocks"], "attn": attn}}


def _without_key_bias(step: dict) -> dict:
    return {k: _drop_bk(step[k]) for k in ("grads", "params0", "params", "mu", "nu")}


# --- a mixture of experts in a model of one's own ------------------------------------------------------------

GPT2_MOE = (
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.every=1",
    "model.moe.routing=capacity",
    "model.moe.capacity_factor=0.5",
    "model.moe.aux_loss_weight=0.1",
    "model.moe.z_loss_weight=0.01",
)
MOE_METRICS = ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "moe_load_max_mean")


def test_gpt2_with_experts_equals_one_device():
    """GPT-2 with every MLP a `jaxpar.model.MoE` (capacity routing that drops assignments), on data x fsdp x
    tensor with sequence parallelism and the experts split over fsdp: the step equals one device's, auxiliary
    losses and expert loads included (through the model's own run_blocks_with_stats)."""
    ref_plan = _plan(GPT2_MOE, 1)
    state = init_state(ref_plan, SEED)
    host_state = to_host(state)
    ref = one_adam_step(ref_plan, state, device_batch(ref_plan, host_batch(VALID, T, SEED)))
    layout = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "tensor.sequence_parallel=true", "optimizer.zero_stage=1"]
    plan = _plan([*GPT2_MOE, *layout, "model.moe.expert_axes=[fsdp]"], 8)
    state = jax.device_put(host_state, plan.state_shardings)
    w_up = state["params"]["blocks"]["mlp"]["w_up"]  # [L, E, D, F]
    L, E, D, F = w_up.shape
    assert plan.expert_axes == ("fsdp",) and plan.tensor_parallel.sequence_parallel
    assert shard_shape(w_up) == (L, E // 2, D, F // 2)  # 2 of the 4 experts per device, F over tensor
    out = one_adam_step(plan, state, device_batch(plan, host_batch(VALID, T, SEED)))
    m, ref_m = out["metrics"], ref["metrics"]
    assert ref_m["moe_dropped_fraction"] > 0.2  # capacity overflows: the same assignments drop on both
    for name in MOE_METRICS:
        assert_scalar_close(m[name], ref_m[name], RTOL, name)
    got, want = _without_key_bias(out), _without_key_bias(ref)  # the key bias: see test_gpt2_step_equals_one_device
    assert np.abs(want["grads"]["blocks"]["mlp"]["router"]).max() > 0
    assert_tree_close(got["grads"], want["grads"], RTOL)
    args = adam_step_args(plan, m)
    args["decayed"] = _drop_bk(args["decayed"])
    assert_adam_step_close(got, want, got["params0"], RTOL, **args)


def test_context_parallelism_refuses_a_model_without_positions():
    """gpt2's run_blocks takes no positions_BT (its attention does not run through tp.context): mesh.context > 1
    is refused by the plan, before any device work, naming the fix."""
    with pytest.raises(ConfigError, match="run_blocks of model .gpt2. takes no positions_BT, which context"):
        _plan(["mesh.context=2", "data.seq_len=8"], 2)


def test_gpt2_moe_refusals_and_a_model_without_router_statistics():
    """A model family without run_blocks_with_stats is refused under model.moe, naming the method; gpt2 refuses
    MoE groups (every > 1)."""
    jm.register_model("no_moe", _Flat, replace=True)
    cfg = load_config(CONFIG, [*TINY, "model.name=no_moe", "mesh.data=1", "mesh.fsdp=1", *GPT2_MOE], num_devices=1)
    with pytest.raises(TypeError, match="has no run_blocks_with_stats, which model.moe needs"):
        build_plan(cfg, build_mesh(cfg, jax.devices()[:1]))
    with pytest.raises(ValueError, match="makes every block MoE: set model.moe.every=1"):
        _plan([*GPT2_MOE, "model.moe.every=2"], 1)


# --- the interface is checked before any device work ---------------------------------------------------------


class _NoBlocks(nnx.Module):
    def __init__(self, cfg, rngs):
        self.w = nnx.Param(jax.numpy.zeros((cfg.d_model,)), logical_axes=("embed",))

    def embed_tokens(self, *a): ...

    def run_blocks(self, *a): ...

    def logits(self, *a): ...


class _Unnamed(_NoBlocks):
    def __init__(self, cfg, rngs):
        self.blocks = jm.stack_layers(cfg.n_layers, lambda r: nnx.Linear(cfg.d_model, cfg.d_model, rngs=r), rngs)


class _UnknownAxis(_NoBlocks):
    def __init__(self, cfg, rngs):
        self.blocks = jm.stack_layers(cfg.n_layers, lambda r: _NoBlocks(cfg, r), rngs)
        self.w = nnx.Param(jax.numpy.zeros((4, cfg.d_model)), logical_axes=("channels", "embed"))


class _WithRngState(_NoBlocks):
    def __init__(self, cfg, rngs):
        self.blocks = jm.stack_layers(cfg.n_layers, lambda r: _NoBlocks(cfg, r), rngs)
        self.dropout_rngs = nnx.Rngs(0)


class _Flat(_NoBlocks):
    def __init__(self, cfg, rngs):
        self.blocks = _NoBlocks(cfg, rngs)  # one layer, not a stack


@pytest.mark.parametrize(
    "build,error,match",
    [
        (_NoBlocks, TypeError, "has no `blocks` module"),
        (_Unnamed, TypeError, r"parameter blocks/bias of shape \(64,\) per layer needs logical_axes"),
        (_UnknownAxis, ValueError, r"logical axes \('channels', 'embed'\); names must be None or one of"),
        (_WithRngState, TypeError, r"dropout_rngs.*nnx.Param only"),
        (_Flat, ValueError, "no leading layers dimension of model.n_layers=2"),
    ],
)
def test_a_model_off_the_interface_is_refused_at_plan_time(build, error, match):
    jm.register_model("off_interface", build, replace=True)
    cfg = load_config(CONFIG, [*TINY, "model.name=off_interface", "mesh.data=1", "mesh.fsdp=1"], num_devices=1)
    with pytest.raises(error, match=match):
        build_plan(cfg, build_mesh(cfg, jax.devices()[:1]))


def test_missing_parts_are_named():
    class Partial(nnx.Module):
        def __init__(self, cfg, rngs):
            self.blocks = jm.stack_layers(cfg.n_layers, lambda r: _NoBlocks(cfg, r), rngs)

        def logits(self, *a): ...

    jm.register_model("partial", Partial, replace=True)
    cfg = load_config(CONFIG, [*TINY, "model.name=partial", "mesh.data=1", "mesh.fsdp=1"], num_devices=1)
    with pytest.raises(TypeError, match="lacks embed_tokens, run_blocks"):
        build_plan(cfg, build_mesh(cfg, jax.devices()[:1]))


def test_unknown_model_name_is_a_config_error_naming_the_registered_ones():
    """The config layer knows no models (it imports nothing above it): the name is checked when the step's plan
    first derives the model, before any device work."""
    cfg = load_config(CONFIG, [*TINY, "model.name=gpt3", "mesh.data=1", "mesh.fsdp=1"], num_devices=1)
    with pytest.raises(
        ConfigError,
        match=r"model.name='gpt3' is not a registered model \(registered: .*llama.*\);"
        r" a script registers its own with jaxpar.register_model",
    ):
        build_plan(cfg, build_mesh(cfg, jax.devices()[:1]))


def test_registering_a_taken_name_or_a_bad_builder_is_refused():
    with pytest.raises(ValueError, match="'llama' is already registered"):
        jm.register_model("llama", gpt2.GPT2)
    for name in ("gpt-2", "for"):
        with pytest.raises(ValueError, match="must be an identifier"):
            jm.register_model(name, gpt2.GPT2)
    with pytest.raises(TypeError, match="build must be callable"):
        jm.register_model("gpt_none", None)


def test_gpt2_refuses_settings_it_cannot_honour():
    cfg = load_config(
        CONFIG, [*TINY, "model.name=gpt2", "model.tie_embeddings=true", "mesh.data=1", "mesh.fsdp=1"], num_devices=1
    )  # TINY has n_kv_heads=2 < n_heads=4
    with pytest.raises(ValueError, match="no grouped-query attention: set model.n_kv_heads=null"):
        build_plan(cfg, build_mesh(cfg, jax.devices()[:1]))


@pytest.mark.slow
def test_own_model_script_resumes_bitwise_and_runs_unchanged_on_two_processes(tmp_path):
    """examples/own_model.py (GPT-2, own Grain data and loss, data x tensor x pipeline, ZeRO-3) as one process
    with 8 devices and as 2 processes x 4 devices under jaxpar-launch: each run's resumed losses equal its
    uninterrupted ones (the script exits 0 only then), and the two runs' losses are bitwise equal."""
    script = os.path.join(ROOT, "examples", "own_model.py")
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    one = subprocess.run(
        [sys.executable, script, "--steps", "4", "--run-dir", str(tmp_path / "one")],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxpar.cli.launch",
            "-n",
            "2",
            "--devices-per-process",
            "4",
            "--",
            sys.executable,
            script,
            "--steps",
            "4",
            "--run-dir",
            str(tmp_path / "two"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )

    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-2000:]
    assert "resumed losses equal the uninterrupted run's, bitwise" in one.stdout + two.stdout

    def losses(run: str) -> dict:
        with open(tmp_path / run / "whole" / "metrics.jsonl") as f:
            return {row["step"]: row["loss"] for row in map(json.loads, f)}

    assert losses("one") == losses("two") and len(losses("one")) == 4


class _OddWidth(_NoBlocks):
    def __init__(self, cfg, rngs):
        self.blocks = jm.stack_layers(cfg.n_layers, lambda r: _NoBlocks(cfg, r), rngs)
        self.extra = nnx.Param(jax.numpy.zeros((7,)), logical_axes=("embed",))


def test_a_width_the_mesh_does_not_divide_is_named_at_plan_time():
    jm.register_model("odd_width", _OddWidth, replace=True)
    cfg = load_config(CONFIG, [*TINY, "model.name=odd_width", "mesh.data=1", "mesh.fsdp=2"], num_devices=2)
    with pytest.raises(
        ConfigError,
        match=r"parameter extra has 7 entries along dimension 0 \(logical axis 'embed'\)"
        r", which fsdp=2 = 2 does not divide",
    ):
        build_plan(cfg, build_mesh(cfg, jax.devices()[:2]))


# --- packed documents (data.document_masking) ------------------------------------------------------------------


def _packed_grads(batch: dict, overrides, devices, params_host=None):
    plan = _plan([*overrides, f"data.seq_len={T}"], devices)
    if params_host is None:
        params_host = to_host(init_state(plan, SEED)["params"])
    params = jax.device_put(params_host, plan.state_shardings["params"])
    on_mesh = {k: jax.device_put(v, plan.batch_sharding) for k, v in batch.items()}
    grads, loss, _ = jax.jit(make_grad_fn(plan))(params, on_mesh)
    return plan, params_host, to_host(grads), float(loss)


@pytest.mark.slow  # the built-in model's packed-document parity runs by default (tests/parity/test_document_masking.py)
def test_gpt2_keeps_attention_within_packed_documents_on_tensor_sequence_parallel(need_devices):
    """GPT-2's run_blocks takes the segment ids: the packed batch's loss and gradients on data x tensor (sequence
    parallel) equal one device's at RTOL, and differ from attention across the documents by far more."""
    need_devices(8)
    rng = np.random.default_rng(SEED)
    tokens = rng.integers(0, VOCAB, G * T + 1).astype(np.int32)
    tokens[::5] = 1  # a document opens every 5 tokens (id 1 as BOS): several per row of T = 8
    batch = pack(tokens, T, bos_id=1)
    assert batch["segment_ids"].max() >= 2
    _, params, grads, loss = _packed_grads(batch, [], 1)
    sp = ["mesh.data=4", "mesh.tensor=2", "tensor.sequence_parallel=true"]
    plan, _, sp_grads, sp_loss = _packed_grads(batch, sp, 8, params)
    assert plan.tensor_parallel.sequence_parallel and plan.mesh.shape["tensor"] == 2
    assert_scalar_close(sp_loss, loss, RTOL, "loss")
    bk = lambda g: {k: v for k, v in g.items() if k != "blocks"} | {"blocks": _drop_bk(g)["blocks"]}  # noqa: E731
    assert_tree_close(bk(sp_grads), bk(grads), RTOL)
    crossing = {k: v for k, v in batch.items() if k != "segment_ids"}
    _, _, crossing_grads, _ = _packed_grads(crossing, [], 1, params)
    w, w_crossing = grads["blocks"]["attn"]["wq"], crossing_grads["blocks"]["attn"]["wq"]
    assert np.linalg.norm(w_crossing - w) > 100 * RTOL * np.linalg.norm(w), "the check could not fail"


class _NoSegmentIds(gpt2.GPT2):
    """GPT-2 whose run_blocks takes no segment ids (three parameters)."""

    def run_blocks(self, x_BTD, gather=jm.no_gather, tp=jm.NO_TENSOR_PARALLEL):
        return super().run_blocks(x_BTD, gather, tp)


@pytest.mark.slow  # a training run after the refusal (about 6 s on 2 cores)
def test_a_model_without_segment_ids_on_packed_documents_is_refused_before_device_work(tmp_path):
    jm.register_model("gpt2_no_segment_ids", _NoSegmentIds, replace=True)
    run_dir = tmp_path / "run"
    args = [
        *TINY,
        *GPT2[1:],
        "model.name=gpt2_no_segment_ids",
        "mesh.data=-1",
        "mesh.fsdp=1",
        f"train.run_dir={run_dir}",
    ]
    cfg = load_config(CONFIG, args, num_devices=jax.device_count())
    assert cfg.data.document_masking
    with pytest.raises(ConfigError, match=r"takes no segment ids .* set data.document_masking=false, or give"):
        jaxpar.train(cfg)
    assert not (run_dir / "checkpoints").exists()
    quick = ["train.steps=1", "train.eval_batches=1", "train.sample_tokens=0", "train.progress_bar=false"]
    plain = load_config(CONFIG, [*args, *quick, "data.document_masking=false"], num_devices=jax.device_count())
    assert list(jaxpar.train(plain).losses) == [1]  # without segment ids the same model trains
