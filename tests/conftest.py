"""Shared test setup: 8 simulated CPU devices (set before jax is imported) and the fixtures every kind of test uses:
`need_devices(n)` and `devices8` (fail, naming the cause, when the process has fewer devices), the
`requires_gpu_compile` marker (skip, naming what to install, without jax's CUDA plugin) and `fast_compile`. A test
file's step plans come from `step_helpers.planner`.

The suite is laid out by kind: `unit/` (functions and small pieces, no training run), `parity/` (each mesh layout
against one device: loss, gradients, optimizer step), `system/` (whole runs, commands, several processes,
signals). `step_helpers.py` (models, meshes, batches, comparisons with their tolerances), `doc_commands.py`
(the documented commands) and `data_worker.py` (one process of a multi-process data test) are shared.
"""

import json
import os
import shutil
import tempfile
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Every compile of the suite, in this process and its subprocesses, with XLA:CPU's fast code generation
# (jaxpar.analysis.hlo.compile_options.FAST_COMPILER_OPTIONS: every HLO pass kept, machine code less optimised),
# appended to the caller's XLA_FLAGS (CI's instruction-set phases set --xla_cpu_max_isa). Compiling is most of the
# suite's time; this cuts the default suite by about a fifth. JAXPAR_TEST_XLA_FAST=0 compiles as users do.
if os.environ.get("JAXPAR_TEST_XLA_FAST", "1") != "0":
    from jaxpar.analysis.hlo.compile_options import xla_flags  # no jax

    if xla_flags() not in os.environ.get("XLA_FLAGS", ""):  # xdist workers inherit it from the controller
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags()}".strip()

import jax  # noqa: E402  (after the device count is set)
import pytest  # noqa: E402
from step_helpers import COMPILE_CACHE_VAR, quick_compile  # noqa: E402


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
    # One jax persistent compilation cache for the subprocesses of this run that opt in (step_helpers.child_env):
    # made by the first pytest process, inherited by its xdist workers, removed when it ends.
    if not os.environ.get(COMPILE_CACHE_VAR):
        os.environ[COMPILE_CACHE_VAR] = tempfile.mkdtemp(prefix="jaxpar-compile-cache-")
        config._jaxpar_compile_cache = os.environ[COMPILE_CACHE_VAR]


def pytest_unconfigure(config):
    made = getattr(config, "_jaxpar_compile_cache", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)


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


def pytest_addoption(parser):
    parser.addoption(
        "--subset",
        metavar="FILE",
        help="run only the tests whose node ids FILE lists (one per line, `#` comments); an id that is not "
        "collected is an error, so the list cannot shrink silently (CI's parity subset under other instruction "
        "sets: tests/parity/isa_subset.txt)",
    )


def _subset(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        return {line.split("#", 1)[0].strip() for line in f} - {""}


def pytest_collection_modifyitems(config, items):
    """With --subset FILE, keep only FILE's tests. Then the documented commands' file first: under `-m slow` it is
    one of the longest (the README's main job and the benchmark scripts no other test runs, each a subprocess), and
    with a file per worker (pyproject.toml's `--dist loadfile`) the worker that starts it first leaves the other
    files to the others until it is done."""
    if config.getoption("--subset"):
        wanted = _subset(config.getoption("--subset"))
        missing = wanted - {item.nodeid for item in items}
        if missing:
            raise pytest.UsageError(
                f"--subset {config.getoption('--subset')}: not collected: {', '.join(sorted(missing))}; fix the "
                "list (a renamed test, or a test of another marker selection)"
            )
        deselected = [item for item in items if item.nodeid not in wanted]
        items[:] = [item for item in items if item.nodeid in wanted]
        config.hook.pytest_deselected(items=deselected)
    items.sort(key=lambda item: not item.nodeid.startswith("tests/system/test_documented_commands.py"))


# Where the time goes (tools/test_times.py reads it): with JAXPAR_TEST_TIMES=DIR, each pytest process writes
# DIR/<worker>.json: per test, its wall seconds (setup + call + teardown) and the seconds jax spent compiling in
# this process (tracing, lowering and XLA's compile: jax's monitoring events). Compiles in subprocesses a test
# starts count as run time of that test.
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_TIMES: dict[str, dict[str, float]] = {}
_current = {"test": None}


def _on_event(event: str, duration: float, **_) -> None:
    if event in _COMPILE_EVENTS and _current["test"]:
        _TIMES[_current["test"]]["compile"] += duration


if os.environ.get("JAXPAR_TEST_TIMES"):
    jax.monitoring.register_event_duration_secs_listener(_on_event)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _current["test"] = item.nodeid
        _TIMES[item.nodeid] = {"compile": 0.0, "wall": 0.0}
        start = time.perf_counter()
        yield
        _TIMES[item.nodeid]["wall"] = time.perf_counter() - start
        _current["test"] = None

    def pytest_sessionfinish(session):
        out = os.environ["JAXPAR_TEST_TIMES"]
        os.makedirs(out, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(out, f"{worker}.json"), "w", encoding="utf-8") as f:
            json.dump(_TIMES, f)
