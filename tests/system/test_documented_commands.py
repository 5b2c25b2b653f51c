"""Every command line the repository documents works as written (tests/doc_commands.py says where they are found).

Default suite, in this process, nothing compiled (seconds). Each `&&`-part of a command:
  * names a program of this repository: a console script of pyproject.toml, `python FILE` of a repository file,
    `python -m pytest` (its -m markers registered), `pip install` and `python3 -m venv` (the extras exist), or
    `sbatch` of a repository script whose last line runs jaxpar-train "$@"; or a program of EXTERNAL, with the
    reason it is not checked;
  * parses with the program's own argparse parser, flags spelled out (a typo'd or abbreviated flag fails). A
    usage synopsis (CONFIG, N, [--flag X], key=value ...) only has its flags checked;
  * reads only what exists: its config loads with its overrides, and a path under runs/ is made by another
    documented command (a jaxpar-train's train.run_dir, an --out or --run-dir);
  * is planned rather than run: jaxpar-train (also under jaxpar-launch and sbatch) is validated at its device
    count (--cpu-devices N, jaxpar-launch's processes x devices per process, sbatch's nodes x GPUs per node,
    else 1: a fresh machine has one CPU device) and planned (`jaxpar.analysis.planner.plan.plan`); jaxpar-plan runs
    as written with its compile flags dropped (COMPILE_FLAGS); jaxpar-sweep plans every point
    (`jaxpar.analysis.sweep.run.run_point` without compiling); tools/resolve_config.py runs as written.
Every script of examples/, benchmarks/ and tools/ is a test: ELSEWHERE names the test that runs it (each exists
and names the script), HERE runs the others, reduced (tools/train_bpe.py in the default suite, the benchmarks slow).

Slow (`-m slow`): README.md's two commands run for real after their install parts (the environment running the
tests is the install), in a fresh directory that looks like the repository, with a .venv/bin of this environment
first on PATH: the main job for two steps (TRAIN_APPEND), printing what the README says it prints, and the test
command collecting the suite (it cannot run itself inside itself).
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import dataclasses
import functools
import glob
import importlib
import io
import os
import re
import runpy
import shlex
import stat
import subprocess
import sys
from unittest import mock

import pytest
from doc_commands import ROOT, Command, Part, extract, pyproject_section

CONSOLE_SCRIPTS = {k: ast.literal_eval(v) for k, v in pyproject_section("project.scripts").items()}
EXTRAS = set(pyproject_section("project.optional-dependencies"))
MARKERS = {m.split(":")[0] for m in ast.literal_eval(pyproject_section("tool.pytest.ini_options")["markers"])}
EXTERNAL = {
    "tensorboard": "a viewer, not a jaxpar dependency; tests/unit/test_metrics.py checks the event files it reads",
}
RUN_AS_WRITTEN = {"tools/resolve_config.py"}  # resolves a config and prints it: nothing to plan instead
COMPILE_FLAGS = {"--compile": 0, "--fast-compile": 0, "--real-devices": 0, "--measure-steps": 1}  # flag: values
TRAIN_APPEND = ["train.steps=2", "train.eval_batches=1", "train.sample_tokens=8", "train.progress_bar=false"]
COLLECT_ONLY = ["--collect-only", "-q", "-p", "no:cacheprovider"]

# Each script and the test that runs it. A test file must name the script it runs.
ELSEWHERE = {
    "examples/custom_loss_optimizer.py": (
        "tests/parity/test_custom_optimizer.py::test_example_script_trains_with_its_own_loss_and_optimizer"
    ),
    "examples/gpt2.py": "tests/parity/test_own_model.py::test_gpt2_step_equals_one_device",  # a module, imported
    "examples/own_data.py": "tests/system/test_train_data.py::test_example_script_resumes_its_own_data_exactly",
    "examples/own_model.py": (
        "tests/parity/test_own_model.py::test_own_model_script_resumes_bitwise_and_runs_unchanged_on_two_processes"
    ),
    "benchmarks/all.py": "tests/system/test_benchmarks.py::test_quick_mode_prints_every_ratio",
    "benchmarks/data_rss.py": "tests/system/test_benchmarks.py::test_data_rss_benchmark_prints_the_ratio",
    "benchmarks/gpu_acceptance.py": (
        "tests/system/test_gpu_acceptance.py::test_cpu_smoke_runs_every_part_and_the_loss_falls"
    ),
    # a loop over jaxpar.analysis.gpu.check.check_config, which needs the gpu-compile extra; where it is installed
    # this test recompiles a shipped config with it, and the default suite checks the record the script writes
    "tools/check_gpu_configs.py": (
        "tests/unit/test_gpu_check.py::test_recompiling_a_shipped_config_reproduces_its_record"
    ),
    "tools/compare_losses.py": "tests/system/test_golden_losses.py::test_compare_losses_finds_head_equal_to_itself",
    # its `run`, through compare_losses.py; `write` (about 2 minutes) made the table that test_golden_table checks
    "tools/golden_losses.py": "tests/system/test_golden_losses.py::test_compare_losses_finds_head_equal_to_itself",
    # a few minutes per instruction set: the test runs it on a stand-in for jaxpar-train
    "tools/loss_range.py": (
        "tests/unit/test_loss_range.py::test_each_instruction_set_is_one_run_and_the_range_is_printed"
    ),
    "tools/resolve_config.py": "tests/unit/test_cli_args.py::test_resolve_config_refuses_device_counts_below_one",
    "tools/test_times.py": (
        "tests/unit/test_test_times.py::test_rows_per_file_with_compile_seconds_and_the_files_over_budget"
    ),
}
HERE = {  # script: reduced arguments (one timed step and round, the smallest grid), run by test_script_runs
    "benchmarks/context.py": ["--contexts", "1", "2", "--seq-len", "64", "--steps", "1", "--rounds", "1"],
    "benchmarks/hf_load_memory.py": [
        "--small",
        "--processes",
        "2",
        "--cases",
        "lazy",
        "import",
        "export",
        "--dir",
        "{tmp}",
    ],
    "benchmarks/fp8_loss.py": ["--steps", "2", "--seeds", "1", "2", "--log-every", "1", "--out", "{tmp}/fp8_loss"],
    "benchmarks/overhead.py": ["--steps", "1", "--rounds", "1"],
    "benchmarks/pipeline.py": ["--stages", "2", "--microbatches", "4", "--steps", "1", "--rounds", "1"],
    "benchmarks/tensor_collectives.py": ["--steps", "1", "--rounds", "1"],
    "benchmarks/tensor_bytes.py": ["--remat", "none", "--layouts", "data=2 x tensor=4 SP"],  # 2 of 24 compiles
    "tools/train_bpe.py": ["jaxpar/training/*.py", "--vocab-size", "300", "--out", "{tmp}/bpe.json"],
}
FAST_SCRIPTS = {"tools/train_bpe.py"}  # the others compile: slow

COMMANDS = extract()
IDS = [c.text if len(c.text) <= 90 else c.text[:87] + "..." for c in COMMANDS]


# ---- running a program's own main in this process ----------------------------------------------------------------


class _Parsed(BaseException):  # BaseException: passes through the programs' `except Exception`
    def __init__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace | None):
        super().__init__()
        self.parser, self.namespace = parser, namespace


@contextlib.contextmanager
def _stop_at_parsing(parse: bool):
    """The program's first parse raises _Parsed (its parser and, when `parse`, the namespace) instead of running."""

    def wrap(original):
        def method(self, args=None, namespace=None):
            raise _Parsed(self, original(self, args, namespace) if parse else None)

        return method

    with mock.patch.multiple(
        argparse.ArgumentParser,
        parse_args=wrap(argparse.ArgumentParser.parse_args),
        parse_intermixed_args=wrap(argparse.ArgumentParser.parse_intermixed_args),
    ):
        yield


def _main(part: Part) -> tuple[int, str]:
    """Runs the part's program (console script or repository script) in this process from the repository root;
    returns its exit status and what it wrote to stderr (stdout is dropped). The environment and sys.argv are
    restored afterwards."""
    old_cwd, old_argv, err = os.getcwd(), sys.argv, io.StringIO()
    os.chdir(ROOT)
    try:
        with mock.patch.dict(os.environ), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            if part.program in CONSOLE_SCRIPTS:
                module, func = CONSOLE_SCRIPTS[part.program].split(":")
                sys.argv = [part.program, *part.args]
                return int(getattr(importlib.import_module(module), func)(list(part.args)) or 0), err.getvalue()
            assert part.script, f"{part.text}: not a program of this repository"
            sys.argv = list(part.args)
            runpy.run_path(os.path.join(ROOT, part.script), run_name="__main__")
            return 0, err.getvalue()
    except SystemExit as e:
        return (e.code if isinstance(e.code, int) else (0 if e.code is None else 1)), err.getvalue()
    finally:
        os.chdir(old_cwd)
        sys.argv = old_argv


def _runs(part: Part) -> None:
    status, err = _main(part)
    assert status == 0, f"{part.text}: exit status {status}: {err[-2000:]}"


def _parse(part: Part, parse: bool = True) -> _Parsed:
    """The parser and namespace the part's program builds from its arguments (nothing else runs)."""
    if part.program.startswith("jaxpar-"):
        assert part.program in CONSOLE_SCRIPTS, f"{part.program}: not a console script ({', '.join(CONSOLE_SCRIPTS)})"
    elif part.script:
        assert os.path.isfile(os.path.join(ROOT, part.script)), f"{part.script} does not exist"
    else:
        raise AssertionError(f"{part.text}: unknown program; if it is not jaxpar's, add it to EXTERNAL with the reason")
    with _stop_at_parsing(parse):
        try:
            status, err = _main(part)
        except _Parsed as parsed:
            if parse:
                flags = [w.split("=", 1)[0] for w in part.args if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", w)]
                flags = flags[: flags.index("--")] if "--" in flags else flags
                unknown = [f for f in flags if f not in parsed.parser._option_string_actions]
                assert not unknown, f"{part.text}: {parsed.parser.prog} has no option {unknown} (spell flags out)"
            return parsed
    raise AssertionError(f"{part.text}: exited {status} while parsing its arguments: {err[-2000:]}")


# ---- what commands make and read --------------------------------------------------------------------------------


def _launched(part: Part) -> tuple[Part, Part | None]:
    """jaxpar-launch's own part and the part it launches (after `--`); other parts: (part, None)."""
    if part.program != "jaxpar-launch" or "--" not in part.args:
        return part, None
    cut = part.args.index("--")
    own = dataclasses.replace(part, args=part.args[:cut])
    return own, Command(shlex.join(part.args[cut + 1 :]), []).parts[0]


@functools.cache
def _made() -> dict[str, tuple[str, tuple[str, ...]] | None]:
    """Each directory under runs/ a documented command makes: a jaxpar-train's run_dir -> (config, overrides),
    an --out or --run-dir -> None."""
    from jaxpar.config import load_config

    made = {}
    for cmd in COMMANDS:
        if cmd.is_synopsis:
            continue
        for part in cmd.parts:
            part = _launched(part)[1] or part
            try:
                parsed = _parse(part)
            except (AssertionError, ValueError):
                continue  # not a program with a parser; a broken one fails its own test
            ns = parsed.namespace
            for key in ("out", "run_dir"):
                if isinstance(value := getattr(ns, key, None), str):
                    made[os.path.normpath(value)] = None
            if parsed.parser.prog == "jaxpar-train" and ns.config and not ns.config.startswith("runs/"):
                with contextlib.suppress(Exception):  # noqa: BLE001 -- a broken producer fails its own test
                    run_dir = load_config(os.path.join(ROOT, ns.config), ns.overrides, validate=False).train.run_dir
                    made[os.path.normpath(run_dir)] = (ns.config, tuple(ns.overrides))
    return made


def _maker(path: str) -> str:
    """The made directory that holds `path` (under runs/); fails naming the directories made."""
    path = os.path.normpath(path)
    for made in _made():
        if path == made or path.startswith(made + os.sep):
            return made
    raise AssertionError(f"{path} is read, but no documented command makes it (made: {sorted(_made())})")


def _check_reads(ns: argparse.Namespace) -> None:
    """A path the command reads exists in the repository, or (under runs/) is made by a documented command."""
    for key in ("config", "restore_from", "path", "hf_dir", "tokenizer"):
        value = getattr(ns, key, None)
        if not isinstance(value, str) or (key == "tokenizer" and not value.startswith("runs/")):
            continue
        if value.startswith("runs/"):
            _maker(value)
        else:
            assert os.path.exists(os.path.join(ROOT, value)), f"{value} does not exist"


def _run_paths(cfg) -> list[str]:
    """Paths under runs/ a training config reads: data, validation data, weights to start from, a checkpoint."""
    paths = [cfg.data.path, cfg.data.validation_path, cfg.model.init_from, cfg.checkpoint.restore_from]
    paths += [p for s in cfg.data.sources for p in (s.path, s.validation_path)]
    return [p for p in paths if isinstance(p, str) and p.startswith("runs/")]


# ---- the checks -------------------------------------------------------------------------------------------------


def _import_once(spec: str) -> None:
    """jaxpar-train --import FILE.py: a model family it registers (registering a name twice is refused)."""
    from jaxpar.cli.train import import_module_or_file

    if os.path.splitext(os.path.basename(spec))[0] not in sys.modules:
        import_module_or_file(os.path.join(ROOT, spec) if spec.endswith(".py") else spec)


def _plan_train(ns: argparse.Namespace, devices: int, platform: str) -> None:
    from jaxpar.analysis.planner.plan import plan
    from jaxpar.config import load_config, resolve_config

    for spec in ns.imports:
        _import_once(spec)
    config, overrides = ns.config, list(ns.overrides)
    if config.startswith("runs/"):  # a run's saved config: its maker's config with these overrides
        made = _made()[_maker(config)]
        assert made, f"{config}: made by a command that writes no config"
        config, overrides = made[0], [*made[1], *overrides]
    assert os.path.isfile(os.path.join(ROOT, config)), f"config {config} does not exist"
    cfg = load_config(os.path.join(ROOT, config), overrides, validate=True, num_devices=devices)
    for path in _run_paths(cfg):
        _maker(path)
    assert plan(resolve_config(cfg, devices), platform)["memory"]["peak_estimate"] > 0


@functools.cache
def _plan_sweep(path: str) -> None:
    """Every point of the sweep file planned, none compiled (a sweep shown twice is planned once)."""
    from jaxpar.analysis.sweep.run import load_sweep, points, run_point

    sweep = dataclasses.replace(load_sweep(os.path.join(ROOT, path)), compile=False, measure_steps=0)
    statuses = collections.Counter(run_point(sweep, point)["status"] for point in points(sweep))
    assert statuses["ok"] and not statuses["failed"], f"{path}: {dict(statuses)}"


def _without_compile_flags(args: tuple[str, ...]) -> tuple[str, ...]:
    out, skip = [], 0
    for word in args:
        if skip:
            skip -= 1
        elif word.split("=", 1)[0] in COMPILE_FLAGS:
            skip = 0 if "=" in word else COMPILE_FLAGS[word]
        else:
            out.append(word)
    return tuple(out)


def _check_sbatch(part: Part) -> None:
    """`sbatch [--nodes=N | -N N] SCRIPT ARGS`: N x the script's GPUs per node, ARGS planned as jaxpar-train's."""
    nodes, i = None, 0
    while i < len(part.args) and part.args[i].startswith("-"):
        if part.args[i].startswith("--nodes="):
            nodes = part.args[i].split("=", 1)[1]
        elif part.args[i] in ("-N", "--nodes"):
            nodes, i = part.args[i + 1], i + 1
        i += 1
    assert nodes is not None and nodes.isdigit(), f"{part.text}: give --nodes=N (a number)"
    with open(os.path.join(ROOT, part.args[i]), encoding="utf-8") as f:
        text = f.read()
    gpus = re.search(r"^#SBATCH\s+--gpus-per-node=(\d+)\s*$", text, re.M)
    tasks = re.search(r"^#SBATCH\s+--ntasks-per-node=(\d+)\s*$", text, re.M)
    assert gpus and tasks and gpus.group(1) == tasks.group(1), f"{part.args[i]}: one process per GPU expected"
    last = [line for line in text.splitlines() if line.strip() and not line.startswith("#")][-1]
    assert last.rstrip().endswith('jaxpar-train "$@"'), f'{part.args[i]} must end by running jaxpar-train "$@"'
    train = Part((), "jaxpar-train", part.args[i + 1 :])
    assert _parse(train).namespace.cpu_devices is None, f"{part.text}: --cpu-devices on a GPU cluster"
    _check_part(train, int(nodes) * int(gpus.group(1)), "gpu")


def _check_pytest(args: tuple[str, ...]) -> None:
    for flag, value in zip(args, args[1:]):
        if flag == "-m":
            unknown = set(re.findall(r"[A-Za-z_]\w*", value)) - MARKERS - {"not", "and", "or"}
            assert not unknown, f"pytest -m {value!r}: unregistered markers {unknown}"
    for word in args:
        if not word.startswith("-") and ("/" in word or word.endswith(".py")):
            assert os.path.exists(os.path.join(ROOT, word.split("::")[0])), f"pytest {word}: no such path"


def _takes_no_arguments(script: str) -> bool:
    """A repository script without an argument parser (checked: it exists)."""
    path = os.path.join(ROOT, script)
    assert os.path.isfile(path), f"{script} does not exist"
    with open(path, encoding="utf-8") as f:
        return "argparse" not in f.read()


def _check_part(part: Part, devices: int | None = None, platform: str = "cpu") -> None:
    prog, args = part.program, part.args
    if prog in ("python", "python3") and args[:2] == ("-m", "venv"):
        return
    if (prog == "pip" and args[:1] == ("install",)) or (
        prog in ("python", "python3") and args[:3] == ("-m", "pip", "install")
    ):
        for word in args:
            if m := re.fullmatch(r"\.\[([\w,-]+)\]", word):
                assert set(m.group(1).split(",")) <= EXTRAS, f"{word}: the extras of pyproject.toml are {EXTRAS}"
        return
    if prog in ("python", "python3") and args[:2] == ("-m", "pytest"):
        return _check_pytest(args[2:])
    if prog == "sbatch":
        return _check_sbatch(part)
    if prog in EXTERNAL or (part.script and len(args) == 1 and _takes_no_arguments(part.script)):
        return
    own, inner = _launched(part)
    parsed = _parse(own)
    ns = parsed.namespace
    _check_reads(ns)
    if prog == "jaxpar-launch":
        assert inner is not None, f"{part.text}: put the command to launch after `--`"
        _check_part(inner, ns.num_processes * (ns.devices_per_process or 1))
    elif parsed.parser.prog == "jaxpar-train":
        _plan_train(ns, devices or ns.cpu_devices or 1, platform)
    elif prog == "jaxpar-plan":
        _runs(dataclasses.replace(part, args=_without_compile_flags(args)))
    elif prog == "jaxpar-sweep" and not ns.list:
        _plan_sweep(os.path.normpath(ns.sweep))
    elif prog == "jaxpar-sweep" or part.script in RUN_AS_WRITTEN:
        _runs(part)
    elif prog == "jaxpar-data":
        for item in ns.inputs:
            assert glob.glob(os.path.join(ROOT, item), recursive=True), f"{part.text}: {item} matches no file"
    elif isinstance(getattr(ns, "config", None), str):  # a script's config and overrides
        from jaxpar.config import load_config

        assert os.path.isfile(os.path.join(ROOT, ns.config)), f"config {ns.config} does not exist"
        load_config(os.path.join(ROOT, ns.config), list(getattr(ns, "overrides", None) or []), validate=False)


def _check_synopsis(cmd: Command) -> None:
    """Each flag of a usage line is an option of its program's parser."""
    for part in cmd.parts:
        if part.program in EXTERNAL or part.program in ("pip", "sbatch"):
            continue
        words = [w.strip("[]") for w in part.args]
        words = words[: words.index("--")] if "--" in words else words
        lead = list(part.args[:1]) if part.script else []
        for word in words[len(lead) :]:  # a subcommand: the words before the first placeholder or flag
            if word.startswith("-") or not re.fullmatch(r"[a-z][\w-]*", word):
                break
            lead.append(word)
        parser = _parse(dataclasses.replace(part, args=tuple(lead)), parse=False).parser
        unknown = [w for w in words if re.fullmatch(r"--?[A-Za-z][\w-]*", w) and w not in parser._option_string_actions]
        assert not unknown, f"{cmd.text}: {parser.prog} has no option {unknown}"


def check(cmd: Command) -> None:
    """The default suite's checks of one documented command (module docstring)."""
    if cmd.is_synopsis:
        return _check_synopsis(cmd)
    for part in cmd.parts:
        _check_part(part)


# ---- tests ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", COMMANDS, ids=IDS)
def test_documented_command(cmd):
    try:
        check(cmd)
    except Exception as e:
        raise AssertionError(f"{', '.join(cmd.where)}: {cmd.text}\n  {type(e).__name__}: {e}") from e


def test_commands_are_found_in_every_kind_of_source():
    where = {w.split(":")[0] for c in COMMANDS for w in c.where}
    for expected in ("README.md", "docs/planning.md", "jaxpar/cli/train.py", "tools/slurm_gpu.sbatch"):
        assert expected in where, f"no command found in {expected}"
    assert any(w.startswith("configs/sweeps/") for w in where) and len(COMMANDS) >= 40
    joined = [
        c for c in COMMANDS if any(w.startswith("jaxpar/cli/train.py:") for w in c.where) and "--import" in c.text
    ]
    assert joined and joined[0].text.endswith("model.tie_embeddings=true"), "a continuation line was not joined"


@pytest.mark.parametrize(
    "text",
    [
        ".venv/bin/jaxpar-train configs/tiny.yaml --cpu-devise 8",  # a typo'd flag
        ".venv/bin/jaxpar-train configs/tiny.yaml --cpu-device 8",  # an abbreviated flag
        ".venv/bin/jaxpar-train configs/tinny.yaml --cpu-devices 8",  # a config that does not exist
        ".venv/bin/jaxpar-train configs/tiny.yaml --cpu-devices 8 mesh.dta=8",  # a typo'd key
        ".venv/bin/jaxpar-train configs/tiny.yaml --cpu-devices 8 mesh.data=8",  # a mesh of 16 on 8 devices
        "jaxpar-train configs/tiny.yaml",  # one CPU device
        ".venv/bin/jaxpar-trian configs/tiny.yaml --cpu-devices 8",  # no such program
        "jaxpar-launch -n 2 -- jaxpar-train configs/tiny.yaml",  # 2 processes x 1 device
        "jaxpar-launch -n 2 --devices-per-process 4 jaxpar-train configs/tiny.yaml",  # no `--`
        "jaxpar-train configs/tiny.yaml --cpu-devices 8 model.name=gpt3",  # a family nobody registered
        "python benchmarks/overhead.py --stepz 3",  # a script's typo'd flag
        "python examples/no_such_script.py",
        "python tools/resolve_config.py configs/llama_7b.yaml mesh.fsdp=16 --devices 64",  # 8 x 16 != 64
        "sbatch --nodes=2 tools/slurm_gpu.sbatch configs/llama_7b.yaml mesh.data=8 mesh.fsdp=8",
        "sbatch --nodes=8 tools/slurm_gpu.sbatch configs/llama_7b.yaml mesh.data=8 mesh.fsdp=8 --cpu-devices 8",
        "jaxpar-checkpoints runs/nowhere",  # read, but made by no command
        "jaxpar-train configs/tiny.yaml --cpu-devices 8 data.source=shards data.path=runs/data/nothing",
        "jaxpar-data tokenize 'nowhere/**/*.txt' --tokenizer byte --out runs/data/x",  # matches no file
        "jaxpar-sweep configs/sweeps/no_such_sweep.yaml",
        "pip install -e .[tests]",  # no such extra
        "python -m pytest -m slwo",  # an unregistered marker
        "tensorboard2 --logdir runs/tiny",  # not a program known here
        "jaxpar-train CONFIG --cpu-devics N",  # a synopsis's typo'd flag
        "jaxpar-plan configs/tiny.yaml --compile --target h100:8",  # not KIND:NODESxGPUS
        "jaxpar-plan configs/tiny.yaml --compile --target h100:2x8 --devices 8",  # devices follow from the cluster
        "jaxpar-plan configs/tiny.yaml mesh.fsdp=2 --compile --target h100:2x8",  # a mesh of 8 on 16 GPUs
    ],
)
def test_a_broken_example_fails(text):
    """The checks refuse each kind of broken example, so that the documented commands passing them means something."""
    from jaxpar.analysis.sweep.run import SweepError
    from jaxpar.config import ConfigError

    with pytest.raises((AssertionError, ConfigError, SweepError)) as err:
        check(Command(text, ["example"]))
    print(f"{text}\n  -> {type(err.value).__name__}: {str(err.value).splitlines()[0][:200]}")


SCRIPT_FILES = sorted(
    os.path.relpath(p, ROOT)
    for d in ("examples", "benchmarks", "tools")
    for p in glob.glob(os.path.join(ROOT, d, "*.py"))
)


def test_every_script_is_a_test():
    """Each script of examples/, benchmarks/ and tools/ is run by a test: ELSEWHERE's (which exists and names the
    script) or test_script_runs."""
    assert sorted({*ELSEWHERE, *HERE}) == SCRIPT_FILES and not set(ELSEWHERE) & set(HERE)
    for script, nodeid in ELSEWHERE.items():
        path, name = nodeid.split("::")
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            source = f.read()
        assert f"def {name}(" in source, f"{nodeid}: no such test (it ran {script})"
        assert os.path.basename(script) in source, f"{path} does not name {script}"


def _workdir(path: str) -> str:
    """A fresh directory that looks like the repository (links to its top-level entries except runs/) with a
    .venv/bin of this environment's python and the console scripts."""
    for name in os.listdir(ROOT):
        if name not in ("runs", ".venv", "venv", ".git", "build", "dist", ".pytest_cache"):
            os.symlink(os.path.join(ROOT, name), os.path.join(path, name))
    bin_dir = os.path.join(path, ".venv", "bin")
    os.makedirs(bin_dir)
    wrappers = {name: f'exec {shlex.quote(sys.executable)} "$@"' for name in ("python", "python3")}
    for name, entry in CONSOLE_SCRIPTS.items():
        module, func = entry.split(":")
        code = f"import sys; from {module} import {func}; sys.exit({func}())"
        wrappers[name] = f'exec {shlex.quote(sys.executable)} -c {shlex.quote(code)} "$@"'
    for name, body in wrappers.items():
        with open(os.path.join(bin_dir, name), "w") as f:
            f.write(f"#!/bin/sh\n{body}\n")
        os.chmod(os.path.join(bin_dir, name), stat.S_IRWXU)
    return path


def _shell(parts: list[list[str]], cwd: str) -> subprocess.CompletedProcess:
    """The parts, joined by &&, in bash from `cwd`, with its .venv/bin first on PATH and JAX_NUM_CPU_DEVICES unset
    (a fresh shell)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env["PATH"] = os.path.join(cwd, ".venv", "bin") + os.pathsep + env.get("PATH", "")
    script = " && ".join(shlex.join(p) for p in parts)
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize(
    "script", [s if s in FAST_SCRIPTS else pytest.param(s, marks=pytest.mark.slow) for s in sorted(HERE)]
)
def test_script_runs(script, tmp_path):
    args = [a.replace("{tmp}", str(tmp_path)) for a in HERE[script]]
    proc = _shell([["python", script, *args]], _workdir(str(tmp_path)))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]


def _readme_commands() -> tuple[Command, Command]:
    """README.md's two commands: the first two of its fenced shell blocks."""
    first, second = [c for c in COMMANDS if c.where[0].startswith("README.md:")][:2]
    assert first.parts[-1].program == "jaxpar-train" and second.parts[-1].args[:2] == ("-m", "pytest")
    return first, second


@pytest.mark.slow
def test_readme_commands_run(tmp_path):
    """The main job (two steps) prints its plan, the final validation loss against the unigram entropy and a sample;
    the test command collects the suite."""
    first, second = _readme_commands()
    cwd = _workdir(str(tmp_path))
    for cmd, append in ((first, TRAIN_APPEND), (second, COLLECT_ONLY)):
        run = [
            [*p.env, p.program, *p.args] for p in cmd.parts if not re.match(r"(python3? -m venv|pip install)", p.text)
        ]
        run[-1] += append
        proc = _shell(run, cwd)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        if cmd is first:
            out = proc.stdout + proc.stderr
            assert "jaxpar: mesh data=2 pipeline=1 fsdp=2 context=1 tensor=2 (8 devices), zero_stage 1" in out, out[
                -3000:
            ]
            assert re.search(
                r"final val_loss \d+\.\d+ nats/token over .* vs their unigram entropy \d+\.\d+ \(ratio", out
            )
            assert "\nsample:\n" in out and os.path.isdir(os.path.join(cwd, "runs", "tiny", "checkpoints", "2"))
