"""The tree is clean under the project's ruff configuration (pyproject.toml [tool.ruff]); ruff is in the test
extra."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ruff_check_is_clean():
    pytest.importorskip("ruff", reason="ruff (in the test extra) is not installed")
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    out = subprocess.run([ruff or sys.executable, *([] if ruff else ["-m", "ruff"]), "check", "--no-cache", ROOT],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
