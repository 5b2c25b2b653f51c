"""Every shipped config loads and validates; bad configs raise ConfigError naming the key and the fix."""

import dataclasses
import glob
import math
import os
import re

import pytest
import yaml

from jaxpar.config import Config, ConfigError, check_unique_overrides, load_config, resolve_config, save_config
from jaxpar.config.load import pop_base, read_config_file
from jaxpar.config.mesh_axes import mesh_sizes
from jaxpar.config.mesh_shape import resolve_mesh_shape

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def test_configs_exist():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"tiny.yaml", "llama_125m.yaml", "llama_1b.yaml", "llama_7b.yaml", "llama_70b.yaml"} <= names


def _devices(path: str) -> int:
    """8 simulated devices, or the mesh's own device count for a config that fixes every mesh axis (a cluster-sized
    MoE config such as mixtral_8x7b.yaml, whose experts and pipeline stages need its whole cluster)."""
    sizes = list(mesh_sizes(load_config(path, validate=False).mesh).values())
    return math.prod(sizes) if min(sizes) > 0 else 8


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_config_loads_and_validates(path):
    n = _devices(path)
    cfg = load_config(path, num_devices=n)
    shape = resolve_mesh_shape(cfg, n)
    assert math.prod(shape.values()) == n


def _base_chain(path: str) -> list[str]:
    chain = [os.path.basename(path)]
    while (base := yaml.safe_load(open(path, encoding="utf-8")).get("base")) is not None:
        path = os.path.join(os.path.dirname(path), base)
        chain.append(os.path.basename(path))
    return chain


# the GPU-scale configs: every one built on gpu_base.yaml (llama_*, the published shapes of each family, the MoE ones)
GPU_CONFIGS = [p for p in CONFIGS if "gpu_base.yaml" in _base_chain(p)[1:]]


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=os.path.basename)
def test_gpu_configs_state_every_key_and_do_not_extend_the_cpu_demo(path):
    """A GPU-scale config must not change when the CPU demo (tiny.yaml) or a schema default does: its base
    chain avoids tiny.yaml and states every key of every section."""
    assert "tiny.yaml" not in _base_chain(path)
    stated = read_config_file(path)
    for section in dataclasses.fields(Config):
        names = {f.name for f in dataclasses.fields(getattr(Config(), section.name))}
        missing = sorted(names - set(stated.get(section.name, {})))
        assert not missing, f"{os.path.basename(path)} leaves {section.name}.{missing} to the schema default"


def test_base_chain_and_overrides():
    cfg = load_config(os.path.join(ROOT, "configs", "llama_70b.yaml"), ["train.steps=7", "mesh.fsdp=-1"], num_devices=8)
    assert cfg.model.d_model == 8192 and cfg.model.n_kv_heads == 8  # from llama_70b.yaml
    assert cfg.model.remat == "full"  # from llama_7b.yaml
    assert cfg.data.source == "tokens"  # from gpu_base.yaml
    assert cfg.checkpoint.every_steps == 1000 and cfg.train.steps == 7


def test_a_mapping_override_sets_its_keys_and_keeps_the_sections_others():
    """`model.moe={num_experts: 4}` changes num_experts; tiny_moe.yaml's other moe keys stay (as a file extending a
    base merges), and a scalar override of a whole section is still refused by the schema."""
    cfg = load_config(os.path.join(ROOT, "configs", "tiny_moe.yaml"), ["model.moe={num_experts: 4, top_k: 1}"])
    assert (cfg.model.moe.num_experts, cfg.model.moe.top_k) == (4, 1)
    assert cfg.model.moe.expert_axes == ("data", "fsdp") and cfg.model.moe.d_expert == 128  # kept
    with pytest.raises(ConfigError):
        load_config(os.path.join(ROOT, "configs", "tiny_moe.yaml"), ["model.moe=4"])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(TINY, ["mesh.fsdp=2", "mesh.data=4", "mesh.tensor=1", "optimizer.zero_stage=3"], num_devices=8)
    out = tmp_path / "config.yaml"
    save_config(cfg, str(out))
    assert "base" not in yaml.safe_load(out.read_text())
    assert load_config(str(out), num_devices=8) == cfg


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.hidden=3"], "unknown config key model.hidden"),
        (["trainer.steps=3"], "unknown config key trainer"),
        (["train.steps=ten"], "train.steps: expected an integer"),
        (["optimizer.eps=tiny"], "optimizer.eps: expected a number"),
        (["model.tie_embeddings=3"], "model.tie_embeddings: expected true or false"),
        (["mesh.fsdp=3"], "or change one axis: mesh.fsdp=2 (or mesh.fsdp=-1)"),
        (["mesh.fsdp=-1", "mesh.data=-1"], "only one axis may be -1"),
        (["mesh.data=3", "mesh.fsdp=-1"], "cannot fill 8 devices"),
        (["mesh.data=0"], "mesh.data=0"),
        (
            ["mesh.pipeline=2", "mesh.fsdp=1", "model.n_layers=3"],
            "model.n_layers=3 must be divisible by mesh.pipeline=2",
        ),
        (["pipeline.schedule=zb"], "pipeline.schedule='zb'"),
        (["pipeline.microbatches=0"], "pipeline.microbatches=0 must be > 0"),
        (["pipeline.microbatches=3"], "pipeline.microbatches (3)"),
        (["optimizer.zero_stage=4"], "optimizer.zero_stage=4 must be 0 (DDP), 1, 2 or 3"),
        (["optimizer.zero_stage=-1"], "optimizer.zero_stage=-1"),
        (["model.n_heads=3", "model.n_kv_heads=1"], "model.d_model=128 is not divisible by model.n_heads=3"),
        (["model.n_kv_heads=3"], "model.n_kv_heads=3 must divide model.n_heads=4"),
        (["model.vocab_size=200"], "set model.vocab_size >= 259"),
        (
            ["mesh.tensor=1", "model.d_model=100", "model.n_heads=2", "model.n_kv_heads=1"],
            "must be divisible by mesh.fsdp * mesh.data=8",
        ),
        (["train.global_batch_size=10"], "train.global_batch_size=10 must be divisible"),
        (["train.grad_accum_steps=3"], "train.grad_accum_steps (3)"),
        (["data.source=jsonl"], "data.path is required"),
        (["data.source=web"], "data.source='web' is not one of"),
        (["precision.layout=fp8"], "precision.layout='fp8'"),
        (["model.remat=some"], "model.remat='some'"),
        (["data.validation_fraction=1.5"], "data.validation_fraction"),
        (["optimizer.learning_rate=nan"], "optimizer.learning_rate=nan must be a finite number"),
        (["optimizer.learning_rate=0"], "optimizer.learning_rate=0.0 must be > 0"),
        (["optimizer.eps=-1"], "optimizer.eps=-1.0 must be > 0"),
        (["optimizer.eps=0"], "optimizer.eps=0.0 must be > 0"),
        (["optimizer.eps=nan"], "optimizer.eps=nan must be a finite number"),
        (["optimizer.b2=1.0"], "optimizer.b2=1.0 must lie in [0, 1)"),
        (["optimizer.b1=-0.1"], "optimizer.b1=-0.1 must lie in [0, 1)"),
        (["train.run_dir="], "train.run_dir is empty; name the directory"),
        (["train.run_dir=' '"], "train.run_dir is empty; name the directory"),
        (["model.moe.expert_axes=fsdp"], "model.moe.expert_axes: expected a list of strings, got 'fsdp'"),
        (["model.moe.expert_axes=[1]"], "model.moe.expert_axes[0]: expected a string, got 1"),
        (
            ["model.moe.num_experts=8", "model.moe.expert_axes=[tensor]"],
            "names 'tensor'; experts are split over the axes that split the batch, data and fsdp",
        ),
        (["model.moe.num_experts=8", "model.moe.expert_axes=[fsdp, fsdp]"], "names an axis twice"),
        (
            ["model.moe.num_experts=6", "model.moe.expert_axes=[data, fsdp]"],
            "model.moe.num_experts=6 does not split over model.moe.expert_axes",
        ),
        (["context.strategy=ulysses"], "context.strategy='ulysses' is not one of"),
        (
            ["mesh.context=4", "mesh.tensor=1", "mesh.data=1", "mesh.fsdp=2", "data.seq_len=100"],
            "data.seq_len=100 must be divisible by 2 * mesh.context = 8 (the load-balanced layout's chunks); use "
            "data.seq_len=96 or data.seq_len=104, or a mesh.context that fits it: 2",
        ),
        (
            ["mesh.context=2", "mesh.tensor=4", "mesh.data=1", "mesh.fsdp=1", "model.n_kv_heads=4", "data.seq_len=12"],
            "and by mesh.context * mesh.tensor = 8 (sequence parallelism splits each slice); use data.seq_len=8 or "
            "data.seq_len=16",
        ),
        (
            [
                *("mesh.context=2", "mesh.tensor=1", "mesh.data=1", "mesh.fsdp=1", "mesh.pipeline=4"),
                *("pipeline.schedule=zb-h1", "pipeline.microbatches=4", "context.strategy=ring"),
            ],
            "context.strategy=ring with pipeline.schedule=zb-h1: the zero-bubble schedules run a different op",
        ),
        (
            [
                *("mesh.context=2", "mesh.tensor=1", "mesh.data=1", "mesh.fsdp=4"),
                *("model.moe.num_experts=4", "model.moe.routing=capacity"),
            ],
            "model.moe.routing=capacity with mesh.context=2: capacity routing fills each expert's queue",
        ),
    ],
)
def test_bad_config_names_key_and_fix(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides, num_devices=8)
    assert needle in str(err.value)


@pytest.mark.parametrize("devices", [0, -4])
def test_device_counts_below_one_are_refused(devices):
    """0 used to divide by zero; -4 with mesh.fsdp=-1 used to resolve to a mesh of negative sizes."""
    cfg = load_config(TINY, validate=False)
    for check in (
        lambda: resolve_mesh_shape(cfg, devices),
        lambda: resolve_config(cfg, devices),
        lambda: load_config(TINY, num_devices=devices),
    ):
        with pytest.raises(ConfigError, match=rf"device count {devices}: a mesh needs at least 1 device"):
            check()


def test_repeated_override_key_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"override mesh\.data is given twice \('mesh.data=4' and "
        r"'mesh.data=2'\); keep one of them",
    ):
        check_unique_overrides(["mesh.data=4", "train.steps=3", "mesh.data=2"])
    with pytest.raises(ConfigError, match=r"override train\.steps is given twice"):
        check_unique_overrides(["train.steps=3", " train.steps =4"])
    check_unique_overrides(["mesh.data=4", "mesh.fsdp=2", "train.data=1"])  # the same key in two sections is fine


def test_bad_override_syntax_and_files(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(TINY, ["steps50"], num_devices=8)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"), num_devices=8)
    with pytest.raises(ConfigError, match="is a directory; pass a YAML file"):
        load_config(str(tmp_path), num_devices=8)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00model")
    with pytest.raises(ConfigError, match="not a UTF-8 text file"):
        load_config(str(binary), num_devices=8)
    with pytest.raises(ConfigError, match="jaxpar-train --cpu-devices 4, or JAX_NUM_CPU_DEVICES=4, simulates them"):
        load_config(TINY, num_devices=1)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad), num_devices=8)
    loop = tmp_path / "loop.yaml"
    loop.write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(str(loop), num_devices=8)
    python_tag = tmp_path / "tag.yaml"
    python_tag.write_text("model: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):  # safe_load refuses arbitrary objects
        load_config(str(python_tag), num_devices=8)


def test_exponent_floats_without_dot_parse():
    cfg = load_config(TINY, ["optimizer.eps=1e-3", "optimizer.learning_rate=3e-4"], num_devices=8)
    assert cfg.optimizer.eps == 1e-3 and cfg.optimizer.learning_rate == 3e-4


def test_duplicate_keys_are_refused_naming_key_and_line(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text("model:\n  d_model: 64\n  n_layers: 2\n  d_model: 32\n")
    with pytest.raises(ConfigError, match=r"dup\.yaml, line 4: duplicate key 'd_model' \(first at line 2\)"):
        load_config(str(dup), num_devices=8)
    top = tmp_path / "top.yaml"
    top.write_text(f"base: {TINY}\ntrain:\n  steps: 3\nmodel:\n  n_layers: 2\ntrain:\n  steps: 5\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'train'"):
        load_config(str(top), num_devices=8)
    with pytest.raises(ConfigError, match=r"duplicate key 'a'"):
        load_config(TINY, ["train.run_dir={a: 1, a: 2}"], num_devices=8)
    # A YAML merge key (<<) may be overridden by the mapping's own keys: that is not a duplicate.
    merged = tmp_path / "merged.yaml"
    merged.write_text(f"base: {TINY}\ntrain: {{<<: {{steps: 3, log_every: 1}}, steps: 4}}\n")
    cfg = load_config(str(merged), num_devices=8)
    assert cfg.train.steps == 4 and cfg.train.log_every == 1


@pytest.mark.parametrize("text", ["", "# only a comment\n", "{}\n"])
def test_empty_config_file_is_refused(tmp_path, text):
    empty = tmp_path / "empty.yaml"
    empty.write_text(text)
    with pytest.raises(ConfigError, match=r"empty\.yaml.* no settings.*configs/tiny\.yaml"):
        load_config(str(empty), num_devices=8)


def test_base_names_a_file_relative_to_the_one_that_names_it(tmp_path):
    """`pop_base`, shared by config files and sweep files: the mapping without `base`, and the base's path."""
    top = str(tmp_path / "sub" / "top.yaml")
    assert pop_base({"base": "../tiny.yaml", "train": {"steps": 3}}, top) == (
        {"train": {"steps": 3}},
        str(tmp_path / "tiny.yaml"),
    )
    assert pop_base({"base": TINY}, top) == ({}, TINY)
    assert pop_base({"train": {}}, top) == ({"train": {}}, None)
    for bad in (3, "", ["a.yaml"]):
        with pytest.raises(ConfigError, match="`base` must be a file name"):
            pop_base({"base": bad}, top)
    with pytest.raises(ConfigError, match=r"top level must be a mapping of sections \(model:, mesh:, ...\), got list"):
        pop_base(["a"], top)


def test_empty_base_file_is_refused(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    top = tmp_path / "top.yaml"
    top.write_text("base: empty.yaml\ntrain: {steps: 3}\n")
    with pytest.raises(ConfigError, match=r"empty\.yaml.* no settings"):
        load_config(str(top), num_devices=8)


def test_repeated_resumes_at_one_step_keep_every_previous_config(tmp_path):
    """Two resumes at the same step with changed settings keep both earlier configs (nothing saved is lost)."""
    from jaxpar.config.resume import keep_previous_config

    kept = []
    for text in ("b1: 0.8\n", "b1: 0.7\n", "b1: 0.6\n"):
        (tmp_path / "config.yaml").write_text(text)
        kept.append(keep_previous_config(str(tmp_path), 2))
    assert [os.path.basename(k) for k in kept] == ["config.step2.yaml", "config.step2.1.yaml", "config.step2.2.yaml"]
    assert [(tmp_path / os.path.basename(k)).read_text() for k in kept] == ["b1: 0.8\n", "b1: 0.7\n", "b1: 0.6\n"]


@pytest.mark.parametrize(
    "config, overrides, devices, needed, refused, fill",
    [
        ("llama_7b.yaml", [], 1, "a multiple of 8", "mesh.fsdp=-1 cannot fill", []),  # data=8, fsdp=-1 on 1 device
        ("llama_7b.yaml", [], 12, "a multiple of 8", "mesh.fsdp=-1 cannot fill", []),
        ("mixtral_8x7b.yaml", [], 8, "64", "= 64 but there are 8 devices", ["data"]),  # every axis set: 8x2x1x4
        ("tiny.yaml", ["mesh.data=3", "mesh.fsdp=3", "mesh.tensor=1"], 8, "9", "= 9 but there are 8 devices", []),
    ],
    ids=["fill-1", "fill-12", "fixed-cluster", "fixed-no-single-axis"],
)
def test_mesh_advice_names_what_fits(config, overrides, devices, needed, refused, fill):
    """A mesh that does not cover the devices: the message names the device count the config's mesh needs and
    axis sizes that fit these devices, each of which does fit; -1 alone is offered only for an axis (`fill`) whose
    others divide the device count (never where an axis is -1 already)."""
    cfg = load_config(os.path.join(ROOT, "configs", config), overrides, validate=False)
    with pytest.raises(ConfigError) as err:
        resolve_mesh_shape(cfg, devices)
    message = str(err.value)
    assert refused in message and f"run on {needed} devices (jaxpar-plan --devices {needed.split()[-1]}" in message
    fixes = re.findall(r"(?:e\.g\.|one axis:|or) ((?:mesh\.\w+=-?\d+ ?)+)", message)
    assert fixes, message
    for fix in fixes:
        fixed = load_config(os.path.join(ROOT, "configs", config), [*overrides, *fix.split()], validate=False)
        assert math.prod(resolve_mesh_shape(fixed, devices).values()) == devices, (fix, message)
    assert re.findall(r"\(or mesh\.(\w+)=-1\)", message) == fill, message
