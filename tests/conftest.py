"""Shared test setup: 8 simulated CPU devices (set before jax is imported) and the fixtures every kind of test uses.

The suite is laid out by kind: `unit/` (functions and small pieces, no training run), `parity/` (each mesh layout
against one device: loss, gradients, optimizer step), `system/` (whole runs, commands, several processes,
signals). `step_helpers.py` (models, meshes, batches, comparisons with their tolerances), `doc_commands.py`
(the documented commands) and `data_worker.py` (one process of a multi-process data test) are shared.
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after the device count is set)
import pytest  # noqa: E402
from step_helpers import quick_compile  # noqa: E402


@pytest.fixture(scope="module")
def fast_compile():
    """Within a module that uses it (`pytestmark = pytest.mark.usefixtures("fast_compile")`): every compile
    skips LLVM optimisation (`step_helpers.quick_compile`, which says why that is sound for these tests)."""
    with quick_compile():
        yield


@pytest.fixture
def devices8() -> list:
    """The 8 simulated devices; fails (not skips) when the process has fewer, naming the cause."""
    if jax.device_count() < 8:
        pytest.fail("needs 8 devices: tests/conftest.py sets JAX_NUM_CPU_DEVICES=8 before jax starts")
    return jax.devices()[:8]


def pytest_collection_modifyitems(config, items):
    """The documented commands' file first: under `-m slow` it is one of the longest (the README's main job and the
    benchmark scripts no other test runs, each a subprocess), and with a file per worker (pyproject.toml's
    `--dist loadfile`) the worker that starts it first leaves the other files to the others until it is done."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/system/test_documented_commands.py"))
