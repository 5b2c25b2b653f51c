"""jaxpar/ is clean under mypy in basic mode (pyproject.toml [tool.mypy] says what that is and why mypy). mypy is
in the test extra.

Time: about 16 s of CPU with nothing cached (mypy reads jax's and numpy's own sources for their types), about
1 s when its cache is warm. The cache lives in the system's temporary directory, one per checkout, so it is never
written into the repository and a second run in the same checkout is fast.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_mypy_is_clean_on_the_package():
    pytest.importorskip("mypy", reason="mypy (in the test extra) is not installed")
    tag = hashlib.sha256(f"{ROOT} {sys.version}".encode()).hexdigest()[:12]
    cache = os.path.join(tempfile.gettempdir(), f"jaxpar-mypy-{tag}")
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", cache],  # files and settings: pyproject.toml [tool.mypy]
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "Success: no issues found" in out.stdout, out.stdout
