"""An installed jaxpar (a wheel, `pip install .`) ships the configs: `jaxpar-plan --exercise-13b` reads
configs/llama_13b.yaml and its base chain through the package directory jaxpar/configs, a link to the repository's
configs/ (one copy of each file)."""

import ast
import fnmatch
import glob
import importlib.resources
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
from doc_commands import pyproject_section

import jaxpar
from jaxpar.cli import plan as plan_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "jaxpar")


def _shipped_globs() -> list[str]:
    return ast.literal_eval(pyproject_section("tool.setuptools.package-data")["jaxpar"])


def test_configs_are_package_data_of_one_copy():
    """The source tree keeps one copy of each config (jaxpar/configs links to configs/), and the installed package
    -- editable or not, whichever jaxpar this process imported -- holds every shipped config with the same bytes,
    the exercise's config among them."""
    link = os.path.join(PACKAGE, "configs")
    assert os.path.islink(link) and os.path.realpath(link) == os.path.realpath(os.path.join(ROOT, "configs"))
    shipped = _shipped_globs()
    configs = [
        os.path.relpath(p, link) for p in glob.glob(os.path.join(link, "**", "*"), recursive=True) if os.path.isfile(p)
    ]
    assert configs and all(any(fnmatch.fnmatch(os.path.join("configs", c), g) for g in shipped) for c in configs), (
        configs,
        shipped,
    )
    installed = importlib.resources.files("jaxpar") / "configs"
    for c in configs:
        with open(os.path.join(ROOT, "configs", c), "rb") as f:
            assert installed.joinpath(c).read_bytes() == f.read(), c
    package = os.path.dirname(os.path.abspath(jaxpar.__file__))
    assert os.path.commonpath([os.path.abspath(plan_cli.EXERCISE_CONFIG), package]) == package  # inside the package
    assert installed.joinpath("llama_13b.yaml").read_bytes() == open(plan_cli.EXERCISE_CONFIG, "rb").read()


@pytest.mark.slow
def test_wheel_ships_configs_and_the_exercise_runs_outside_the_repository(tmp_path):
    """Builds the wheel from a copy of the source tree (pip, with build isolation), unpacks it and runs the
    exercise from a directory outside the repository with only the unpacked wheel on the path for jaxpar."""
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "venv", "runs", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"
        ),
    )
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = glob.glob(str(tmp_path / "dist" / "jaxpar-*.whl"))
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(site)
    for name in (
        "tiny.yaml",
        "gpu_base.yaml",
        "llama_125m.yaml",
        "llama_1b.yaml",
        "llama_7b.yaml",
        "llama_13b.yaml",
        "sweeps/tiny_mesh_8.yaml",
    ):
        assert f"jaxpar/configs/{name}" in names
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site))
    where = subprocess.run(
        [sys.executable, "-c", "import jaxpar; print(jaxpar.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.strip().startswith(str(site))
    run = subprocess.run(
        [sys.executable, "-m", "jaxpar.cli.plan", "--exercise-13b"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "  ZeRO-3  16P/N             26 GB" in run.stdout and "configs/llama_13b.yaml" in run.stdout
