"""The package shows its architecture: the training core never imports the analysis tools or the commands.

Core: every module of jaxpar/ outside jaxpar/analysis/ and jaxpar/cli/. Imports are read from the source (module
level and inside functions), so a lazy import counts too.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "jaxpar")


def _modules(top: str) -> dict[str, str]:
    """Dotted module name -> file, for every .py file under `top` (a directory of jaxpar/)."""
    out = {}
    for d, dirs, files in os.walk(top):
        dirs[:] = [x for x in dirs if x not in ("__pycache__", "configs")]
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(d, f)
    return out


def _imports(path: str, module: str) -> set[str]:
    names = set()
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def test_core_never_imports_analysis_or_cli():
    core = {m: p for m, p in _modules(PACKAGE).items() if not m.startswith(("jaxpar.analysis", "jaxpar.cli"))}
    assert "jaxpar.training.loop" in core and "jaxpar.training.step" in core
    bad = {
        m: sorted(i for i in _imports(p, m) if i.startswith(("jaxpar.analysis", "jaxpar.cli"))) for m, p in core.items()
    }
    assert {m: v for m, v in bad.items() if v} == {}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    """No two jaxpar modules import each other, directly or through others, counting imports inside functions:
    a cycle patched with a local import is still a cycle. (A package's `__init__` importing its own modules is
    not an edge back: Python imports a submodule while its package is still initialising.)"""
    modules = _modules(PACKAGE)
    graph = {m: {i for i in _imports(p, m) if i in modules and i != m} for m, p in modules.items()}
    assert any(graph.values())  # the reader sees the imports
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles(graph) == []


def test_analysis_is_a_package_of_its_own():
    analysis = _modules(os.path.join(PACKAGE, "analysis"))
    for name in (
        "jaxpar.analysis.planner.plan",
        "jaxpar.analysis.sweep.run",
        "jaxpar.analysis.hlo.collectives",
        "jaxpar.analysis.planner.memory",
        "jaxpar.analysis.gpu.deviceless",
        "jaxpar.analysis.gpu.targets",
    ):
        assert name in analysis
    top = {m for m in _modules(PACKAGE) if m.count(".") == 1}
    assert not top & {"jaxpar.plan", "jaxpar.sweep", "jaxpar.hlo", "jaxpar.memory", "jaxpar.comm"}


def _literal_tuples(path: str):
    """(line, tuple of str) for every tuple or list literal of string constants in the file."""
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if (
            isinstance(node, (ast.Tuple, ast.List))
            and node.elts
            and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)
        ):
            yield node.lineno, tuple(e.value for e in node.elts)


# Each concept's names are spelled out once, in the module named here, and imported everywhere else.
ONE_SOURCE = {
    "mesh axes": ({"data", "pipeline", "fsdp", "tensor"}, "jaxpar.config.mesh_axes"),
    "platforms": ({"gpu", "tpu", "cpu"}, "jaxpar.config.precision"),
    "float dtypes": ({"float32", "bfloat16"}, "jaxpar.config.precision"),
    "batch keys": ({"inputs", "targets", "loss_mask"}, "jaxpar.data.batch"),
}


def test_each_concept_is_spelled_out_in_one_module():
    found: dict[str, list[str]] = {name: [] for name in ONE_SOURCE}
    for module, path in _modules(PACKAGE).items():
        for line, names in _literal_tuples(path):
            for concept, (want, _) in ONE_SOURCE.items():
                if set(names) == want and len(names) == len(want):
                    found[concept].append(f"{module}:{line}")
    for concept, (_, source) in ONE_SOURCE.items():
        assert [w.split(":")[0] for w in found[concept]] == [source], (concept, found[concept])


def test_compile_options_are_written_once():
    """XLA:CPU's fast-compile options appear as dict keys only in jaxpar.analysis.hlo.compile_options, wherever the
    repository's Python lives."""
    from jaxpar.analysis.hlo.compile_options import FAST_COMPILER_OPTIONS

    where = []
    for top in ("jaxpar", "examples", "benchmarks", "tools", "tests"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                path = os.path.join(d, f)
                rel = os.path.relpath(path, ROOT)
                if not f.endswith(".py"):
                    continue
                for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
                    if isinstance(node, ast.Dict) and any(
                        isinstance(k, ast.Constant) and k.value in FAST_COMPILER_OPTIONS for k in node.keys
                    ):
                        where.append(rel)
    assert where == [os.path.join("jaxpar", "analysis", "hlo", "compile_options.py")] * 2


def test_jax_free_modules_do_not_start_jax():
    """The commands set jax's device count before jax starts, so what they import first must not import jax."""
    code = (
        "import sys\n"
        "import jaxpar.cli.plan, jaxpar.cli.sweep, jaxpar.analysis.sweep.run, jaxpar.config.mesh_axes, "
        "jaxpar.config.precision\n"
        "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}
    ).stdout
    assert out.strip() == "[]"


def test_compute_dtype_auto_resolves_once():
    """The planner and the step plan resolve `compute_dtype: auto` with one function, the step plan from its
    mesh's platform (which the run saves), and nothing in the library asks jax's default backend for it."""
    import re

    import numpy as np

    from jaxpar.analysis.planner.plan import plan
    from jaxpar.config import load_config, resolve_config
    from jaxpar.config.precision import resolve_compute_dtype
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.training.plan import build_plan

    assert [resolve_compute_dtype("auto", p) for p in ("cpu", "gpu", "tpu")] == ["float32", "bfloat16", "bfloat16"]
    assert resolve_compute_dtype("bfloat16", "cpu") == "bfloat16"
    cfg = resolve_config(load_config(os.path.join(ROOT, "configs", "tiny.yaml"), validate=False), 8)
    assert cfg.precision.compute_dtype == "auto"
    step_plan = build_plan(cfg, build_mesh(cfg))
    here = step_plan.platform
    assert (
        np.dtype(step_plan.compute_dtype).name
        == resolve_compute_dtype("auto", here)
        == plan(cfg, here)["compute_dtype"]
    )
    assert step_plan.cfg.precision.compute_dtype == resolve_compute_dtype("auto", here)
    # The one exception: a model built outside a step plan (e.g. by hand, `model.attention: auto` unresolved)
    # resolves its attention when called.
    outside_a_plan = {"jaxpar.model.layers"}
    for module, path in _modules(PACKAGE).items():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        found = re.search(r"resolve_(compute_dtype|attention)\([^)]*default_backend", text)
        assert bool(found) == (module in outside_a_plan), module


def test_byte_formatting_has_one_source():
    from jaxpar.analysis.planner import report as plan_report
    from jaxpar.analysis.sweep import report as sweep_report
    from jaxpar.log import human_bytes

    assert [human_bytes(x) for x in (None, 512, 431_400, 26e9, -3e12)] == ["-", "512 B", "431.4 kB", "26 GB", "-3 TB"]
    assert plan_report.human_bytes is human_bytes and sweep_report.human_bytes is human_bytes
