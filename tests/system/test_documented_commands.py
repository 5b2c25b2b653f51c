"""Every command line documented in the repository works as written.

`tests/doc_commands.py` extracts the commands (its docstring states the rules) from README.md, tools/, the
docstrings of experiments/*.py and jaxpar/cli/*.py and the comments of configs/**/*.yaml. Each `&&`-separated
part of a command is classified:

  install  `python3 -m venv DIR`, `pip install [-e] .[EXTRAS]`: not run (the environment running the tests is the
           install); the extras must exist in pyproject.toml.
  cluster  `sbatch --nodes=N SCRIPT ARGS`: N x the script's `#SBATCH --gpus-per-node` devices. The script must
           end by running jaxpar-train with "$@", so ARGS are parsed by jaxpar-train's parser, the config loaded,
           validated and resolved at N x G devices and planned (`jaxpar.analysis.planner.plan.plan`, platform gpu).
  gpu      `jaxpar-plan ... --compile --target KIND:NODESxGPUS`, or `jaxpar-sweep SWEEP.yaml` (without --list) of a
           sweep file with `target:` and `compile: true`: compiles for a GPU cluster, which need the gpu-compile
           extra (jax's CUDA plugin). Checked as the CLI checks them (`jaxpar.cli.plan.gpu_cluster`: the cluster
           name, --devices equal to its GPU count, no flag that does not apply; `jaxpar.analysis.sweep.run.load_sweep`
           for a sweep file), the config (each point's, for a sweep) loaded, validated and resolved at the cluster's GPU
           count and planned (platform gpu). Run (slow) only where the extra is installed; skipped otherwise,
           with the reason.
  local    a console script of pyproject.toml's [project.scripts], `python SCRIPT` of the repository, or
           `python -m MODULE`.
  NOT_RUN  synopses (a placeholder such as CONFIG or N is left) and programs that are not jaxpar's
           (tensorboard), each listed below with the reason.
A test fails for a command in none of these classes, and for a NOT_RUN entry that is no longer documented.

Default suite (no compiling):
  * every local and cluster part is checked statically: the program exists; its own argparse parser accepts
    the arguments (a typo'd flag fails); the config file exists and loads with the command's overrides (a
    typo'd key fails); jaxpar-train (also under jaxpar-launch) validates at the command's device count:
    `--cpu-devices N`, or K x D for `jaxpar-launch -n K --devices-per-process D`, else 1 (a fresh machine has
    one CPU device). A path under runs/ read by a command is made by another documented command, its
    producer: the first jaxpar-train command whose train.run_dir holds it (a config file there is checked as
    the producer's config with this command's overrides). A synopsis's flags must exist in its program's parser.
  * analytic commands run in-process, as written: jaxpar-plan without --compile / --measure-steps,
    jaxpar-sweep with --list or of a sweep file with `compile: false` and no measured steps, and
    tools/resolve_config.py.

Slow (`-m slow`): every other local command runs in a subprocess (bash, the parts after the install), in a fresh
temporary directory holding links to the repository's top-level entries (configs/, experiments/, tools/, ...; not
runs/) and a .venv/bin of this environment's python and pyproject.toml's console scripts, first on PATH;
JAX_NUM_CPU_DEVICES is removed from the environment (a fresh shell). A consumer gets a copy of its producer's run
directory first. Appended to the words of a part (later arguments win):
  jaxpar-train (also python experiments/train.py, and under jaxpar-launch): TRAIN_APPEND =
      train.steps=2 train.eval_batches=1 train.sample_tokens=0 train.progress_bar=false
    two steps still build the mesh, compile the step, evaluate and save a checkpoint (at the last step);
    200 steps, text generation and the progress bar are not what is tested.
  python -m pytest: --collect-only -q -p no:cacheprovider (the suite cannot run itself inside itself;
    collecting imports every test module and applies -m).
  python experiments/X.py: REDUCED[X] (one timed step and round; the smallest point grid; the GPU acceptance run
    in its CPU smoke mode; the data RSS benchmark on two tiny shard sets instead of 10M and 1B tokens).
Parts whose programs parse to the same arguments after this (e.g. `benchmarks.py` and `benchmarks.py --quick`)
run once; a script of REDUCED runs once whatever flags its commands show (its parser checks them in the default
suite), once more under jaxpar-launch. A command of a script that another slow test runs end to end and checks more
closely (RUN_ELSEWHERE: the benchmarks, the GPU acceptance smoke run, the own-model/data/loss examples) is not run a
second time here.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import io
import os
import re
import runpy
import shlex
import shutil
import stat
import subprocess
import sys
from unittest import mock

import pytest
from doc_commands import ROOT, Documented, extract, pyproject_section

TRAIN_APPEND = ["train.steps=2", "train.eval_batches=1", "train.sample_tokens=0", "train.progress_bar=false"]
COLLECT_ONLY = ["--collect-only", "-q", "-p", "no:cacheprovider"]
REDUCED = {
    "benchmarks/overhead.py": ["--steps", "1", "--rounds", "1"],
    "benchmarks/pipeline.py": ["--stages", "2", "--microbatches", "4", "--steps", "1", "--rounds", "1"],
    "benchmarks/tensor_collectives.py": ["--steps", "1", "--rounds", "1"],
    "benchmarks/tensor_bytes.py": ["--remat", "none", "--layouts", "data=2 x tensor=4 SP"],  # 2 of 24 compiles
    "benchmarks/all.py": ["--quick", "--steps", "1", "--rounds", "1"],
    "examples/own_model.py": ["--steps", "2"],
    "benchmarks/gpu_acceptance.py": ["--cpu-smoke"],
    "benchmarks/data_rss.py": [
        "--sizes",
        "100000",
        "200000",
        "--batches",
        "3",
    ],  # not 2 GB of shards  # the ~1B model on one GPU; the same code on tiny shapes
}
# Scripts whose whole run another slow test makes and checks more closely (the value); their documented commands
# are checked statically by the default suite and not run a second time here.
RUN_ELSEWHERE = {
    "benchmarks/all.py": "tests/system/test_benchmarks.py::test_quick_mode_prints_every_ratio",
    "benchmarks/gpu_acceptance.py": (
        "tests/system/test_gpu_acceptance.py::test_cpu_smoke_runs_every_part_and_the_loss_falls"
    ),
    "examples/own_data.py": "tests/system/test_train_data.py::test_example_script_resumes_its_own_data_exactly",
    "examples/own_model.py": (
        "tests/parity/test_own_model.py::test_own_model_script_resumes_bitwise_and_runs_unchanged_on_two_processes"
    ),
    "examples/custom_loss_optimizer.py": (
        "tests/parity/test_custom_optimizer.py::test_example_script_trains_with_its_own_loss_and_optimizer"
    ),
}
FAST_SCRIPTS = {"tools/resolve_config.py"}
SYNOPSIS = "a usage synopsis with placeholders; its flags are checked against the program's parser"
NOT_RUN = {
    "tensorboard --logdir runs/tiny": "TensorBoard is a viewer, not a jaxpar dependency; the event files it reads "
    "are tested in tests/unit/test_metrics.py",
    "jaxpar-checkpoints RUN_DIR": SYNOPSIS,
    "jaxpar-data tokenize INPUT ... --tokenizer TOKENIZER --out DIR": SYNOPSIS,
    "jaxpar-sweep SWEEP.yaml": SYNOPSIS,
    "jaxpar-checkpoints PATH [--step N] [--json]": SYNOPSIS,
    "jaxpar-checkpoints import-hf HF_DIR --out RUN_DIR [KEY=VALUE ...]": SYNOPSIS,
    "jaxpar-checkpoints export-hf PATH --out HF_DIR [--dtype D] [--step N]": SYNOPSIS,
    "jaxpar-launch -n K [--devices-per-process D] -- COMMAND ...": SYNOPSIS,
    "jaxpar-plan CONFIG [section.key=value ...]": SYNOPSIS,
    "jaxpar-plan CONFIG --compile --target KIND:NODESxGPUS": SYNOPSIS,
    "jaxpar-train CONFIG [section.key=value ...]": SYNOPSIS,
    "jaxpar-train --import FILE.py": SYNOPSIS,
    ".venv/bin/python tools/check_gpu_configs.py": "needs the gpu-compile extra (about 2.7 GB, not in CI) and rewrites "
    "configs/gpu_check.json; tests/unit/test_gpu_check.py checks that record "
    "against the configs, planner and README, and where the extra is "
    "installed recompiles a shipped config and compares",
}


SCRIPTS = {k: ast.literal_eval(v) for k, v in pyproject_section("project.scripts").items()}
EXTRAS = set(pyproject_section("project.optional-dependencies"))


# ---- parts and their classes ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Part:
    """One `&&`-part: its `words` as written (with `env` assignments), `program` (`.venv/bin/` dropped), `args`,
    and its class."""

    words: list[str]
    env: list[str]
    program: str
    args: list[str]
    kind: str  # install | local | cluster | gpu | not_run | unclassified

    @property
    def script(self) -> str | None:
        """The repository script of `python SCRIPT ...`."""
        if self.program in ("python", "python3") and self.args and not self.args[0].startswith("-"):
            return self.args[0]
        return None

    @property
    def module(self) -> str | None:
        if self.program in ("python", "python3") and self.args[:1] == ["-m"] and len(self.args) > 1:
            return self.args[1]
        return "pytest" if self.program == "pytest" else None


def _compiles_for_a_target(args: list[str]) -> bool:
    """jaxpar-sweep ARGS compiles for a GPU cluster: its sweep file (the first .yaml argument) loads and has
    `target:` and `compile: true`, and --list is not given. A file that does not load is left to the checks."""
    from jaxpar.analysis.sweep.run import SweepError, load_sweep

    files = [a for a in args if a.endswith(".yaml")]
    if "--list" in args or not files or not os.path.isfile(os.path.join(ROOT, files[0])):
        return False
    try:
        sweep = load_sweep(os.path.join(ROOT, files[0]))
    except SweepError:
        return False
    return sweep.target is not None and sweep.compile


def _part(full: list[str], not_run: bool) -> Part:
    words, env = list(full), []
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        env.append(words[0])
        words = words[1:]
    program = words[0].removeprefix(".venv/bin/") if words else ""
    args = words[1:]
    if not_run:
        kind = "not_run"
    elif program in ("python", "python3") and args[:2] == ["-m", "venv"]:
        kind = "install"
    elif (program in ("pip", "pip3") and args[:1] == ["install"]) or (
        program in ("python", "python3") and args[:3] == ["-m", "pip", "install"]
    ):
        kind = "install"
    elif program == "sbatch":
        kind = "cluster"
    elif (
        program == "jaxpar-plan"
        and "--compile" in args
        and any(a == "--target" or a.startswith("--target=") for a in args)
    ):
        kind = "gpu"
    elif program == "jaxpar-sweep" and _compiles_for_a_target(args):
        kind = "gpu"
    elif program.startswith("jaxpar-") or program == "pytest" or program in ("python", "python3"):
        kind = "local"
    else:
        kind = "unclassified"
    return Part(list(full), env, program, args, kind)


def parts(cmd: Documented) -> list[Part]:
    if cmd.text in NOT_RUN:
        return [_part(shlex.split(cmd.text), True)]
    if cmd.is_synopsis:
        return [dataclasses.replace(_part(p, False), kind="unclassified") for p in cmd.parts]
    return [_part(p, False) for p in cmd.parts]


COMMANDS = extract()
IDS = [c.text if len(c.text) <= 90 else c.text[:87] + "..." for c in COMMANDS]


# ---- running a program's own main in this process ---------------------------------------------------------------


class _Parsed(BaseException):  # BaseException: passes through the programs' `except Exception`
    def __init__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace | None):
        super().__init__()
        self.parser, self.namespace = parser, namespace


@contextlib.contextmanager
def _stop_at_parsing(parse: bool):
    """Patches ArgumentParser so that the program's first parse raises _Parsed (with the parser and, when `parse`,
    the namespace it parsed) instead of running the program."""

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


def _main(part: Part, cwd: str = ROOT) -> int:
    """Runs the part's program in this process (console script, repository script or module) from `cwd`;
    returns its exit status."""
    old_cwd, old_argv = os.getcwd(), sys.argv
    os.chdir(cwd)
    try:
        if part.program in SCRIPTS:
            module, func = SCRIPTS[part.program].split(":")
            sys.argv = [part.program, *part.args]
            result = getattr(importlib.import_module(module), func)(list(part.args))
        elif part.script:
            sys.argv = list(part.args)
            runpy.run_path(os.path.join(ROOT, part.script), run_name="__main__")
            result = 0
        elif part.module:
            sys.argv = [part.module, *part.args[2:]]
            runpy.run_module(part.module, run_name="__main__", alter_sys=True)
            result = 0
        else:
            raise AssertionError(f"{part.program}: not a program of this repository")
    except SystemExit as e:
        result = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.chdir(old_cwd)
        sys.argv = old_argv
    return int(result or 0)


def _parse(part: Part, parse: bool = True) -> _Parsed:
    """The parser and namespace the part's program builds from its arguments (nothing else runs). A typo'd
    flag or a missing argument fails here with the program's own usage message."""
    if part.program not in SCRIPTS:
        assert not part.program.startswith("jaxpar-"), (
            f"{part.program!r} is not a console script of pyproject.toml ({', '.join(sorted(SCRIPTS))})"
        )
    if part.script:
        assert os.path.isfile(os.path.join(ROOT, part.script)), f"{part.script} does not exist"
    err = io.StringIO()
    with _stop_at_parsing(parse), contextlib.redirect_stderr(err):
        try:
            status = _main(part)
        except _Parsed as parsed:
            if parse:  # argparse accepts unambiguous abbreviations (--cpu-device): documentation spells flags out
                flags = [w.split("=", 1)[0] for w in part.args if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", w)]
                unknown = [f for f in flags if f not in parsed.parser._option_string_actions]
                assert not unknown, f"{' '.join(part.words)}: {parsed.parser.prog} has no option {unknown}"
            return parsed
    raise AssertionError(f"{' '.join(part.words)}: exited {status} while parsing its arguments: {err.getvalue()}")


# ---- what a command reads and makes -----------------------------------------------------------------------------


def _launch_split(part: Part) -> tuple[Part, Part | None]:
    """jaxpar-launch's own part and the command it launches (after `--`)."""
    if part.program != "jaxpar-launch" or "--" not in part.args:
        return part, None
    cut = part.args.index("--")
    return dataclasses.replace(part, args=part.args[:cut]), _part(part.args[cut + 1 :], False)


def _is_train(parsed: _Parsed) -> bool:
    return parsed.parser.prog == "jaxpar-train"


def _run_dir(part: Part) -> str | None:
    """train.run_dir of a jaxpar-train part whose config is a repository file (a possible producer)."""
    from jaxpar.config import load_config

    own, inner = _launch_split(part)
    if inner is not None:
        return _run_dir(inner)
    if part.kind != "local" or not (part.program in SCRIPTS or part.script):
        return None
    try:
        parsed = _parse(part)
        if not _is_train(parsed) or parsed.namespace.config.startswith("runs/"):
            return None
        return os.path.normpath(
            load_config(
                os.path.join(ROOT, parsed.namespace.config), parsed.namespace.overrides, validate=False
            ).train.run_dir
        )
    except Exception:  # noqa: BLE001 -- a broken producer fails its own static test
        return None


PRODUCERS = [(c, i, d) for c in COMMANDS for i, p in enumerate(parts(c)) if (d := _run_dir(p))]


def _producer(path: str) -> tuple[Documented, int, str]:
    path = os.path.normpath(path)
    for cmd, index, run_dir in PRODUCERS:
        if path == run_dir or path.startswith(run_dir + os.sep):
            return cmd, index, run_dir
    raise AssertionError(
        f"{path} is read but no documented jaxpar-train command makes it "
        f"(run directories made: {sorted({d for _, _, d in PRODUCERS})})"
    )


def _inputs(part: Part) -> list[str]:
    """Paths under runs/ that a part reads: a config, --restore-from, jaxpar-checkpoints' PATH."""
    own, inner = _launch_split(part)
    part = inner or own
    if part.module == "pytest":
        return []
    namespace = _parse(part).namespace
    return [
        v
        for k in ("config", "restore_from", "path")
        if isinstance(v := getattr(namespace, k, None), str) and v.startswith("runs/")
    ]


# ---- static checks ----------------------------------------------------------------------------------------------


def _check_config(parsed: _Parsed, devices: int | None):
    """Loads the part's config with its overrides (validating at `devices` when given); returns the Config."""
    from jaxpar.config import load_config

    ns = parsed.namespace
    config, overrides = getattr(ns, "config", None), list(getattr(ns, "overrides", None) or [])
    if _is_train(parsed):
        assert config, "jaxpar-train needs a config path"
    if not config:
        return None
    if config.startswith("runs/"):  # a run's saved config: check the producer's config with these overrides
        producer, index, _ = _producer(config)
        own, inner = _launch_split(parts(producer)[index])
        made = _parse(inner or own).namespace
        config, overrides = made.config, [*made.overrides, *overrides]
    path = os.path.join(ROOT, config)
    assert os.path.isfile(path), f"config {config} does not exist"
    for spec in getattr(ns, "imports", None) or []:  # jaxpar-train --import: e.g. a model family for model.name
        from jaxpar.cli.train import import_module_or_file

        import_module_or_file(os.path.join(ROOT, spec) if spec.endswith(".py") else spec)
    return load_config(path, overrides, validate=devices is not None, num_devices=devices)


def _check_local(part: Part, devices: int | None = None) -> None:
    if part.module == "pytest":  # never parsed in-process: that would run the suite
        markers = {m.split(":")[0] for m in ast.literal_eval(pyproject_section("tool.pytest.ini_options")["markers"])}
        args = part.args[2:] if part.program != "pytest" else part.args
        for flag, expr in zip(args, args[1:]):
            if flag == "-m":
                unknown = set(re.findall(r"[A-Za-z_]\w*", expr)) - markers - {"not", "and", "or"}
                assert not unknown, f"pytest -m {expr!r}: unregistered markers {unknown}"
        return
    own, inner = _launch_split(part)
    parsed = _parse(own)
    if inner is not None:
        ns = parsed.namespace
        _check_local(inner, ns.num_processes * (ns.devices_per_process or 1))
        return
    ns = parsed.namespace
    if _is_train(parsed):
        devices = devices or ns.cpu_devices or 1
    else:
        devices = None  # other programs resolve the mesh themselves (jaxpar-plan --devices, experiments)
    for path in _inputs(part):
        _producer(path)
    _check_config(parsed, devices)
    if getattr(ns, "sweep", None):
        from jaxpar.analysis.sweep.run import load_sweep

        load_sweep(os.path.join(ROOT, ns.sweep))


def _sbatch_devices(part: Part) -> tuple[int, str, list[str]]:
    """(devices, script, script args) of `sbatch [options] SCRIPT ARGS`."""
    nodes, i = None, 0
    while i < len(part.args) and part.args[i].startswith("-"):
        word = part.args[i]
        if word.startswith("--nodes="):
            nodes = word.split("=", 1)[1]
        elif word in ("-N", "--nodes"):
            nodes, i = part.args[i + 1], i + 1
        i += 1
    assert nodes is not None and nodes.isdigit(), f"{' '.join(part.words)}: give --nodes=N (a number)"
    script = part.args[i]
    with open(os.path.join(ROOT, script), encoding="utf-8") as f:
        text = f.read()
    gpus = re.search(r"^#SBATCH\s+--gpus-per-node=(\d+)\s*$", text, re.M)
    tasks = re.search(r"^#SBATCH\s+--ntasks-per-node=(\d+)\s*$", text, re.M)
    assert gpus and tasks and gpus.group(1) == tasks.group(1), f"{script}: one process per GPU expected"
    last = [line for line in text.splitlines() if line.strip() and not line.startswith("#")][-1]
    assert re.search(r"jaxpar-train \"\$@\"$", last), f'{script} must end by running jaxpar-train "$@"'
    return int(nodes) * int(gpus.group(1)), script, part.args[i + 1 :]


def _check_cluster(part: Part) -> dict:
    from jaxpar.analysis.planner.plan import plan
    from jaxpar.config import resolve_config

    devices, _, args = _sbatch_devices(part)
    parsed = _parse(_part(["jaxpar-train", *args], False))
    assert parsed.namespace.cpu_devices is None, "--cpu-devices on a GPU cluster"
    cfg = resolve_config(_check_config(parsed, devices), devices)
    return {"devices": devices, "plan": plan(cfg, "gpu")}


def _check_gpu(part: Part) -> dict:
    """A `gpu` part as jaxpar-plan (or jaxpar-sweep) checks it before compiling, planned at the cluster's GPU
    count (a sweep: every point that resolves, at least one; the first one's plan is returned)."""
    from jaxpar.analysis.planner.plan import plan
    from jaxpar.cli.plan import gpu_cluster
    from jaxpar.config import resolve_config

    parsed = _parse(part)
    if part.program == "jaxpar-sweep":
        from jaxpar.analysis.gpu.targets import parse_cluster
        from jaxpar.analysis.sweep.run import load_sweep, points
        from jaxpar.config import ConfigError, load_config

        sweep = load_sweep(os.path.join(ROOT, parsed.namespace.sweep))
        clu = parse_cluster(sweep.target)
        plans = []
        for point in points(sweep):
            try:
                cfg = resolve_config(
                    load_config(sweep.base, [*sweep.overrides, *point["overrides"]], validate=False), point["devices"]
                )
            except ConfigError:
                continue  # an invalid point is recorded by the sweep, not fatal
            plans.append(plan(cfg, "gpu"))
        assert plans, f"{' '.join(part.words)}: no point of the sweep resolves at {clu.devices} devices"
        return {"devices": clu.devices, "cluster": clu.name, "plan": plans[0]}
    try:
        clu = gpu_cluster(parsed.namespace)
    except ValueError as e:
        raise AssertionError(f"{' '.join(part.words)}: {e}") from e
    cfg = resolve_config(_check_config(parsed, clu.devices), clu.devices)
    return {"devices": clu.devices, "cluster": clu.name, "plan": plan(cfg, "gpu")}


def _synopsis_flags(cmd: Documented) -> None:
    """Each flag of a synopsis is an option of its program's parser."""
    words = shlex.split(cmd.text.replace("[", " ").replace("]", " "))
    if "--" in words:
        words = words[: words.index("--")]
    part = _part(words, False)
    if part.program not in SCRIPTS and not part.script:
        return  # not jaxpar's program (NOT_RUN gives the reason)
    parser = _parse(part, parse=False).parser
    flags = [w for w in part.args if re.fullmatch(r"--?[A-Za-z][\w-]*", w)]
    unknown = [f for f in flags if f not in parser._option_string_actions]
    assert not unknown, f"{cmd.text}: {parser.prog} has no option {unknown}"


# ---- what runs where --------------------------------------------------------------------------------------------


def _fast(part: Part) -> bool:
    """Analytic: runs in-process in the default suite."""
    if part.kind != "local":
        return False
    if part.script in FAST_SCRIPTS:
        return True
    if part.program == "jaxpar-plan":
        return "--compile" not in part.args and not any(a.startswith("--measure-steps") for a in part.args)
    if part.program == "jaxpar-sweep":
        from jaxpar.analysis.sweep.run import load_sweep

        if "--list" in part.args:
            return True
        files = [a for a in part.args if a.endswith(".yaml")]
        sweep = load_sweep(os.path.join(ROOT, files[0])) if files else None
        return sweep is not None and not sweep.compile and not sweep.measure_steps
    return False


def _appended(part: Part) -> list[str]:
    own, inner = _launch_split(part)
    if inner is not None:
        return _appended(inner)
    if part.module == "pytest":
        return COLLECT_ONLY
    if part.script in REDUCED:
        return REDUCED[part.script]
    return TRAIN_APPEND if _is_train(_parse(part)) else []


def _classified(cmd: Documented) -> list[Part]:
    return [p for p in parts(cmd) if p.kind in ("local", "cluster", "gpu")]


FAST = [(c, i) for c, i in zip(COMMANDS, IDS) if any(_fast(p) for p in _classified(c))]


def _run_elsewhere(part: Part) -> bool:
    own, inner = _launch_split(part)
    return (inner or own).script in RUN_ELSEWHERE


SLOW = [
    (c, i)
    for c, i in zip(COMMANDS, IDS)
    if any(p.kind == "local" and not _fast(p) and not _run_elsewhere(p) for p in _classified(c))
]
CLUSTER = [(c, i) for c, i in zip(COMMANDS, IDS) if any(p.kind == "cluster" for p in parts(c))]
GPU = [(c, i) for c, i in zip(COMMANDS, IDS) if any(p.kind == "gpu" for p in parts(c))]


# ---- tests ------------------------------------------------------------------------------------------------------


def test_scripts_run_elsewhere_are_documented_and_run_there():
    """Each script of RUN_ELSEWHERE has a documented command, and its test exists, is slow (CI runs it) and runs
    that script."""
    documented = {
        (p if _launch_split(p)[1] is None else _launch_split(p)[1]).script for c in COMMANDS for p in parts(c)
    }
    for script, nodeid in RUN_ELSEWHERE.items():
        assert script in documented, f"{script} is no longer documented: drop it from RUN_ELSEWHERE"
        path, name = nodeid.split("::")
        source = open(os.path.join(ROOT, path)).read()
        block = source[source.index(f"def {name}(") - 200 : source.index(f"def {name}(")]
        body = source[source.index(f"def {name}(") :].split("\ndef ")[0]
        assert "@pytest.mark.slow" in block.split("\n\n")[-1] or "pytestmark" in source, nodeid
        assert os.path.basename(script) in body, f"{nodeid} does not run {script}"


def test_extraction_finds_the_known_commands():
    texts = {c.text for c in COMMANDS}
    for expected in (
        "sbatch --nodes=8 tools/slurm_gpu.sbatch configs/llama_7b.yaml mesh.data=8 mesh.fsdp=8",
        "jaxpar-sweep configs/sweeps/llama_7b_64.yaml --out runs/sweeps/llama_7b_64",
        ".venv/bin/jaxpar-plan --exercise-13b",
    ):
        assert expected in texts
    assert any(c.text.startswith("python benchmarks/pipeline.py") and "[--optimized]" in c.text for c in COMMANDS), (
        "a docstring command's continuation line was not joined"
    )
    assert len(COMMANDS) >= 40


def test_a_sweep_compiling_for_a_gpu_target_is_a_gpu_command():
    """It needs the gpu-compile extra, so it runs only where that is installed (not among the local commands);
    listing its points, or a sweep without a target, needs nothing."""
    sweep = "configs/sweeps/llama_7b_h100_64.yaml"
    assert [p.kind for p in parts(Documented(f"jaxpar-sweep {sweep} --out runs/x", ["example"]))] == ["gpu"]
    assert [p.kind for p in parts(Documented(f"jaxpar-sweep {sweep} --list", ["example"]))] == ["local"]
    plain = Documented("jaxpar-sweep configs/sweeps/tiny_mesh_8.yaml --out runs/x", ["example"])
    assert [p.kind for p in parts(plain)] == ["local"]
    assert _check_gpu(parts(Documented(f"jaxpar-sweep {sweep}", ["example"]))[0])["devices"] == 64


def _classify(cmd: Documented) -> None:
    unclassified = [" ".join(p.words) for p in parts(cmd) if p.kind == "unclassified"]
    assert not unclassified, (
        f"{cmd.where}: cannot run or check {unclassified}: fix the command, or list it in "
        f"NOT_RUN with the reason it cannot run here"
    )


@pytest.mark.parametrize("cmd", COMMANDS, ids=IDS)
def test_every_command_is_classified(cmd):
    _classify(cmd)


def test_not_run_entries_are_still_documented():
    assert set(NOT_RUN) <= {c.text for c in COMMANDS}, set(NOT_RUN) - {c.text for c in COMMANDS}


@pytest.mark.parametrize("cmd", COMMANDS, ids=IDS)
def test_static(cmd):
    _static(cmd)


def _static(cmd: Documented) -> None:
    for part in parts(cmd):
        if part.kind == "install":
            for word in part.args:
                extras = re.fullmatch(r"\.\[([\w,-]+)\]", word)
                if extras:
                    assert set(extras.group(1).split(",")) <= EXTRAS, f"{word}: extras of pyproject: {EXTRAS}"
        elif part.kind == "local":
            _check_local(part)
        elif part.kind == "cluster":
            _check_cluster(part)
        elif part.kind == "gpu":
            _check_gpu(part)
        elif part.kind == "not_run" and NOT_RUN.get(cmd.text) == SYNOPSIS:
            _synopsis_flags(cmd)


@pytest.mark.parametrize("cmd", [c for c, _ in CLUSTER], ids=[i for _, i in CLUSTER])
def test_cluster_command_resolves_and_plans(cmd):
    for part in parts(cmd):
        if part.kind == "cluster":
            out = _check_cluster(part)
            peak = out["plan"]["memory"]["peak_estimate"]
            assert out["devices"] >= 8 and peak > 0


@pytest.mark.parametrize("cmd", [c for c, _ in GPU], ids=[i for _, i in GPU])
def test_gpu_compile_command_resolves_and_plans(cmd):
    for part in parts(cmd):
        if part.kind == "gpu":
            out = _check_gpu(part)
            assert out["devices"] >= 8 and out["plan"]["devices"] == out["devices"]
            assert out["plan"]["platform"] == "gpu" and out["plan"]["memory"]["peak_estimate"] > 0


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
        "python benchmarks/overhead.py --stepz 3",  # a script's typo'd flag
        "python experiments/no_such_script.py",
        "python tools/resolve_config.py configs/llama_7b.yaml mesh.fsdp=16 --devices 64",  # 8 x 16 != 64
        "sbatch --nodes=2 tools/slurm_gpu.sbatch configs/llama_7b.yaml mesh.data=8 mesh.fsdp=8",
        "sbatch --nodes=8 tools/slurm_gpu.sbatch configs/llama_7b.yaml mesh.data=8 mesh.fsdp=8 --cpu-devices 8",
        "jaxpar-checkpoints runs/nowhere",  # read, but made by no command
        "jaxpar-sweep configs/sweeps/no_such_sweep.yaml",
        "pip install -e .[tests]",  # no such extra
        "python -m pytest -m slwo",  # an unregistered marker
        "tensorboard2 --logdir runs/tiny",  # not a program known here
        "jaxpar-train CONFIG --cpu-devics N",  # a synopsis not listed
        "jaxpar-plan configs/tiny.yaml --compile --target h100:8",  # not KIND:NODESxGPUS
        "jaxpar-plan configs/tiny.yaml --compile --target h100:2x8 --devices 8",  # devices follow from the cluster
        "jaxpar-plan configs/tiny.yaml mesh.fsdp=2 --compile --target h100:2x8",  # a mesh of 8 on 16 GPUs
    ],
)
def test_a_broken_example_fails(text, tmp_path):
    """The checks above refuse each kind of broken example (so the documented commands passing them means
    something)."""
    cmd = Documented(text, ["example"])
    from jaxpar.analysis.sweep.run import SweepError
    from jaxpar.config import ConfigError

    with pytest.raises((AssertionError, ConfigError, SweepError)) as err:
        _classify(cmd)
        _static(cmd)
        for part in parts(cmd):
            if _fast(part):
                assert _main(part, _workdir(tmp_path)) == 0
    print(f"{text}\n  -> {type(err.value).__name__}: {str(err.value).splitlines()[0][:200]}")


def _workdir(path) -> str:
    """A fresh directory that looks like the repository (links to its top-level entries except runs/) with a
    .venv/bin of this environment's python and the console scripts."""
    path = str(path)
    for name in os.listdir(ROOT):
        if name not in ("runs", ".venv", "venv", ".git", "build", "dist", ".pytest_cache"):
            os.symlink(os.path.join(ROOT, name), os.path.join(path, name))
    bin_dir = os.path.join(path, ".venv", "bin")
    os.makedirs(bin_dir)
    wrappers = {name: f'exec {shlex.quote(sys.executable)} "$@"' for name in ("python", "python3")}
    for name, entry in SCRIPTS.items():
        module, func = entry.split(":")
        code = f"import sys; from {module} import {func}; sys.exit({func}())"
        wrappers[name] = f'exec {shlex.quote(sys.executable)} -c {shlex.quote(code)} "$@"'
    for name, body in wrappers.items():
        with open(os.path.join(bin_dir, name), "w") as f:
            f.write(f"#!/bin/sh\n{body}\n")
        os.chmod(os.path.join(bin_dir, name), stat.S_IRWXU)
    return path


@pytest.mark.parametrize("cmd", [c for c, _ in FAST], ids=[i for _, i in FAST])
def test_analytic_command_runs(cmd, tmp_path, capsys):
    cwd = _workdir(tmp_path)
    for part in parts(cmd):
        if _fast(part):
            assert _main(part, cwd) == 0, capsys.readouterr().err


_RUNS: dict[tuple, tuple[int, str, str]] = {}


def _meaning(part: Part) -> tuple:
    """What a part runs: its program (or script) and the namespace its parser makes, for the launched command too.
    A script of REDUCED is its name alone: it runs once (reduced) whatever flags its commands show, which its
    parser checks in the default suite."""
    own, inner = _launch_split(part)
    if own.module == "pytest":
        return ("pytest", tuple(own.args))
    if own.script in REDUCED:
        return (own.script,)
    namespace = vars(_parse(own).namespace)
    return (
        own.script or own.program,
        tuple(sorted((k, repr(v)) for k, v in namespace.items())),
        _meaning(inner) if inner else None,
    )


def _run(cmd: Documented, factory) -> tuple[int, str, str]:
    """Runs the command's local parts in a fresh directory (module docstring); cached by what they run."""
    local = [p for p in parts(cmd) if p.kind in ("local", "gpu")]
    words = [[*p.words, *_appended(p)] for p in local]
    key = tuple(_meaning(dataclasses.replace(p, words=ws, args=ws[len(p.env) + 1 :])) for p, ws in zip(local, words))
    if key in _RUNS:
        return _RUNS[key]
    cwd = _workdir(factory.mktemp("cmd"))
    for part in local:
        for path in _inputs(part):
            producer, _, run_dir = _producer(path)
            _, _, made = _run(producer, factory)
            if not os.path.exists(os.path.join(cwd, run_dir)):
                shutil.copytree(os.path.join(made, run_dir), os.path.join(cwd, run_dir))
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env["PATH"] = os.path.join(cwd, ".venv", "bin") + os.pathsep + env.get("PATH", "")
    script = " && ".join(shlex.join(ws) for ws in words)
    proc = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    _RUNS[key] = (proc.returncode, f"$ {script}\n{proc.stdout}{proc.stderr}", cwd)
    return _RUNS[key]


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [c for c, _ in SLOW], ids=[i for _, i in SLOW])
def test_local_command_runs(cmd, tmp_path_factory):
    code, output, _ = _run(cmd, tmp_path_factory)
    assert code == 0, output[-6000:]


def _plugin_missing() -> str | None:
    from jaxpar.analysis.gpu.deviceless import unavailable_reason

    return unavailable_reason()


@pytest.mark.slow
@pytest.mark.skipif(
    _plugin_missing() is not None, reason=f"a gpu command needs the gpu-compile extra: {_plugin_missing()}"
)
@pytest.mark.parametrize("cmd", [c for c, _ in GPU], ids=[i for _, i in GPU])
def test_gpu_compile_command_runs(cmd, tmp_path_factory):
    code, output, _ = _run(cmd, tmp_path_factory)
    assert code == 0, output[-6000:]
