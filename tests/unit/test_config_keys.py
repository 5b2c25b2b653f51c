"""Every key of the config tree, found by walking the schema's dataclasses (`jaxpar.config.keys.config_keys`, so a new
key fails `test_the_table_covers_every_key` until it has a row), set in a YAML file to a value of the wrong type, an
out-of-range value, an empty value, and under a near-miss name: each is a ConfigError whose message names the key,
the file and a fix, and the fix works (the example it gives loads). A key that takes every value of its type says so
in the table, and those values load. Then, through `jaxpar-train`'s main: exit 2 before any device work, with a
run directory's files untouched. Pure config loading: no jax device work, no compiles.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import pytest
import yaml

from jaxpar.config import ConfigError, load_config
from jaxpar.config.keys import config_keys, key_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


@dataclass(frozen=True)
class Accepts:
    """A key whose every value of its type is valid at load (`why`); `values` are loaded to show it."""

    why: str
    values: tuple = ()


BOOL = Accepts("every bool", (True, False))
# key -> a value out of its range or choices, or Accepts. The file holds nothing else, so the schema defaults (a
# valid config at 8 devices) surround it: the first failure is the key's own.
OUT_OF_RANGE = {
    "model.name": "gpt 2",
    "model.vocab_size": 0,
    "model.d_model": 0,
    "model.n_layers": 0,
    "model.n_heads": 0,
    "model.n_kv_heads": 0,
    "model.head_dim": -4,
    "model.d_ff": 0,
    "model.rope_theta": 0,
    "model.rope_scaling": "yarn",
    "model.rope_scaling_factor": 0,
    "model.rope_low_freq_factor": -1,
    "model.rope_high_freq_factor": 0,
    "model.rope_original_max_position": 0,
    "model.norm_eps": 0,
    "model.tie_embeddings": BOOL,
    "model.init_std": -0.02,
    "model.remat": "ful",
    "model.attention": "flash",
    "model.max_segments": 0,
    "model.sliding_window": 0,
    "model.attention_softcap": 0,
    "model.final_softcap": -30,
    "model.attention_scale_width": 0,
    "model.kv_lora_rank": 0,
    "model.q_lora_rank": -1,
    "model.qk_nope_head_dim": 0,
    "model.qk_rope_head_dim": 63,
    "model.v_head_dim": 0,
    "model.init_from": Accepts(
        "any path: it is opened when a fresh run starts, before device work (test_cli_paths.py)", ("", "/no/such")
    ),
    "model.moe.num_experts": 1,
    "model.moe.top_k": 0,
    "model.moe.d_expert": -1,
    "model.moe.shared_experts": -1,
    "model.moe.every": 0,
    "model.moe.first_dense": -1,
    "model.moe.routing": "token_choice",
    "model.moe.capacity_factor": 0,
    "model.moe.aux_loss_weight": -0.01,
    "model.moe.z_loss_weight": -0.001,
    "model.moe.expert_axes": ["tensor"],
    "model.moe.gating": "relu",
    "model.moe.routed_scale": 0,
    "model.moe.bias_update_rate": -0.001,
    "model.moe.expert_groups": 0,
    "model.moe.group_top_k": -1,
    "model.moe.receive_factor": -1.0,
    "model.moe.all_to_all": "nccl",
    "mesh.data": 0,
    "mesh.fsdp": -2,
    "mesh.tensor": 0,
    "mesh.pipeline": 0,
    "mesh.context": 0,
    "tensor.sequence_parallel": Accepts("every bool, or null (on when mesh.tensor > 1)", (True, False, None)),
    "context.strategy": "ulysses",
    "pipeline.schedule": "zero_bubble",
    "pipeline.microbatches": 0,
    "pipeline.recompute": BOOL,
    "pipeline.virtual_stages": 0,
    "pipeline.stage_layers": [5, 3],  # needs mesh.pipeline > 1 (the default is 1)
    "pipeline.balance_stages": True,  # likewise
    "pipeline.vocab_parallel": True,  # likewise
    "precision.compute_dtype": "fp8",
    "precision.layout": "fp8",
    "precision.reduce_dtype": "float16",
    "precision.fp8.enabled": BOOL,
    "precision.fp8.scaling": "dynamic",
    "precision.fp8.amax_history": 0,
    "precision.fp8.amax_compute": "mean",
    "precision.fp8.margin": 9,
    "optimizer.learning_rate": 0,
    "optimizer.warmup_steps": -1,
    "optimizer.decay": "cosin",
    "optimizer.min_lr_ratio": 1.5,
    "optimizer.weight_decay": -0.1,
    "optimizer.weight_decay_exclude": [""],  # what a pattern matches is checked against the model's parameter names
    "optimizer.b1": 1.0,
    "optimizer.b2": -0.5,
    "optimizer.eps": 0,
    "optimizer.grad_clip_norm": -1,
    "optimizer.zero_stage": 4,
    "data.source": "web",
    "data.path": Accepts(
        "any path: data.source=stdlib ignores it; the other sources require it and open it when the data is built",
        ("", "/no/such"),
    ),
    "data.validation_path": "/some/shards",  # data.source=shards only
    "data.text_field": Accepts("any non-empty JSONL key or Parquet column", ("body",)),
    "data.token_dtype": "int8",
    "data.seq_len": 0,
    "data.validation_fraction": 1.0,
    "data.max_bytes": -1,
    "data.seed": Accepts("every integer (taken modulo 2**32)", (-1, 2**70)),
    "data.document_masking": BOOL,
    "data.synthetic_branching": -1,
    "data.sources[].name": "web text",
    "data.sources[].weight": 0,
    "data.sources[].source": "web",
    "data.sources[].path": Accepts("any path, as data.path", ("", "/no/such")),
    "data.sources[].validation_path": "/some/shards",
    "data.sources[].text_field": Accepts("any non-empty key, or null for data.text_field", ("body", None)),
    "data.sources[].token_dtype": "int8",
    "data.sources[].validation_fraction": 0,
    "data.sources[].max_bytes": -1,
    "checkpoint.every_steps": -1,
    "checkpoint.keep": 0,
    "checkpoint.async_save": BOOL,
    "checkpoint.restore_from": Accepts(
        "any path: checked where it seeds a run (a resume does not read it), before any device work "
        "(test_train_restore.py)",
        ("/no/such/checkpoint",),
    ),
    "train.run_dir": Accepts(
        "any non-empty path: whether it can be written is checked when the run starts (test_cli_paths.py)",
        ("runs/x", "/no/such/dir"),
    ),
    "train.steps": 0,
    "train.global_batch_size": 0,
    "train.grad_accum_steps": 0,
    "train.seed": 2**64,
    "train.log_every": 0,
    "train.eval_every": -1,
    "train.eval_batches": -1,
    "train.peak_flops_per_device": -1e12,
    "train.peak_fp8_flops_per_device": -1e12,
    "train.progress_bar": BOOL,
    "train.sample_tokens": -1,
    "train.max_bad_steps": 0,
    "train.divergence_rollbacks": -1,
    "train.watchdog_s": -1,
    "metrics.tensorboard": BOOL,
    "metrics.wandb": Accepts("every bool; true needs the wandb extra (test_trackers.py)", (False,)),
    "metrics.wandb_project": Accepts("any non-empty W&B project name", ("my-project",)),
    "metrics.wandb_mode": "web",
    "distributed.coordinator_address": "localhost",
    "distributed.num_processes": -1,
    "distributed.process_id": -2,
    "distributed.auto_detect": BOOL,
    "distributed.initialization_timeout_s": 0,
}
# str keys for which the empty string means something (the others refuse it, as every non-str key does)
EMPTY_MEANS = {
    "model.init_from": "random initialisation from train.seed",
    "data.path": "no path (data.source=stdlib)",
    "data.validation_path": "hold out the end of data.path",
    "data.sources[].path": "no path (data.source=stdlib)",
    "data.sources[].validation_path": "hold out the end of the source's path",
    "checkpoint.restore_from": "start fresh",
    "metrics.wandb_mode": "W&B decides (WANDB_MODE)",
    "distributed.coordinator_address": "from the environment (jaxpar-launch)",
}
WRONG_TYPE = {int: "ten", float: "fast", bool: "maybe", str: 3}
KEYS = [s.key for s in config_keys()]


def _message_key(key: str) -> str:
    return key.replace("[]", "[0]")  # the first entry of a list, as messages name it


def _nested(key: str, value) -> dict:
    """The YAML mapping that sets dotted `key` (an entry of a list: the list of one named entry)."""
    head, sep, rest = key.partition("[].")
    if sep:
        entry = {"name": "web", rest: value} if rest != "name" else {"name": value}
        value = [entry]
    tree = value
    for part in reversed(head.split(".")):
        tree = {part: tree}
    return tree


def _load(path, key: str, value, name: str | None = None):
    """Writes a config file stating only `key` (renamed to `name` for a near miss) = `value`; loads it."""
    if name is not None:
        stem, _, last = key.rpartition(".")
        key = f"{stem}.{name}"
    path.write_text(yaml.safe_dump(_nested(key, value)))
    return load_config(str(path), num_devices=8)


def _refused(path, key: str, value, name: str | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        _load(path, key, value, name)
    message = str(err.value)
    assert f"set in {path}" in message, f"the file is not named: {message}"
    return message


def _assert_fix_works(path, key: str, message: str) -> None:
    """The message names `key` and gives an example (e.g. KEY=V or did you mean KEY=V?); with V the file loads."""
    shown = _message_key(key)
    assert shown in message, f"{shown} is not named: {message}"
    found = re.search(rf"(?:e\.g\.|did you mean) {re.escape(shown)}=(\S+)", message)
    assert found, f"no fix (e.g. {shown}=VALUE): {message}"
    _load(path, key, yaml.safe_load(found.group(1).rstrip("?;,).")))


def _wrong_type(hint):
    simple = [a for a in getattr(hint, "__args__", (hint,)) if a is not type(None)]
    if getattr(hint, "__origin__", None) is tuple:
        return 3
    return WRONG_TYPE[simple[0]]


def test_the_table_covers_every_key():
    assert "model.moe.top_k" in KEYS and "data.sources[].weight" in KEYS and "train.steps" in KEYS
    assert KEYS == list(OUT_OF_RANGE), "give each key of the schema a row, in schema order"
    strings = {s.key for s in config_keys() if s.hint in (str, str | None)}
    assert set(EMPTY_MEANS) <= strings


@pytest.mark.parametrize("key", KEYS)
def test_every_key_refuses_bad_values_naming_key_file_and_fix(key, tmp_path):
    spec = key_spec(key)
    path = tmp_path / "run.yaml"
    _assert_fix_works(path, key, _refused(path, key, _wrong_type(spec.hint)))  # wrong type

    bad = OUT_OF_RANGE[key]  # out of range, or every value accepted
    if isinstance(bad, Accepts):
        for value in bad.values:
            _load(path, key, value)
    else:
        _assert_fix_works(path, key, _refused(path, key, bad))

    if key in EMPTY_MEANS:  # empty
        _load(path, key, "")
    else:
        _assert_fix_works(path, key, _refused(path, key, ""))

    name = key.rpartition(".")[2]  # a near miss: the middle letter doubled
    typo = name[: len(name) // 2] + name[len(name) // 2 :][:1] + name[len(name) // 2 :]
    message = _refused(path, key, spec.default, typo)
    assert f"unknown config key {_message_key(key).rpartition('.')[0]}.{typo}" in message, message
    assert f"did you mean {_message_key(key)}?" in message, message


def _snapshot(directory) -> dict:
    """Every path under `directory` with its bytes and modification time (directories: None)."""
    out = {}
    for d, dirs, files in os.walk(directory):
        for name in dirs:
            out[os.path.relpath(os.path.join(d, name), directory)] = None
        for name in files:
            path = os.path.join(d, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = (f.read(), os.stat(path).st_mtime_ns)
    return out


@pytest.mark.parametrize(
    "in_file, override, needles",
    [
        ("optimizer: {learnig_rate: 0.1}", None, ["did you mean optimizer.learning_rate?", "set in {file}"]),
        ("", "train.steps=ten", ["train.steps: expected an integer", "e.g. train.steps=200", "override `train.steps"]),
        ("optimizer: {b2: 1.0}", None, ["optimizer.b2=1.0 must lie in [0, 1); e.g. optimizer.b2=0.95", "in {file}"]),
        ("mesh: {pipeline: 2}", "model.n_layers=3", ["model.n_layers=3 must be divisible by mesh.pipeline=2"]),
    ],
    ids=["unknown-key", "type", "range", "cross-field"],
)
def test_train_exits_2_before_device_work_with_the_run_dir_unchanged(
    in_file, override, needles, tmp_path, monkeypatch, capsys
):
    """jaxpar-train on a bad config (in a file extending tiny.yaml, or an override) exits 2 with one line naming the
    key, where it was set and the fix, before any device work (the mesh is never built), leaving an existing run
    directory's files as they were."""
    from jaxpar.cli import train as train_cli
    from jaxpar.training import loop

    def no_device_work(cfg):
        raise AssertionError("the mesh was built before the config error")

    monkeypatch.setattr(loop, "build_mesh", no_device_work)
    run = tmp_path / "run"
    (run / "checkpoints" / "100").mkdir(parents=True)
    (run / "checkpoints" / "100" / "state").write_bytes(b"\x00" * 64)
    (run / "metrics.jsonl").write_text('{"step": 100, "loss": 2.5}\n')
    (run / "config.yaml").write_text(yaml.safe_dump(load_config(TINY, num_devices=8).to_dict()))
    before = _snapshot(run)
    config = tmp_path / "mine.yaml"
    config.write_text(f"base: {TINY}\n{in_file}\n")
    argv = [str(config), f"train.run_dir={run}", "--cpu-devices", "8", *([override] if override else [])]
    assert train_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("jaxpar-train: config error: "), err
    for needle in needles:
        assert needle.format(file=config) in err, err
    assert _snapshot(run) == before
