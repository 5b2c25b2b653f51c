"""Proof that each shipped GPU-scale config compiles for the cluster it is sized for and fits its memory.

Each `configs/llama_*.yaml` names its cluster in a header line `# cluster: KIND:NODESxGPUS` (e.g. `h100:8x8`);
its mesh, gradient accumulation and remat are chosen so that the step fits there. `check_config` compiles the
config's real train step for that cluster with XLA's GPU compiler on a machine without GPUs
(`jaxpar.analysis.gpu.deviceless.compile_for_gpu`, which needs the `gpu-compile` extra) and records the per-device peak
beside the plan's. `tools/check_gpu_configs.py` runs it for every shipped config and writes the records to
`configs/gpu_check.json`; the default test suite, which has no CUDA plugin, checks that record against the
current configs and planner (`fingerprint`, the 15% agreement, `fits`) and the "Will it fit?"
table of docs/planning.md (`format_table`), so a config or planner change that is not re-checked fails CI.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re

from jaxpar.config.mesh_axes import CONTEXT, DATA, FSDP, PIPELINE, TENSOR
from jaxpar.config.mla import MLA_KEYS
from jaxpar.config.precision import resolve_compute_dtype
from jaxpar.config.schema import Config, ModelConfig, MoEConfig, OptimizerConfig
from jaxpar.log import GB

CLUSTER_LINE = re.compile(r"^# cluster: (\S+)\s*$", re.MULTILINE)
# The planner's per-device peak must be within this factor of the GPU compiler's for every shipped config.
PLAN_TOLERANCE = 0.15
RECORD_FILE = "gpu_check.json"  # in the configs directory


def documented_cluster(path: str) -> str:
    """The cluster a config file names in its `# cluster: KIND:NODESxGPUS` line.

    Raises:
      ValueError: no such line, or more than one.
    """
    with open(path, encoding="utf-8") as f:
        found = CLUSTER_LINE.findall(f.read())
    if len(found) != 1:
        raise ValueError(
            f"{path}: expected one '# cluster: KIND:NODESxGPUS' line (e.g. '# cluster: h100:8x8'), found {len(found)}"
        )
    return found[0]


# model.rope_scaling and its parameters (every rope_* key but the base, rope_theta): the schema is their one list
ROPE_SCALING_KEYS = tuple(
    f.name for f in dataclasses.fields(ModelConfig) if f.name.startswith("rope_") and f.name != "rope_theta"
)


# model keys newer than the first records, counted only when set (`fingerprint`)
OPTIONAL_MODEL_KEYS = (
    "sliding_window",
    "attention_softcap",
    "final_softcap",
    "attention_scale_width",
    *MLA_KEYS,
)
# model.moe keys that count only away from their defaults (records made before the keys keep their fingerprints)
DEFAULT_MOE_KEYS = (
    "gating",
    "routed_scale",
    "bias_update_rate",
    "expert_groups",
    "group_top_k",
    "receive_factor",
    "all_to_all",
)


def fingerprint(cfg: Config) -> str:
    """sha256 (hex) of what decides the compiled step: the model, mesh, tensor, pipeline, precision and optimizer
    sections and the batch shape (data.seq_len, train.global_batch_size, train.grad_accum_steps) of a resolved
    config. A record whose fingerprint differs from the config's was checked on other settings. `pipeline.recompute`
    counts only with mesh.pipeline > 1 (it decides nothing else), `pipeline.virtual_stages` only when it is not 1
    (plain 1F1B), the `model.rope_scaling*` keys only when rope_scaling is not `none`, `model.moe` only with
    experts, `optimizer.weight_decay_exclude` only when not the default (whose mask the built-in families had before
    the key), `mesh.context` and the `context` section only with mesh.context > 1, `precision.fp8` only when
    enabled, `model.sliding_window`, `attention_softcap`, `final_softcap`, `attention_scale_width` and the MLA keys
    (`kv_lora_rank`, `q_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`) only when set,
    `model.moe.gating`, `routed_scale`, `bias_update_rate`, `expert_groups`, `group_top_k`, `receive_factor` and
    `all_to_all` only away from their defaults, and `model.init_from` (where the weights come from) never; records
    made before those keys existed keep their fingerprints. `precision.compute_dtype` counts as the GPU resolves it
    (`auto` is bfloat16 there: `jaxpar.config.precision.resolve_compute_dtype`)."""
    d = dataclasses.asdict(cfg)
    keep = {k: d[k] for k in ("model", "mesh", "tensor", "pipeline", "precision", "optimizer")}
    # the dtype the GPU step computes in: `auto` and bfloat16 compile the same step there
    keep["precision"]["compute_dtype"] = resolve_compute_dtype(cfg.precision.compute_dtype, "gpu")
    if not cfg.precision.fp8.enabled:
        del keep["precision"]["fp8"]
    rope_scaling = ROPE_SCALING_KEYS if cfg.model.rope_scaling == "none" else ()
    moe_off = ("moe",) if cfg.model.moe.num_experts == 0 else ()
    unset = tuple(k for k in OPTIONAL_MODEL_KEYS if keep["model"][k] is None)
    keep["model"] = {k: v for k, v in keep["model"].items() if k not in ("init_from", *rope_scaling, *moe_off, *unset)}
    if "moe" in keep["model"]:
        at_default = [k for k in DEFAULT_MOE_KEYS if keep["model"]["moe"][k] == getattr(MoEConfig(), k)]
        keep["model"]["moe"] = {k: v for k, v in keep["model"]["moe"].items() if k not in at_default}
    if tuple(cfg.optimizer.weight_decay_exclude) == OptimizerConfig().weight_decay_exclude:  # the mask of before
        keep["optimizer"] = {k: v for k, v in keep["optimizer"].items() if k != "weight_decay_exclude"}
    if cfg.mesh.context == 1:
        keep["mesh"] = {k: v for k, v in keep["mesh"].items() if k != CONTEXT}
    else:
        keep["context"] = d["context"]
    if cfg.mesh.pipeline == 1:
        keep["pipeline"] = {k: v for k, v in keep["pipeline"].items() if k != "recompute"}
    if cfg.pipeline.virtual_stages == 1:
        keep["pipeline"] = {k: v for k, v in keep["pipeline"].items() if k != "virtual_stages"}
    keep["batch"] = {
        "seq_len": cfg.data.seq_len,
        "global_batch_size": cfg.train.global_batch_size,
        "grad_accum_steps": cfg.train.grad_accum_steps,
    }
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()


def resolved_for_cluster(path: str, overrides: tuple[str, ...] = ()) -> tuple[Config, str]:
    """The config at `path` (with `overrides`, `section.key=value`) resolved for its documented cluster's device
    count (`jaxpar.config.resolve_config`), and the cluster name.

    Raises:
      ValueError: no cluster line or an unknown cluster; ConfigError: the config does not fit the cluster's
        device count.
    """
    from jaxpar.analysis.gpu.targets import parse_cluster
    from jaxpar.config import load_config, resolve_config

    name = documented_cluster(path)
    clu = parse_cluster(name)
    return resolve_config(load_config(path, list(overrides), num_devices=clu.devices), clu.devices), clu.name


def planned_peak(cfg: Config) -> int:
    """The planner's per-device peak (`jaxpar.analysis.planner.plan.plan(cfg, "gpu")["memory"]["peak_estimate"]`),
    bytes."""
    from jaxpar.analysis.planner.plan import plan

    return int(plan(cfg, "gpu")["memory"]["peak_estimate"])


def check_config(path: str, name: str | None = None, overrides: tuple[str, ...] = ()) -> dict:
    """Compiles the config at `path` (with `overrides`) for its documented cluster (module docstring) and returns
    its record:
    {"config" (`name`, default the file name), "cluster", "mesh" (axis -> size), "rows_per_microbatch" (per
    device), "microbatches" (`pipeline.microbatches`, per accumulation step), "grad_accum_steps", "remat",
    "fingerprint", "argument_bytes", "temp_bytes", "peak_bytes" (per device, the GPU compiler's),
    "planned_peak_bytes", "ratio" (compiled / planned), "usable_bytes", "fits", "fused_attention",
    "attention_scores_materialised", "jax_version", "compile_seconds"}.

    Raises:
      GpuCompileUnavailable: no CUDA plugin (install the gpu-compile extra); ValueError, ConfigError as
        `resolved_for_cluster`.
    """
    import jax

    from jaxpar.analysis.gpu.deviceless import compile_for_gpu
    from jaxpar.analysis.gpu.targets import parse_cluster

    cfg, cluster = resolved_for_cluster(path, overrides)
    clu = parse_cluster(cluster)
    out = compile_for_gpu(cfg, clu.target.name, clu.nodes, clu.gpus_per_node)
    shape = out["mesh"]
    rows = cfg.train.global_batch_size // (
        shape[DATA] * shape[FSDP] * cfg.train.grad_accum_steps * cfg.pipeline.microbatches
    )
    planned = planned_peak(cfg)
    m = out["memory"]
    return {
        "config": name or os.path.basename(path),
        "cluster": cluster,
        "mesh": shape,
        "rows_per_microbatch": rows,
        "microbatches": cfg.pipeline.microbatches,
        "grad_accum_steps": cfg.train.grad_accum_steps,
        "remat": cfg.model.remat,
        "fingerprint": fingerprint(cfg),
        "argument_bytes": m["argument_bytes"],
        "temp_bytes": m["temp_bytes"],
        "peak_bytes": m["peak_bytes"],
        "planned_peak_bytes": planned,
        "ratio": m["peak_bytes"] / planned,
        "usable_bytes": out["usable_bytes"],
        "fits": out["fits"],
        "fused_attention": out["fused_attention"],
        "attention_scores_materialised": out["attention_scores"]["materialised"],
        "jax_version": jax.__version__,
        "compile_seconds": round(out["compile_seconds"], 1),
    }


def problems(record: dict, path: str) -> list[str]:
    """What is wrong with a stored record for the config at `path` against the current config and planner
    (empty when it still proves the config): another cluster or fingerprint (re-run the check), a peak over
    the usable memory, or a planned peak off by more than `PLAN_TOLERANCE`. Needs no CUDA plugin."""
    cfg, cluster = resolved_for_cluster(path)
    out = []
    if record["cluster"] != cluster or record["fingerprint"] != fingerprint(cfg):
        out.append(
            f"{record['config']}: the record was compiled for other settings (cluster "
            f"{record['cluster']} vs {cluster}, or changed model/mesh/batch keys); re-run "
            f"tools/check_gpu_configs.py with the gpu-compile extra"
        )
    if not record["fits"] or record["peak_bytes"] > record["usable_bytes"]:
        out.append(
            f"{record['config']}: peak {record['peak_bytes']:,} B per device exceeds the usable "
            f"{record['usable_bytes']:,.0f} B of {cluster}"
        )
    ratio = record["peak_bytes"] / planned_peak(cfg)
    if abs(ratio - 1) > PLAN_TOLERANCE:
        out.append(f"{record['config']}: GPU-compiled peak / planned peak = {ratio:.3f}, outside 1 +- {PLAN_TOLERANCE}")
    return out


def _pipelined(record: dict) -> str:
    """The table's note on a pipelined record's microbatches per accumulation step ("" without a pipeline)."""
    m = record.get("microbatches", 1)
    return f" ({m} microbatches in the pipeline)" if record["mesh"][PIPELINE] > 1 else ""


def format_table(records: list[dict], planned: dict[str, int] | None = None) -> str:
    """Markdown table of records: config, cluster, mesh, rows per microbatch x accumulation, remat,
    GPU-compiled peak, planned peak (`planned` overrides the recorded one, by config name), ratio, share of
    the GPU's memory. GB = 1e9 bytes (`jaxpar.log.GB`): the byte columns share one unit and one decimal, unlike
    `jaxpar.log.human_bytes`, so that the table the docs quote lines up and compares as text."""
    lines = [
        (
            "| config | cluster | mesh (data x fsdp x tensor x pipeline x context) | rows per microbatch x "
            "accumulation | remat | GPU-compiled peak | planned peak | compiled / planned | of GPU memory |"
        ),
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in records:
        m = r["mesh"]
        plan_peak = (planned or {}).get(r["config"], r["planned_peak_bytes"])
        memory = r["usable_bytes"] / _memory_fraction()
        mesh = " x ".join(str(m.get(a, 1)) for a in (DATA, FSDP, TENSOR, PIPELINE, CONTEXT))
        lines.append(
            f"| `{r['config']}` | {r['cluster']} | {mesh} | "
            f"{r['rows_per_microbatch']} x {r['grad_accum_steps']}{_pipelined(r)} | {r['remat']} | "
            f"{r['peak_bytes'] / GB:.1f} GB | {plan_peak / GB:.1f} GB | "
            f"{r['peak_bytes'] / plan_peak:.2f} | {r['peak_bytes'] / memory:.0%} |"
        )
    return "\n".join(lines)


def _memory_fraction() -> float:
    from jaxpar.analysis.gpu.targets import MEMORY_FRACTION

    return MEMORY_FRACTION


def load_records(configs_dir: str) -> list[dict]:
    """The records stored in `configs_dir`/`RECORD_FILE` (a JSON list), or [] when there is none."""
    path = os.path.join(configs_dir, RECORD_FILE)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return json.load(f)
