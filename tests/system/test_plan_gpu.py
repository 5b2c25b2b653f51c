"""The deviceless GPU compile (jaxpar.analysis.gpu.deviceless); the targets are tested in
tests/unit/test_gpu_targets.py.

The error without the plugin is checked everywhere (with the plugin installed, by hiding its distribution name).
The compile test needs the `gpu-compile` extra and is skipped without it, with the reason the library gives (and
is slow: `pytest -m slow`): it compiles the tiny model for 2 nodes x 8 H100s and checks the memory analysis and
that the GPU HLO's collectives run over the mesh axes the plan puts them on.
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest
from doc_commands import pyproject_section

from jaxpar.analysis.gpu import deviceless as plan_gpu
from jaxpar.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_YAML = os.path.join(ROOT, "configs", "tiny.yaml")


def test_the_extra_brings_the_plugin_and_ptxas():
    extra = pyproject_section("project.optional-dependencies")["gpu-compile"]
    assert "jax[cuda12-local]" in extra and "nvidia-cuda-nvcc-cu12" in extra


def test_without_the_plugin_the_error_names_the_extra(monkeypatch):
    """Runs with or without the plugin installed: its distribution names are replaced by one that does not
    exist. The error comes after the config and cluster checks and before any compile."""
    monkeypatch.setattr(plan_gpu, "CUDA_PLUGIN_DISTRIBUTIONS", ("jaxpar-no-such-plugin",))
    cfg = load_config(TINY_YAML, validate=False)
    with pytest.raises(plan_gpu.GpuCompileUnavailable, match=r"not installed: pip install 'jaxpar\[gpu-compile\]'"):
        plan_gpu.compile_for_gpu(cfg, "h100", 2, 8)


def test_a_plugin_of_another_version_is_refused(monkeypatch):
    real = importlib.metadata.version

    def version(dist):
        return "0.0.1" if dist == "jaxpar-fake-plugin" else real(dist)

    monkeypatch.setattr(plan_gpu, "CUDA_PLUGIN_DISTRIBUTIONS", ("jaxpar-fake-plugin",))
    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(plan_gpu.GpuCompileUnavailable, match="0.0.1 does not match jaxlib.*gpu-compile"):
        plan_gpu.cuda_plugin_version()


def test_attention_scores_are_batched_matmuls_ending_seq_by_seq():
    hlo = """
  %dot.1 = f32[2,4,128,128]{3,2,1,0} dot(%q, %k), lhs_batch_dims={0,1}, lhs_contracting_dims={3}, rhs_batch_dims={0,1}
  %dot.2 = bf16[128,128]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %stack = bf16[4,1,128,128]{3,2,1,0} dynamic-update-slice(%s, %x, %i, %z, %z, %z)
  %dot.3 = f32[8,128,64]{2,1,0} dot(%a, %b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}
  %dot.4 = f32[8,128,128]{2,1,0} dot(%x, %dy), lhs_batch_dims={1}, lhs_contracting_dims={2}, rhs_batch_dims={0}
"""  # dot.4: a projection's weight gradient with d_model = seq_len (one batch dimension), not scores
    assert plan_gpu.attention_scores(hlo, 128) == {
        "materialised": True,
        "shapes": ["f32[2,4,128,128]"],
        "largest_bytes": 2 * 4 * 128 * 128 * 4,
    }
    assert plan_gpu.attention_scores(hlo, 64) == {"materialised": False, "shapes": [], "largest_bytes": 0}


@pytest.mark.requires_gpu_compile
@pytest.mark.parametrize("name", ["a100", "b200", "h100", "h200"])
def test_the_plugin_accepts_every_shipped_target(name):
    """Each description gives compile-only devices of its kind, and a sharded matmul with an all-reduce compiles
    for them (PTX for its compute capability through ptxas): under a second each."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpar.analysis.gpu.targets import cluster

    clu = cluster(name, 1, 2)
    devices = plan_gpu.compile_devices(clu)
    assert [d.device_kind for d in devices] == [clu.target.device_kind] * 2
    mesh = Mesh(np.array(devices), ("x",))
    x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    compiled = jax.jit(lambda a: jnp.sum((a @ a.T).astype(jnp.float32))).lower(x).compile()
    assert compiled.memory_analysis().argument_size_in_bytes == 256 * 256 * 2 // 2
    assert "all-reduce" in compiled.as_text()


@pytest.mark.slow
@pytest.mark.requires_gpu_compile
def test_tiny_compiles_for_two_h100_nodes():
    """tiny.yaml (data=2, fsdp=4 here, tensor=2, ZeRO-1) on h100:2x8, compiled by XLA's GPU compiler (15-40 s
    on 2 shared cores, hence slow). The all-gathers and reduce-scatters of the GPU HLO carry exactly the plan's bytes
    on the plan's axes (measured ratio 1.0000); smaller all-reduces are combined differently by the GPU passes."""
    cfg = load_config(TINY_YAML, validate=False)
    out = plan_gpu.compile_for_gpu(cfg, "h100", 2, 8)
    assert out["cluster"] == "h100:2x8" and out["devices"] == 16 and out["device_kind"] == "NVIDIA H100 80GB HBM3"
    assert out["mesh"] == {"data": 2, "pipeline": 1, "fsdp": 4, "context": 1, "tensor": 2}
    assert out["compute_dtype"] == "bfloat16"
    mem = out["memory"]
    assert mem["argument_bytes"] > 0 and mem["temp_bytes"] > 0 and mem["output_bytes"] > 0
    # XLA's peak: at least the arguments, at most everything allocated at once
    assert (
        mem["argument_bytes"]
        < mem["peak_bytes"]
        <= (mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"] + mem["temp_bytes"])
    )
    assert out["fits"] and out["fraction_of_memory"] == mem["peak_bytes"] / 80e9
    live = {a for a, n in out["mesh"].items() if n > 1}
    axes = {a for key in out["collectives"] for a in key.split(" ")[0].split(",")}
    assert axes <= live and {"data", "fsdp", "tensor"} <= axes, out["collectives"]
    rows = {r["key"]: r for r in out["planned"]["collectives"]}
    for key in (
        "fsdp all-gather",
        "fsdp reduce-scatter",
        "tensor all-gather",
        "tensor reduce-scatter",
        "data all-gather",
    ):
        assert rows[key]["ratio"] == pytest.approx(1.0, rel=0.01), rows[key]
    # model.attention auto on an H100 with bf16 compute: cuDNN's fused kernel, no score tensor in memory
    assert out["fused_attention"] and not out["attention_scores"]["materialised"]
    assert out["planned"]["peak_bytes"] > 0


@pytest.mark.slow
@pytest.mark.requires_gpu_compile
def test_fused_attention_memory_grows_linearly_in_the_sequence():
    """Llama 1B's layer shape (2 layers, one sequence per H100, remat dots): with model.attention auto the step
    runs cuDNN's flash kernel forward and backward, so doubling T from 4096 to 8192 less than doubles-and-a-tenth
    the temporary bytes (measured 1.85x; XLA's path writes [H, T, T] scores, 4x), and the planner's peak stays
    within 15% of the compiler's (measured 0.93 at both lengths). With model.attention=xla the scores come back."""
    temp = {}
    for t in (4096, 8192):
        overrides = [f"data.seq_len={t}", "model.n_layers=2", "mesh.fsdp=1", "mesh.data=1", "model.remat=dots"]
        overrides += ["train.global_batch_size=1", "train.grad_accum_steps=1", "optimizer.zero_stage=0"]
        cfg = load_config(os.path.join(ROOT, "configs", "llama_1b.yaml"), overrides, validate=False)
        out = plan_gpu.compile_for_gpu(cfg, "h100", 1, 1)
        assert out["fused_attention"] == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"]
        assert not out["attention_scores"]["materialised"]
        assert 0.85 <= out["planned"]["ratio"] <= 1.15, out["planned"]
        temp[t] = out["memory"]["temp_bytes"]
    assert temp[8192] < 2.2 * temp[4096], temp
    xla = plan_gpu.compile_for_gpu(
        load_config(
            os.path.join(ROOT, "configs", "llama_1b.yaml"),
            ["data.seq_len=1024", "model.n_layers=1", "mesh.fsdp=1", "model.attention=xla"],
            validate=False,
        ),
        "h100",
        1,
        1,
    )
    assert xla["fused_attention"] == [] and xla["attention_scores"]["materialised"]


def test_attention_scores_of_grouped_kv_heads_come_out_of_a_fusion():
    """With grouped key/value heads XLA's GPU compiler fuses the logits matmul; the result is found by the
    op_name of jax's attention einsum (lines as the GPU HLO of llama_1b's shape prints them)."""
    hlo = """
  %bitcast.897.0 = f32[8,4,1024,1024]{3,2,1,0} bitcast(%fusion.132), metadata={op_name="jit(train_step)/shard_map/while/body/checkpoint/vmap(BTNH,BSNH->BNTS)/dot_general" scheduling_name="bitcast.897.0"}
  %bitcast.893.3 = bf16[1,8,4,1024,1024]{4,3,2,1,0} bitcast(%param_2.463), metadata={op_name="jit(train_step)/shard_map/checkpoint/vmap(BNTS,BSNH->BTNH)/dot_general"}
  %fusion.7 = bf16[1,1024,8,4,64]{4,3,2,1,0} fusion(%a, %b), kind=kCustom, metadata={op_name="jit(train_step)/vmap(BNTS,BSNH->BTNH)/dot_general"}
  %stack = bf16[32,1,1024,1024]{3,2,1,0} dynamic-update-slice(%s, %x, %i, %z, %z, %z), metadata={op_name="jit(train_step)/scan"}
"""  # noqa: E501 -- HLO lines as the compiler prints them
    assert plan_gpu.attention_scores(hlo, 1024) == {
        "materialised": True,
        "shapes": ["bf16[1,8,4,1024,1024]", "f32[8,4,1024,1024]"],
        "largest_bytes": 8 * 4 * 1024 * 1024 * 4,
    }


@pytest.mark.requires_gpu_compile
def test_pipeline_permutes_run_under_compute_on_gpu():
    """Llama 1B's shape in 1F1B over pipeline 4 x data 2 (ZeRO-1, 8 microbatches of 2 sequences of 4096 tokens)
    compiled for 8 H100s (about 7 s): in the steady ticks' loop the backward permute (to the previous stage)
    runs under the forward's layers and the head, and the forward permute under the backward's layers: each has
    GEMMs between its start and done (measured 23 kernels, 2 with GEMMs; 9, 1). Before the ticks ordered their
    permutes for the GPU (the forward permute after the backward, on every platform) neither had any GEMM
    under it: 8 and 3 small kernels."""
    overrides = ["mesh.data=2", "mesh.fsdp=1", "mesh.pipeline=4", "pipeline.microbatches=8"]
    overrides += ["train.grad_accum_steps=1", "train.global_batch_size=32", "optimizer.zero_stage=1"]
    cfg = load_config(os.path.join(ROOT, "configs", "llama_1b.yaml"), overrides, validate=False)
    out = plan_gpu.compile_for_gpu(cfg, "h100", 1, 8)
    ticks = out["overlap"]["pipeline_permutes"]
    assert sorted(r["trips"] for r in ticks) == [3, 3, 8, 8], ticks  # warm-up, steady (m), cool-down
    steady = {r["direction"]: r for r in ticks if r["trips"] == 8}
    assert set(steady) == {"up", "down"} and all(r["gemms"] >= 1 for r in steady.values()), steady


@pytest.mark.requires_gpu_compile
@pytest.mark.parametrize("balance", ["pipeline.balance_stages=true", "pipeline.vocab_parallel=true"])
def test_balanced_stages_compile_for_gpu_within_the_plan(balance):
    """Llama-3-8B's shape over pipeline 4 x data 2 (ZeRO-1, 8 microbatches of one 4096-token sequence) compiled
    for 8 H100s (about 10 s each), with the two ways of balancing the stages against the head:
      * pipeline.balance_stages: the split is uneven ((8, 8, 9, 7): the head costs 1.7 remat-full layers) and the
        padding rows' skip conds reach the GPU program (their name scope is in its metadata); measured 56.2 GB
        against 62.4 GB planned (0.90; the even split 46.4 GB against 49.3 GB);
      * pipeline.vocab_parallel: every stage's logits are 1/(p t) of the vocabulary, and the head's input and
        gradient cross `pipeline` in all-reduces; measured 44.2 GB against 44.5 GB planned (0.99).
    Both fit, and the peak stays within 15% of the plan."""
    overrides = ["mesh.data=2", "mesh.fsdp=1", "mesh.pipeline=4", "pipeline.microbatches=8"]
    overrides += ["train.grad_accum_steps=1", "train.global_batch_size=32", "optimizer.zero_stage=1", balance]
    cfg = load_config(os.path.join(ROOT, "configs", "llama3_8b.yaml"), overrides, validate=False)
    out = plan_gpu.compile_for_gpu(cfg, "h100", 1, 8, keep_hlo=True)
    if "balance_stages" in balance:
        assert "/active_rows/" in out["hlo"]
    else:
        assert "/active_rows/" not in out["hlo"]
        # 2 per microbatch (the head's input and its gradient) and the cross-entropy's; the even split has 3 in
        # all (the edge gradients'); measured 32
        assert out["collectives"]["pipeline all-reduce"]["count"] >= 2 * 8, out["collectives"]
    assert 0.85 <= out["planned"]["ratio"] <= 1.15, out["planned"]
    assert out["fits"]


@pytest.mark.requires_gpu_compile
@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_context_parallel_compiles_for_gpu_within_the_plan(strategy):
    """Llama 1B's layer shape (2 layers, remat dots, bf16) with one 8192-token sequence over context = 4 (r = 2048
    tokens per device) x data = 2, compiled for 8 H100s (about 12 s each), on XLA's attention (model.attention
    xla; cuDNN's is configs/llama_8b_128k.yaml's record, `tests/unit/test_gpu_check.py`): the whole sequence's scores
    [b, H, r, s] are in memory (`jaxpar.analysis.planner.context`), the peak within 15% of the plan (measured 0.95
    all_gather, 0.94 ring). The context collectives are the plan's, but
    for two things the GPU compiler does after partitioning (the plan counts the partitioned program):
      * it folds each gradient's all-reduce over context into its all-reduce over data (ZeRO-1): one all-reduce
        over data x context of the same S, 2(8-1)/8 S sent instead of 2(2-1)/2 S + 2(4-1)/4 S;
      * ring: it moves the cast of the dK, dV sums to bf16 ahead of their last permute (the c-th, which brings
        them home), so that one sends 2 bytes per element, not 4: 2 arrays x 2 layers x kv x 2 bytes fewer."""
    from jaxpar.analysis.hlo.ring import ring_bytes
    from jaxpar.analysis.planner.comm import collective_terms
    from jaxpar.config import resolve_config

    overrides = ["model.n_layers=2", "mesh.fsdp=1", "mesh.data=2", "mesh.context=4", "optimizer.zero_stage=1"]
    overrides += ["train.global_batch_size=2", "train.grad_accum_steps=1", "data.seq_len=8192", "model.attention=xla"]
    cfg = load_config(os.path.join(ROOT, "configs", "llama_1b.yaml"), [*overrides, f"context.strategy={strategy}"])
    out = plan_gpu.compile_for_gpu(cfg, "h100", 1, 8)
    assert out["mesh"]["context"] == 4 and out["fused_attention"] == []
    assert 0.85 <= out["planned"]["ratio"] <= 1.15, out["planned"]
    rows = {r["key"]: r for r in out["planned"]["collectives"]}
    resolved = resolve_config(cfg, 8)
    (grads,) = [t for t in collective_terms(resolved, "gpu") if t.axes == ("data",) and t.name == "gradients"]
    folded = rows["data,context all-reduce"]
    assert folded["compiled_bytes"] == pytest.approx(ring_bytes("all-reduce", grads.size_bytes, 8), rel=1e-6)
    assert rows["data all-reduce"]["compiled_bytes"] == rows["context all-reduce"]["compiled_bytes"] == 0
    keys = (
        ("context all-gather", "context reduce-scatter")
        if strategy == "all_gather"
        else ("context collective-permute",)
    )
    for key in keys:
        assert rows[key]["compiled_bytes"] == rows[key]["planned_bytes"], rows[key]
