"""Every shipped GPU-scale config is proven to compile for its documented cluster and fit (jaxpar.analysis.gpu.check).

The compile needs jax's CUDA plugin (the gpu-compile extra), which CI does not install (about 2.7 GB):
`tools/check_gpu_configs.py` compiles each config with it and stores the records in configs/gpu_check.json.
Without the plugin these tests check that record against the current configs (fingerprint), the current planner
(within 15%) and the table of docs/planning.md ("Will it fit?"), so an unchecked change to a config or to the
planner fails here. Where the plugin is installed, one small config is compiled for two H100 nodes and one shipped
config recompiled.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os

import pytest

from jaxpar.analysis.gpu import check as gpu_check
from jaxpar.analysis.gpu.targets import parse_cluster
from jaxpar.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")
_spec = importlib.util.spec_from_file_location("check_gpu_configs", os.path.join(ROOT, "tools", "check_gpu_configs.py"))
_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tool)
GPU_CONFIGS = _tool.checked_configs()  # the configs the tool records (its CHECKED patterns)
RECORDS = {r["config"]: r for r in gpu_check.load_records(CONFIGS)}


def test_every_gpu_config_names_a_cluster_it_resolves_on():
    assert GPU_CONFIGS
    for path in GPU_CONFIGS:
        clu = parse_cluster(gpu_check.documented_cluster(path))
        load_config(path, num_devices=clu.devices)  # mesh and batch divide the cluster's device count


def test_a_config_without_or_with_two_cluster_lines_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("# cluster: h100:1x8\n# cluster: h100:2x8\nbase: x.yaml\n")
    with pytest.raises(ValueError, match="expected one '# cluster: KIND:NODESxGPUS' line.*found 2"):
        gpu_check.documented_cluster(str(path))
    path.write_text("base: x.yaml\n")
    with pytest.raises(ValueError, match="found 0"):
        gpu_check.documented_cluster(str(path))


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=os.path.basename)
def test_record_proves_the_current_config(path):
    """The stored GPU compile is of this config's current settings, fits the GPU's usable memory, and the
    current planner's peak is within 15% of it."""
    name = os.path.basename(path)
    assert name in RECORDS, f"no record for {name}: run tools/check_gpu_configs.py with the gpu-compile extra"
    rec = RECORDS[name]
    assert gpu_check.problems(rec, path) == []
    assert rec["fits"] and rec["peak_bytes"] <= rec["usable_bytes"]
    assert rec["argument_bytes"] < rec["peak_bytes"]
    # attention either runs fused or writes its scores (the detector must see one of them, GQA included)
    assert rec["attention_scores_materialised"] != bool(rec["fused_attention"])


def test_records_are_only_of_shipped_configs():
    assert sorted(RECORDS) == sorted(os.path.basename(p) for p in GPU_CONFIGS)


def test_stale_or_off_record_is_reported():
    """`problems` catches a record of other settings, one that does not fit, and a plan off by > 15%."""
    path = os.path.join(CONFIGS, "llama_7b.yaml")
    rec = dict(RECORDS["llama_7b.yaml"])
    assert gpu_check.problems({**rec, "fingerprint": "0" * 64}, path)[0].startswith(
        "llama_7b.yaml: the record was compiled for other settings"
    )
    assert "exceeds the usable" in gpu_check.problems({**rec, "fits": False}, path)[0]
    off = gpu_check.problems({**rec, "peak_bytes": int(rec["planned_peak_bytes"] * 1.2)}, path)
    assert len(off) == 1 and "outside 1 +- 0.15" in off[0]


def test_the_tool_remakes_only_the_named_records(tmp_path, monkeypatch, capsys):
    """`tools/check_gpu_configs.py NAME...` compiles only the named configs: a new record goes in at its model's
    size (smallest first), a re-made one keeps its place, every other record stays; a name outside CHECKED is
    refused (exit 2) before any compile."""
    import shutil

    from jaxpar.analysis.gpu import deviceless

    shutil.copytree(CONFIGS, tmp_path / "configs")
    kept = [r for r in RECORDS.values() if r["config"] != "qwen3_8b.yaml"]  # qwen3_8b.yaml not yet recorded
    (tmp_path / "configs" / gpu_check.RECORD_FILE).write_text(json.dumps(kept))
    monkeypatch.setattr(_tool, "ROOT", str(tmp_path))
    monkeypatch.setattr(deviceless, "unavailable_reason", lambda: None)
    compiled = []

    def check_config(path):  # stands in for the GPU compile: the stored record, marked
        compiled.append(os.path.basename(path))
        return {**RECORDS[os.path.basename(path)], "compile_seconds": -1.0}

    monkeypatch.setattr(gpu_check, "check_config", check_config)
    monkeypatch.setattr(gpu_check, "problems", lambda record, path: [])
    assert _tool.main(["qwen3_8b.yaml", "llama_70b_zbv.yaml"]) == 0
    written = gpu_check.load_records(str(tmp_path / "configs"))
    assert sorted(compiled) == ["llama_70b_zbv.yaml", "qwen3_8b.yaml"]
    assert [r["config"] for r in written] == list(RECORDS)
    assert {r["config"] for r in written if r["compile_seconds"] == -1.0} == set(compiled)
    assert _tool.main(["tiny_moe.yaml"]) == 2 and "not among the checked configs" in capsys.readouterr().err


def test_fingerprint_follows_what_the_step_compiles():
    base = load_config(os.path.join(CONFIGS, "llama_7b.yaml"), num_devices=64)
    same = load_config(
        os.path.join(CONFIGS, "llama_7b.yaml"), ["train.run_dir=elsewhere", "train.steps=5"], num_devices=64
    )
    other = load_config(os.path.join(CONFIGS, "llama_7b.yaml"), ["train.grad_accum_steps=2"], num_devices=64)
    assert gpu_check.fingerprint(base) == gpu_check.fingerprint(same) != gpu_check.fingerprint(other)
    # the weights' origin and the parameters of a rope scaling that is off decide nothing; a scaling that is on does
    idle = ["model.init_from=tests/fixtures/hf_llama_untied", "model.rope_scaling_factor=8"]
    assert gpu_check.fingerprint(load_config(os.path.join(CONFIGS, "llama_7b.yaml"), idle, num_devices=64)) == (
        gpu_check.fingerprint(base)
    )
    no_experts = load_config(os.path.join(CONFIGS, "llama_7b.yaml"), ["model.moe.top_k=1"], num_devices=64)
    assert gpu_check.fingerprint(no_experts) == gpu_check.fingerprint(base)  # model.moe is off: decides nothing
    scaled = ["model.rope_scaling=llama3", "model.rope_scaling_factor=8"]
    assert gpu_check.fingerprint(load_config(os.path.join(CONFIGS, "llama_7b.yaml"), scaled, num_devices=64)) != (
        gpu_check.fingerprint(base)
    )


def test_docs_table_is_the_records_with_the_current_plan():
    """The "Will it fit?" table of docs/planning.md is `format_table` of the stored records, planned by today's code."""
    records = [RECORDS[os.path.basename(p)] for p in GPU_CONFIGS]
    records.sort(key=lambda r: list(RECORDS).index(r["config"]))  # the order of the file (smallest first)
    planned = {os.path.basename(p): gpu_check.planned_peak(gpu_check.resolved_for_cluster(p)[0]) for p in GPU_CONFIGS}
    table = gpu_check.format_table(records, planned)
    with open(os.path.join(ROOT, "docs", "planning.md"), encoding="utf-8") as f:
        page = f.read()
    assert table in page, "docs/planning.md's table differs from configs/gpu_check.json; paste:\n" + table


@pytest.mark.requires_gpu_compile
def test_small_config_on_two_h100_nodes_is_planned_within_15_percent(tmp_path):
    """llama_125m on 2 nodes of 8 H100s (data=16, 8 sequences of 2048 per GPU): the GPU compiler's peak and the
    plan agree within 15%, and it fits."""
    from jaxpar.analysis.gpu.deviceless import compile_for_gpu

    cfg = load_config(os.path.join(CONFIGS, "llama_125m.yaml"), ["train.global_batch_size=512"], num_devices=16)
    out = compile_for_gpu(cfg, "h100", 2, 8)
    assert out["mesh"] == {"data": 16, "pipeline": 1, "fsdp": 1, "context": 1, "tensor": 1} and out["fits"]
    assert abs(out["planned"]["ratio"] - 1) <= gpu_check.PLAN_TOLERANCE, out["planned"]["ratio"]
    # model.attention auto with bf16 on H100s: cuDNN's fused kernel, no score tensors in memory
    assert out["fused_attention"] and not out["attention_scores"]["materialised"]


@pytest.mark.requires_gpu_compile
def test_recompiling_a_shipped_config_reproduces_its_record():
    """The record is what the compiler gives: llama_7b compiled again has the recorded peak (same jax)."""
    import jax

    rec = RECORDS["llama_7b.yaml"]
    got = gpu_check.check_config(os.path.join(CONFIGS, "llama_7b.yaml"))
    assert got["fingerprint"] == rec["fingerprint"] and got["fits"]
    if jax.__version__ == rec["jax_version"]:
        assert (got["argument_bytes"], got["peak_bytes"]) == (rec["argument_bytes"], rec["peak_bytes"])
    assert abs(got["ratio"] - 1) <= gpu_check.PLAN_TOLERANCE


def test_documented_cluster_commands_run_a_checked_step():
    """Each `sbatch --nodes=N tools/slurm_gpu.sbatch CONFIG OVERRIDES` of README.md and docs/ runs the step that
    was compiled for the config's cluster: the same GPU count and the same fingerprint (mesh, batch, model)."""
    import re

    from jaxpar.config import resolve_config

    commands = []
    for page in ["README.md", *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            commands += re.findall(r"^sbatch --nodes=(\d+) tools/slurm_gpu\.sbatch (\S+)(.*)$", f.read(), re.MULTILINE)
    with open(os.path.join(ROOT, "tools", "slurm_gpu.sbatch"), encoding="utf-8") as f:
        per_node = int(re.search(r"^#SBATCH --gpus-per-node=(\d+)$", f.read(), re.MULTILINE).group(1))
    assert commands
    for nodes, config, overrides in commands:
        rec = RECORDS[os.path.basename(config)]
        devices = int(nodes) * per_node
        assert devices == parse_cluster(rec["cluster"]).devices, (config, rec["cluster"])
        cfg = resolve_config(load_config(os.path.join(ROOT, config), overrides.split(), num_devices=devices), devices)
        assert gpu_check.fingerprint(cfg) == rec["fingerprint"], f"{config}{overrides}: not the checked step"
