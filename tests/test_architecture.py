"""The package shows its architecture: the training core never imports the analysis tools or the commands.

Core: every module of jaxpar/ outside jaxpar/analysis/ and jaxpar/cli/. Imports are read from the source (module
level and inside functions), so a lazy import counts too.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def test_core_never_imports_analysis_or_cli():
    core = {m: p for m, p in _modules(PACKAGE).items()
            if not m.startswith(("jaxpar.analysis", "jaxpar.cli"))}
    assert "jaxpar.train.loop" in core and "jaxpar.train.step" in core
    bad = {m: sorted(i for i in _imports(p, m) if i.startswith(("jaxpar.analysis", "jaxpar.cli")))
           for m, p in core.items()}
    assert {m: v for m, v in bad.items() if v} == {}


def test_analysis_is_a_package_of_its_own():
    analysis = _modules(os.path.join(PACKAGE, "analysis"))
    for name in ("jaxpar.analysis.plan", "jaxpar.analysis.sweep", "jaxpar.analysis.hlo", "jaxpar.analysis.memory",
                 "jaxpar.analysis.plan_gpu", "jaxpar.analysis.gpu_targets"):
        assert name in analysis
    top = {m for m in _modules(PACKAGE) if m.count(".") == 1}
    assert not top & {"jaxpar.plan", "jaxpar.sweep", "jaxpar.hlo", "jaxpar.memory", "jaxpar.comm"}
