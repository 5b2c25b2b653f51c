"""Shared test setup: 8 simulated CPU devices (set before jax is imported) and the fixtures every kind of test uses:
`need_devices(n)` and `devices8` (fail, naming the cause, when the process has fewer devices), the
`requires_gpu_compile` marker (skip, naming what to install, without jax's CUDA plugin) and `fast_compile`. A test
file's step plans come from `step_helpers.planner`.

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


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "requires_gpu_compile: compiles for NVIDIA GPUs without one; skipped, naming what to install, when the "
        "gpu-compile extra (jax's CUDA plugin) is missing",
    )


_GPU_COMPILE: dict = {}


def pytest_itemcollected(item):
    """A test marked `requires_gpu_compile` is skipped when the deviceless GPU compile cannot run here, with the
    reason `jaxpar.analysis.gpu.deviceless.unavailable_reason` gives (asked once, at collection)."""
    if item.get_closest_marker("requires_gpu_compile") is None:
        return
    if "reason" not in _GPU_COMPILE:
        from jaxpar.analysis.gpu.deviceless import unavailable_reason

        _GPU_COMPILE["reason"] = unavailable_reason()
    if _GPU_COMPILE["reason"] is not None:
        item.add_marker(pytest.mark.skip(reason=f"needs the gpu-compile extra: {_GPU_COMPILE['reason']}"))


def _need_devices(n: int, exactly: bool = False) -> list:
    """The first `n` devices; fails (not skips) when the process has fewer (or, with `exactly`, another count),
    naming the cause."""
    count = jax.device_count()
    if count < n or (exactly and count != n):
        pytest.fail(
            f"needs {'exactly ' if exactly else ''}{n} devices: tests/conftest.py sets JAX_NUM_CPU_DEVICES=8 before "
            f"jax starts"
        )
    return jax.devices()[:n]


@pytest.fixture(scope="session")
def need_devices():
    """`need_devices(n)` (or `need_devices(n, exactly=True)`): the first n devices, failing the test, not skipping
    it, when the process has fewer. A function, so that a test can ask for a count it is parametrized by; any
    fixture may use it (session scope)."""
    return _need_devices


@pytest.fixture
def devices8() -> list:
    """The 8 simulated devices; fails (not skips) when the process has fewer, naming the cause."""
    return _need_devices(8)


def pytest_collection_modifyitems(config, items):
    """The documented commands' file first: under `-m slow` it is by far the longest (a subprocess per command,
    about a third of the slow suite's work), and with a file per worker (pyproject.toml's `--dist loadfile`) the
    worker that starts it first leaves the other files to the others until it is done."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/system/test_documented_commands.py"))
