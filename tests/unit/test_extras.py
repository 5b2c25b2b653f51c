"""The optional dependencies stay optional (`jaxpar.config.extras`, pyproject.toml's extras): the default run and the
commands need none of them, and a feature whose extra is missing stops with an error naming the extra.

"Missing" is simulated: a meta-path finder refuses the extras' modules (in a subprocess for the import checks,
so nothing this process already imported counts), and `importlib.util.find_spec` answers None for them.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from jaxpar.config import extras
from jaxpar.config.extras import EXTRAS, MissingExtra

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
EXTRA_MODULES = sorted(m for modules in EXTRAS.values() for m in modules)

# Run first in the subprocess: every later import of an extra's module fails as if it were not installed, and
# the attempt is recorded (a module that catches the ImportError and carries on is still caught).
BLOCKER = """
import importlib.abc, os, sys
BLOCKED = set(os.environ["BLOCKED_MODULES"].split(","))
TRIED = []
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            TRIED.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Block())
"""

# The default run's modules, every command's module and --help, and the default run's pieces that import lazily:
# its config, data (the stdlib source), trackers (metrics.jsonl, TensorBoard), hooks and sample tokenizer.
DEFAULT_PATH = """
import contextlib, io, json, tempfile
import jaxpar, jaxpar.training.loop, jaxpar.training.hooks, jaxpar.data.build, jaxpar.training.sample
from jaxpar.cli import checkpoints, data, launch, plan, sweep, train
for main, argv in [(train.main, ["--help"]), (plan.main, ["--help"]), (sweep.main, ["--help"]),
                   (checkpoints.main, ["--help"]), (data.main, ["tokenize", "--help"]), (launch.main, ["--help"])]:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    assert code in (0, None) and "usage" in out.getvalue(), (main.__module__, code, out.getvalue()[-300:])
import jaxpar
from jaxpar.config import load_config
from jaxpar.data.build import build_loaders
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.hooks import default_hooks
from jaxpar.training.metrics import default_trackers
from jaxpar.training.sample import run_tokenizer
cfg = load_config(TINY, ["data.max_bytes=200000"], num_devices=8)
plan = jaxpar.build_plan(cfg, build_mesh(cfg))
build_loaders(cfg.data, cfg.train.global_batch_size, plan.batch_sharding, cfg.model.vocab_size, 1)
hooks = default_hooks(cfg)
with tempfile.TemporaryDirectory() as d:
    for tracker in default_trackers(d, tensorboard=True, wandb=False):
        tracker.log(1, {"loss": 1.0})
        tracker.close()
run_tokenizer(cfg.data).encode("def ")
print(json.dumps(TRIED))
"""


def _run_blocked(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "BLOCKED_MODULES": ",".join(EXTRA_MODULES),
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": "8",
        "PYTHONPATH": ROOT,
    }
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + f"TINY = {TINY!r}\n" + code],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )


def test_the_default_run_and_the_commands_need_no_extra():
    out = _run_blocked(DEFAULT_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []  # no extra's module was even tried


@pytest.mark.slow  # a real run: one compile of the tiny model, about a minute on 2 cores
def test_the_default_run_trains_without_the_extras(tmp_path):
    run = (
        "from jaxpar.cli.train import main\n"
        f"code = main([TINY, 'train.steps=2', 'train.run_dir={tmp_path / 'run'}', 'data.max_bytes=200000', "
        "'train.eval_every=0', 'checkpoint.every_steps=0', 'train.sample_tokens=4'])\n"
        "assert code in (0, None), code\n"
        "print(json.dumps(TRIED))\n"
    )
    out = _run_blocked("import json\n" + run, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


class _Block(importlib.abc.MetaPathFinder):
    def __init__(self, blocked: set[str]):
        self.blocked = blocked

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


@pytest.fixture
def without(monkeypatch):
    """without(*packages): those packages look uninstalled for the rest of the test."""

    def block(*packages: str) -> None:
        for name in [m for m in sys.modules if m.partition(".")[0] in packages]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setattr(sys, "meta_path", [_Block(set(packages)), *sys.meta_path])
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in packages else real(name, *a))

    return block


def test_every_extra_module_is_in_pyproject():
    """EXTRAS lists each extra with the import names of the packages pyproject.toml puts in it (as installed), and
    the test extra pulls every one of them."""
    import importlib.metadata
    import re

    declared: dict[str, set[str]] = {}
    for requirement in importlib.metadata.requires("jaxpar") or []:
        found = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?[^;]*; extra == \"([a-z0-9-]+)\"", requirement)
        if found:
            declared.setdefault(found.group(3), set()).add(found.group(1) + (found.group(2) or ""))
    for extra, modules in EXTRAS.items():
        assert declared[extra] == set(modules), extra  # each package's import name is its distribution name
    assert f"jaxpar[{','.join(sorted(EXTRAS))}]" in declared["test"]
    assert extras.install_command("data") == "pip install 'jaxpar[data]'"
    assert set(extras.PLUGIN_EXTRAS) <= set(declared) - set(EXTRAS)
    assert extras.install_command("gpu-compile") == "pip install 'jaxpar[gpu-compile]'"


def test_a_missing_extra_is_named(without, tmp_path, capsys):
    from jaxpar.cli import data as data_cli
    from jaxpar.data.text_tokenizer import load_tokenizer
    from jaxpar.data.tokenizer_spec import TokenizerSpec
    from jaxpar.training.trackers import WandbTracker

    without("tokenizers", "sentencepiece", "tiktoken", "pyarrow", "wandb")
    data = "pip install 'jaxpar\\[data\\]'"
    for kind in ("hf", "tiktoken", "sentencepiece"):
        with pytest.raises(MissingExtra, match=rf"kind {kind}\) needs \w+ \(the 'data' extra\).*{data}"):
            load_tokenizer(TokenizerSpec(kind, str(tmp_path / "tokenizer.file")))
    with pytest.raises(MissingExtra, match=r"metrics.wandb=true .* needs wandb .*pip install 'jaxpar\[wandb\]'"):
        WandbTracker(str(tmp_path / "run"), "jaxpar")
    with pytest.raises(MissingExtra, match="the 'data' extra"):
        extras.check("pyarrow.parquet", "Parquet input")

    # The command stops before tokenizing anything, with the message and exit status 2.
    (tmp_path / "doc.txt").write_text("hello\n")
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "rows.parquet").write_bytes(b"PAR1")
    for argv in (
        [str(tmp_path / "doc.txt"), "--tokenizer", f"hf:{tmp_path / 'tokenizer.json'}"],
        [str(tmp_path / "rows.parquet"), "--tokenizer", "byte"],
    ):
        assert data_cli.main(["tokenize", *argv, "--out", str(tmp_path / "out"), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert "pip install 'jaxpar[data]'" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_sweep_without_matplotlib_skips_the_plot_and_says_so(without, tmp_path):
    from jaxpar.analysis.sweep.report import write_plot
    from jaxpar.analysis.sweep.run import load_sweep, run_sweep

    without("matplotlib")
    with pytest.raises(MissingExtra, match=r"plot.png needs matplotlib \(the 'plot' extra\).*jaxpar\[plot\]"):
        write_plot(str(tmp_path / "plot.png"), {}, [])
    path = tmp_path / "sweep.yaml"
    path.write_text(f"base: {TINY}\nmeshes: [{{data: 8}}]\ncompile: false\n")
    said: list[str] = []
    records = run_sweep(load_sweep(str(path)), str(tmp_path / "out"), log=said.append)
    assert [r["status"] for r in records] == ["ok"]
    assert said[0].startswith("plot.png is skipped: ") and "pip install 'jaxpar[plot]'" in said[0]
    assert sorted(os.listdir(tmp_path / "out")) == ["results.json", "results.md"]


def test_require_passes_other_import_errors_through(monkeypatch):
    """A package that is installed but fails on a module of its own is not reported as a missing extra."""
    import importlib

    def broken(name):
        raise ModuleNotFoundError("No module named 'kiwisolver'", name="kiwisolver")

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(ModuleNotFoundError) as e:
        extras.require("matplotlib", "a plot")
    assert not isinstance(e.value, MissingExtra)
    with pytest.raises(KeyError, match="in no extra"):
        extras.require("numpy", "anything")
