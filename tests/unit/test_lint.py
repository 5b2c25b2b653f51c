"""The tree is clean under the project's ruff configuration (pyproject.toml [tool.ruff]): the linter finds
nothing and the formatter would change nothing. ruff is in the test extra; .pre-commit-config.yaml runs the same
two checks before each commit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ruff(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("ruff", reason="ruff (in the test extra) is not installed")
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    command = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    return subprocess.run([*command, *args, "--no-cache", ROOT], capture_output=True, text=True, cwd=ROOT)


def test_ruff_check_is_clean():
    out = _ruff("check")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format_is_clean():
    out = _ruff("format", "--check")
    assert out.returncode == 0, f"run `ruff format .`; it would change:\n{out.stdout}{out.stderr}"


def test_pre_commit_runs_the_same_checks():
    """.pre-commit-config.yaml runs these two checks with the environment's own ruff (local hooks, no pinned copy
    of another version), so the hook and this file judge a tree alike."""
    import yaml

    with open(os.path.join(ROOT, ".pre-commit-config.yaml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    assert [r["repo"] for r in config["repos"]] == ["local"]
    entries = {h["id"]: (h["language"], h["entry"].split()[:2]) for h in config["repos"][0]["hooks"]}
    assert entries == {"ruff-check": ("system", ["ruff", "check"]), "ruff-format": ("system", ["ruff", "format"])}
