"""Trackers (jaxpar.training.trackers): a script's own tracker, TensorBoard off, and Weights & Biases offline with no
network (the `wandb` extra; part of the test extra), resumed into the same W&B run; config checks."""

from __future__ import annotations

import glob
import json
import os
import struct
import sys
import types

import pytest

from jaxpar.config import ConfigError, load_config
from jaxpar.training.metrics import MetricsWriter, default_trackers
from jaxpar.training.trackers import WANDB_ID_FILE, WandbTracker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


class ListTracker:
    def __init__(self):
        self.records, self.closed = [], 0

    def log(self, step, metrics):
        self.records.append((step, metrics))

    def close(self):
        self.closed += 1


def test_a_scripts_own_tracker_gets_python_scalars(tmp_path):
    import numpy as np

    mine = ListTracker()
    w = MetricsWriter(str(tmp_path), trackers=[mine])
    w.write(3, {"loss": np.float32(1.5), "val_loss": None})
    w.close()
    w.close()
    assert mine.records == [(3, {"loss": 1.5, "val_loss": None})] and type(mine.records[0][1]["loss"]) is float
    assert mine.closed == 1 and not os.path.exists(tmp_path / "metrics.jsonl")  # only the trackers given


def test_tensorboard_off(tmp_path):
    w = MetricsWriter(str(tmp_path), trackers=lambda d: default_trackers(d, tensorboard=False))
    w.write(1, {"loss": 2.0})
    w.close()
    assert os.path.exists(tmp_path / "metrics.jsonl") and not os.path.exists(tmp_path / "tensorboard")


def _wandb_history(run_dir) -> list[dict]:
    """The history rows of every offline W&B run under run_dir, read from wandb's own run file (a LevelDB-style
    log of 32 KiB blocks, 7-byte record headers, after a 7-byte ':W&B' file header; each record a protobuf
    `Record`). Written for wandb 0.17-0.31; keys starting with '_' (wandb's own) are dropped."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for path in glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb")):
        data = open(path, "rb").read()
        assert data[:4] == b":W&B"
        pos, buf = 7, b""
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            if left < 7:
                pos += left
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            pos += 7
            if kind == 0 and length == 0:
                break
            buf += data[pos : pos + length]
            pos += length
            if kind in (1, 4):  # a full record, or the last fragment of one
                record = pb.Record()
                record.ParseFromString(buf)
                buf = b""
                if record.WhichOneof("record_type") == "history":
                    items = {
                        i.nested_key[0] if i.nested_key else i.key: json.loads(i.value_json)
                        for i in record.history.item
                    }
                    rows.append({k: v for k, v in items.items() if not k.startswith("_") or k == "_step"})
    return rows


def test_wandb_offline_logs_numbers_and_resumes_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra (in the test extra) is not installed")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = str(tmp_path / "run")
    w = MetricsWriter(
        run_dir,
        trackers=lambda d: default_trackers(d, wandb=True, wandb_mode="offline", config={"train": {"steps": 4}}),
    )
    w.write(1, {"loss": 2.5, "val_loss": None, "mfu": float("nan"), "bad": True})
    w.write(2, {"loss": 2.0, "learning_rate": 1e-3})
    w.close()
    import wandb

    wandb.teardown()  # wandb's service writes the run file lazily; stopping it flushes (process exit does too)
    assert _wandb_history(run_dir) == [{"loss": 2.5, "_step": 1}, {"loss": 2.0, "learning_rate": 1e-3, "_step": 2}]
    # None, NaN and bools are not plotted. A resumed run continues the same W&B run id. (Only the id is checked
    # for the second session: wandb's offline writer may still be flushing the first when a second starts
    # within a second, as here, and leave the second file empty; real resumes are minutes apart.)
    run_id = open(os.path.join(run_dir, WANDB_ID_FILE)).read().strip()
    w = MetricsWriter(run_dir, trackers=lambda d: default_trackers(d, wandb=True, wandb_mode="offline"))
    w.write(3, {"loss": 1.5})
    w.close()
    assert open(os.path.join(run_dir, WANDB_ID_FILE)).read().strip() == run_id
    runs = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*"))
    assert len(runs) == 2 and all(run_id in os.path.basename(r) for r in runs)  # one W&B run, two sessions
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]


class FakeWandb(types.ModuleType):
    """A `wandb` module with no network: `init` records its arguments; each run id's history (the rows W&B holds)
    is kept across sessions, and `resume_from="ID?_step=S"` truncates it to the steps before S, as W&B's rewind
    does. With `refuse_rewind`, init with `resume_from` raises (a W&B service without the rewind feature)."""

    class Error(Exception):
        pass

    def __init__(self, refuse_rewind: bool = False):
        super().__init__("wandb")
        self.inits: list[dict] = []
        self.history: dict[str, list[int]] = {}
        self.refuse_rewind = refuse_rewind

    def init(self, **kwargs):
        self.inits.append(kwargs)
        if "resume_from" in kwargs:
            if self.refuse_rewind:
                raise self.Error("rewind is not enabled for this project")
            run_id, _, step = kwargs["resume_from"].partition("?_step=")
            self.history[run_id] = [s for s in self.history.get(run_id, []) if s < int(step)]
        else:
            run_id = kwargs["id"]
        rows = self.history.setdefault(run_id, [])
        return types.SimpleNamespace(log=lambda data, step: rows.append(step), finish=lambda: None)


@pytest.mark.parametrize(
    "mode, refuse_rewind, resumed_init",
    [
        ("online", False, {"resume_from": "{id}?_step=5"}),
        ("offline", False, {"id": "{id}", "resume": "allow"}),
        ("online", True, {"id": "{id}", "resume": "allow"}),  # after the refused rewind: replayed steps dropped
    ],
    ids=["online-rewinds", "offline-drops", "online-refused-drops"],
)
def test_wandb_resume_at_step_n_logs_each_step_once(tmp_path, monkeypatch, caplog, mode, refuse_rewind, resumed_init):
    """A first attempt logs steps 1-7 and dies; the run resumes from its checkpoint of step 4 (the writer purges
    step 5 and later) and logs 5-8. W&B ends up holding each step once: online by rewinding to step 5, offline
    (or where the rewind is refused) by dropping 5-7, which W&B holds already."""
    fake = FakeWandb(refuse_rewind)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run_dir = str(tmp_path / "run")

    def writer(first_step):
        return MetricsWriter(
            run_dir,
            trackers=lambda d: default_trackers(d, tensorboard=False, wandb=True, wandb_mode=mode, config={"a": 1}),
            first_step=first_step,
        )

    w = writer(0)
    for step in range(1, 8):
        w.write(step, {"loss": 1.0 / step})
    w.close()
    run_id = open(os.path.join(run_dir, WANDB_ID_FILE)).read().strip()
    assert fake.inits == [dict(id=run_id, resume="allow", project="jaxpar", dir=run_dir, config={"a": 1}, mode=mode)]

    w = writer(5)  # resumed from step 4
    for step in range(5, 9):
        w.write(step, {"loss": 1.0 / step})
    w.close()
    want = {k: v.format(id=run_id) for k, v in resumed_init.items()}
    assert fake.inits[-1] == dict(want, project="jaxpar", dir=run_dir, config={"a": 1}, mode=mode)
    assert fake.history[run_id] == list(range(1, 9))  # every step once
    assert len(fake.inits) == (3 if refuse_rewind else 2)
    assert ("W&B refused to rewind run" in caplog.text) == refuse_rewind


def test_wandb_mode_is_checked(tmp_path):
    with pytest.raises(ValueError, match="W&B mode 'offlne' is not one of"):
        WandbTracker(str(tmp_path), "jaxpar", "offlne")
    with pytest.raises(
        ConfigError,
        match=r"metrics.wandb_mode='offlne' is not one of '', offline, online, disabled; did you mean "
        r"metrics.wandb_mode=offline\?",
    ):
        load_config(TINY, ["metrics.wandb_mode=offlne"], num_devices=8)
    with pytest.raises(ConfigError, match="metrics.wandb_project is empty"):
        load_config(TINY, ["metrics.wandb=true", "metrics.wandb_project= "], num_devices=8)


def test_wandb_without_the_extra_is_a_config_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    want = (
        "metrics.wandb=true (Weights & Biases) needs wandb (the 'wandb' extra), which is not installed: "
        "pip install 'jaxpar[wandb]' (or set metrics.wandb=false) (set by the override "
        "`metrics.wandb=true`)"
    )
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["metrics.wandb=true"], num_devices=8)
    assert str(e.value) == want


def test_wandb_online_without_an_api_key_is_a_config_error(monkeypatch, tmp_path):
    """Streaming to W&B needs a key: refused at load, naming the fix, instead of failing after the compile."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for mode in ("online", ""):
        with pytest.raises(ConfigError, match="no API key is configured.*set metrics.wandb_mode=offline"):
            load_config(TINY, ["metrics.wandb=true", f"metrics.wandb_mode={mode}"], num_devices=8)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    load_config(TINY, ["metrics.wandb=true", "metrics.wandb_mode=online"], num_devices=8)  # a key: accepted
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("WANDB_MODE", "offline")
    load_config(TINY, ["metrics.wandb=true", "metrics.wandb_mode="], num_devices=8)  # wandb decides: offline
