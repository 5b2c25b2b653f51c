"""The package shows its architecture: the training core never imports the analysis tools or the commands.

Core: every module of jaxpar/ outside jaxpar/analysis/ and jaxpar/cli/. Imports are read from the source (module
level and inside functions), so a lazy import counts too.
"""

from __future__ import annotations

import ast
import os
import re
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


# Each concept's names are spelled out once, in the module named here, and imported everywhere else. A config
# key's vocabulary lives in the config layer (`jaxpar.config.choices` where an implementation above the config
# maps each name, beside the key's own checks otherwise).
ONE_SOURCE = {
    "mesh axes": ({"data", "pipeline", "fsdp", "context", "tensor"}, "jaxpar.config.mesh_axes"),
    "platforms": ({"gpu", "tpu", "cpu"}, "jaxpar.config.precision"),
    "float dtypes": ({"float32", "bfloat16"}, "jaxpar.config.precision"),
    "batch keys": ({"inputs", "targets", "loss_mask"}, "jaxpar.data.batch"),
    "remat policies": ({"none", "dots", "names", "full"}, "jaxpar.config.choices"),
    "pipeline schedules": ({"1f1b", "gpipe", "zb-h1", "zb-v"}, "jaxpar.config.choices"),
    "rotary scalings": ({"none", "linear", "llama3"}, "jaxpar.config.choices"),
    "learning-rate decays": ({"cosine", "linear", "constant"}, "jaxpar.config.choices"),
    "text sources": ({"stdlib", "text", "jsonl"}, "jaxpar.config.data_sources"),
    "token sources": ({"tokens", "shards"}, "jaxpar.config.data_sources"),
    "generated sources": ({"synthetic"}, "jaxpar.config.data_sources"),
    "token dtypes": ({"uint16", "uint32"}, "jaxpar.config.data_sources"),
    "attention implementations": ({"auto", "xla", "cudnn"}, "jaxpar.config.attention"),
    "corpus formats": ({"text", "jsonl", "parquet"}, "jaxpar.data.corpus_files"),
}
# Literals that spell a concept out again on purpose, each with its reason.
ONE_SOURCE_ALSO = {
    # the order the acceptance run tries the policies in; checked at import to be an order of REMAT_POLICIES
    ("remat policies", "jaxpar.analysis.gpu.acceptance"),
}


def test_each_concept_is_spelled_out_in_one_module():
    found: dict[str, list[str]] = {name: [] for name in ONE_SOURCE}
    for module, path in _modules(PACKAGE).items():
        for line, names in _literal_tuples(path):
            for concept, (want, _) in ONE_SOURCE.items():
                if set(names) != want or len(names) != len(want) or (concept, module) in ONE_SOURCE_ALSO:
                    continue
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
    assert _byte_formatters(FORMATTER_SAMPLE) == [4, 5, 6]
    found = []
    for top in ("jaxpar", "benchmarks", "examples", "tools"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in sorted(files):
                rel = os.path.relpath(os.path.join(d, f), ROOT)
                if f.endswith(".py") and rel not in OWN_BYTE_UNITS:
                    with open(os.path.join(d, f), encoding="utf-8") as fh:
                        found += [f"{rel}:{line}" for line in _byte_formatters(fh.read())]
    assert found == [], "format bytes with jaxpar.log.human_bytes (or say why not in OWN_BYTE_UNITS)"


JAX_PRIVATE = os.path.join("jaxpar", "parallel", "jax_private.py")


def _jax_src_uses(source: str, path: str = "<source>") -> list[int]:
    """Lines that reach jax's private modules: `import jax._src...`, `from jax._src... import`, `from jax import
    _src`, an attribute chain `jax._src...`, `getattr(jax, "_src")`, or a module name "jax._src..." passed to
    `importlib.import_module` / `__import__`. Strings elsewhere (docstrings, messages) are not uses."""

    def private(name: str) -> bool:
        return name == "jax._src" or name.startswith("jax._src.")

    lines = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import) and any(private(a.name) for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            if private(module) or (module == "jax" and any(a.name == "_src" for a in node.names)):
                lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "_src":
            base = node.value
            if isinstance(base, ast.Name) and base.id == "jax":
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            first = node.args[0]
            if name in ("import_module", "__import__") and isinstance(first, ast.Constant):
                if isinstance(first.value, str) and private(first.value):
                    lines.append(node.lineno)
            elif name == "getattr" and len(node.args) >= 2:
                owner, attr = node.args[0], node.args[1]
                if isinstance(owner, ast.Name) and owner.id == "jax" and isinstance(attr, ast.Constant):
                    if attr.value == "_src":
                        lines.append(node.lineno)
    return sorted(set(lines))


def test_jax_src_is_used_in_one_module():
    """jax's private modules (`jax._src`) are reached only through jaxpar.parallel.jax_private, whose docstring
    names each private name, why, and its public replacement; no code outside jaxpar/ uses them at all."""
    assert _jax_src_uses("import jax._src.core\nfrom jax._src import core\nfrom jax import _src\n") == [1, 2, 3]
    assert _jax_src_uses("import jax\nx = jax._src.core.eval_jaxpr\ny = getattr(jax, '_src')\n") == [2, 3]
    assert _jax_src_uses("import importlib\nm = importlib.import_module('jax._src.distributed')\n") == [2]
    assert _jax_src_uses('"""jax._src.core, in words."""\nimport jax.numpy\nsrc = "jax._src"\n') == []
    found = {}
    for top in ("jaxpar", "tests", "examples", "benchmarks", "tools"):
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [x for x in dirs if x not in ("__pycache__", "configs")]
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    rel = os.path.relpath(path, ROOT)
                    with open(path, encoding="utf-8") as fh:
                        lines = _jax_src_uses(fh.read(), path)
                    if lines and rel != JAX_PRIVATE:
                        found[rel] = lines
    assert found == {}, f"import these from jaxpar.parallel.jax_private (add a name there, with its reason): {found}"
    with open(os.path.join(ROOT, JAX_PRIVATE), encoding="utf-8") as fh:
        assert _jax_src_uses(fh.read())  # the scan sees the one module that may use them


# Text that points outside the repository instead of saying the fact: a source path of jax, XLA or Orbax, an
# installed-package path, an exact jax version (the requirement is a range, pyproject.toml), "as before".
_OUTSIDE = re.compile(
    r"jax/_src/|orbax/checkpoint/|xla/service/|site-packages/|\bjax(?:lib)? \d+\.\d+|\bas before\b|jax\._src\b"
)
_OUTSIDE_ALLOWED = {
    JAX_PRIVATE: "names each private jax module it imports, by design",
    os.path.join("tests", "unit", "test_architecture.py"): "this check's own patterns",
    os.path.join("tests", "system", "test_watchdog.py"): "a frame location inside jax, as the watchdog reports one",
}


def test_comments_state_facts_instead_of_pointing_outside_the_repository():
    """Comments, docstrings and configs say what is true (jax's compiler does X) rather than where to look in
    another project's source or which exact jax release it was seen on."""
    for pointer in ("see jax/_src/pjit.py", "on jax 0.10.2 it does", "works as before"):
        assert _OUTSIDE.search(pointer), pointer
    assert not _OUTSIDE.search("jax>=0.7.1, jax.numpy, the jax version of record")
    found = []
    for top in ("jaxpar", "tests", "examples", "benchmarks", "tools", "configs"):
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            for f in files:
                rel = os.path.relpath(os.path.join(d, f), ROOT)
                if not f.endswith((".py", ".yaml", ".json", ".txtpb", ".sh", ".sbatch", ".toml")):
                    continue
                if rel in _OUTSIDE_ALLOWED:
                    continue
                with open(os.path.join(d, f), encoding="utf-8") as fh:
                    found += [f"{rel}:{n}: {line.strip()}" for n, line in enumerate(fh, 1) if _OUTSIDE.search(line)]
    assert found == [], "\n".join(found)


# A number printed with a byte unit of its own: a formatted value followed by "kB", "MB", "GiB", ... (what
# `human_bytes` is for), or a binary unit named in a string.
_UNIT_AFTER = re.compile(r"^\s?(k|K|M|G|T)i?B\b")
_BINARY_UNIT = re.compile(r"\b(KiB|MiB|GiB|TiB)\b")
FORMATTER_SAMPLE = '''
def f(x):
    """Bytes in GiB (a docstring may say so)."""
    a = f"{x / 2**30:.1f} GiB"
    b = f"{x / 1e9:.2f} GB per device"
    return a, b, "peak MiB", human_bytes(x), f"{x} tokens"
'''
# Files whose byte units are their own, and why.
OWN_BYTE_UNITS = {
    os.path.join("jaxpar", "log.py"): "human_bytes itself",
    os.path.join("jaxpar", "analysis", "gpu", "check.py"): "a table whose byte columns share one unit and decimal",
    os.path.join("benchmarks", "data_rss.py"): "resident set sizes in MiB, as the kernel reports them in KiB",
    os.path.join("benchmarks", "hf_load_memory.py"): "resident set sizes in MiB, as the kernel reports them in KiB",
}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions."""
    kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, kinds)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def _byte_formatters(source: str) -> list[int]:
    """Lines of `source` that format a byte count by hand (docstrings aside)."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            for before, part in zip(node.values, node.values[1:]):
                if isinstance(before, ast.FormattedValue) and isinstance(part, ast.Constant):
                    if _UNIT_AFTER.match(part.value):
                        lines.add(node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if _BINARY_UNIT.search(node.value):
                lines.add(node.lineno)
    return sorted(lines)


# Strings equal to a mesh axis's name that name something else: {file: ({string: count}, what they name)}.
NOT_AXIS_NAMES = {
    "jaxpar/config/data_sources.py": ({"data": 1}, "the `data` config section, prefixing error messages"),
    "jaxpar/config/extras.py": ({"data": 1}, "the `data` extra of pyproject.toml"),
    "jaxpar/training/init_from.py": ({"data": 3}, "the `data` config section"),
    "jaxpar/checkpoint/info.py": ({"data": 4}, "a checkpoint's data position and the `data` config section"),
    "jaxpar/checkpoint/store.py": ({"data": 1}, "a checkpoint step's `data` item, the data loader's position"),
    "jaxpar/training/start_state.py": ({"data": 1}, "a checkpoint step's `data` item, read before a resume"),
    "jaxpar/analysis/planner/plan.py": ({"pipeline": 1}, "the plan's `pipeline` section"),
    "jaxpar/analysis/planner/report.py": ({"pipeline": 2}, "the plan's `pipeline` section"),
    "jaxpar/analysis/sweep/run.py": ({"pipeline": 1}, "the plan's `pipeline` section"),
    "jaxpar/analysis/gpu/check.py": (
        {"tensor": 1, "pipeline": 5, "context": 2},
        "the `tensor`, `pipeline` and `context` config sections",
    ),
    "jaxpar/analysis/bench/report.py": ({"tensor": 2, "pipeline": 5}, "the report's row groups"),
}


def _axis_name_literals(source: str, names: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, string) of every string constant in `source` equal to one of `names`, except docstrings and the
    text of f-strings."""
    tree = ast.parse(source)
    text = _docstrings(tree) | {
        id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values
    }
    return sorted(
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in names and id(node) not in text
    )


def test_mesh_axes_are_named_through_constants():
    """Code names a mesh axis through `jaxpar.config.mesh_axes` (DATA, FSDP, TENSOR, PIPELINE and the axis
    groups), never with a string of its own: an AST scan of jaxpar/ outside that module."""
    from jaxpar.config.mesh_axes import MESH_AXES

    sample = 'def f(x):\n    """On "data"."""\n    return P("fsdp"), f"mesh.data={x}", x["tensor"], DATA\n'
    assert _axis_name_literals(sample, MESH_AXES) == [(3, "fsdp"), (3, "tensor")]
    found, counted = [], {}
    for module, path in _modules(PACKAGE).items():
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        if module == "jaxpar.config.mesh_axes":
            continue
        with open(path, encoding="utf-8") as f:
            hits = _axis_name_literals(f.read(), MESH_AXES)
        if rel in NOT_AXIS_NAMES:
            counted[rel] = {name: sum(1 for _, n in hits if n == name) for name in {n for _, n in hits}}
        else:
            found += [f"{rel}:{line}: {name!r}" for line, name in hits]
    assert found == [], "name mesh axes with jaxpar.config.mesh_axes's constants"
    assert counted == {rel: want for rel, (want, _) in NOT_AXIS_NAMES.items()}


# A glossary entry: a letter (upper case, or one or two lower-case letters) at the start of a column, its meaning
# up to the next column.
_COLUMN = re.compile(r"(?:^ {4}|(?<=\S) {2,})([A-Z]|[a-z]{1,2}) {1,2}(\S.*?)(?= {2,}(?:[A-Z]|[a-z]{1,2}) |$)")
# A module's own key: "Shape letters: B batch, ...", "Shape key: ...", "Letters as in `module`; ...", up to the
# end of its paragraph.
_KEY = re.compile(r"(?:Shape letters|Shape key|[Ll]etters)(?: as in [^:;]*?)?[:;](.*?)(?:\n\s*\n|$)", re.S)
_ITEM = re.compile(r"^\s*([A-Za-z]{1,2})'?(?::\s*|\s+)(?:=\s*)?(\S.*)$")
_FILLER = {"the", "of", "a", "an", "in", "per", "and", "or", "on", "by", "its", "one", "each", "size", "sizes", "mesh"}


def _glossary() -> dict[str, str]:
    """{letter: meaning} of the glossary in `jaxpar`'s docstring (its two tables of letters)."""
    doc = ast.get_docstring(ast.parse(open(os.path.join(PACKAGE, "__init__.py"), encoding="utf-8").read()))
    table = doc.split("Shape letters", 1)[1]
    return {m.group(1): m.group(2) for line in table.splitlines() for m in _COLUMN.finditer(line)}


def _outside_brackets(text: str) -> str:
    out, depth = [], 0
    for ch in text:
        depth += ch in "([{"
        if not depth:
            out.append(ch)
        depth -= ch in ")]}" and depth > 0
    return "".join(out)


def _letter_key(doc: str) -> dict[str, str]:
    """{letter: meaning} of the letter keys in a module docstring (bracketed asides dropped)."""
    out: dict[str, str] = {}
    for key in _KEY.finditer(doc):
        for part in re.split(r",|;| and |\. ", _outside_brackets(" ".join(key.group(1).split()))):
            item = _ITEM.match(part)
            if item:
                out.setdefault(item.group(1), item.group(2).strip(" ."))
    return out


def _words(text: str) -> set[str]:
    words = {w.removesuffix("s") if len(w) > 3 else w for w in re.findall(r"[a-z0-9_]+", text.lower())}
    return words - _FILLER


def test_shape_letters_have_one_meaning():
    """Every module that keys its own shape letters gives each glossary letter (the `jaxpar` docstring) a meaning
    that shares a word with the glossary's: "G global batch" where G is key/value heads fails."""
    glossary = _glossary()
    assert {"B", "T", "D", "G", "K", "S", "M", "A", "Q", "k", "b", "ep"} <= set(glossary), sorted(glossary)
    assert _letter_key("Shape letters: B rows, K top_k (the experts per token), S sources.\n\nMore.") == {
        "B": "rows",
        "K": "top_k",
        "S": "sources",
    }
    wrong = []
    for module, path in _modules(PACKAGE).items():
        if module == "jaxpar":
            continue
        doc = ast.get_docstring(ast.parse(open(path, encoding="utf-8").read())) or ""
        for letter, meaning in _letter_key(doc).items():
            if letter in glossary and not _words(meaning) & _words(glossary[letter]):
                wrong.append(f"{module}: {letter} {meaning!r}, the glossary's {letter} is {glossary[letter]!r}")
    assert wrong == []


# The packages, bottom to top, and which others each may import (jaxpar.log and jaxpar's lazy API aside). A new
# edge is a design decision: add it here, in the direction of the layers, or move the code.
LAYERS = {
    "config": set(),
    "checkpoint": {"config"},
    "parallel": {"config"},
    "data": {"config"},
    "model": {"config", "parallel"},
    "training": {"config", "parallel", "model", "data", "checkpoint"},
    "analysis.hlo": {"config", "parallel"},
    "analysis.planner": {"config", "parallel", "model", "data", "training", "analysis.hlo"},
    "analysis.gpu": {"config", "parallel", "model", "data", "training", "analysis.hlo", "analysis.planner"},
    "analysis.sweep": {"config", "parallel", "model", "data", "training", "analysis.planner", "analysis.gpu"},
    "analysis.bench": {"config", "parallel", "model", "data", "training", "analysis.hlo", "analysis.planner"},
    "cli": {"config", "parallel", "model", "data", "checkpoint", "training", "analysis.planner", "analysis.gpu"}
    | {"analysis.sweep", "analysis.bench", "analysis.hlo"},
}


def _package(module: str) -> str | None:
    """The LAYERS key a module belongs to (None for the root modules)."""
    parts = module.split(".")[1:]
    if not parts or len(parts) == 1 and parts[0] in ("log",):
        return None
    if parts[0] == "analysis":
        return ".".join(parts[:2]) if len(parts) > 1 else None
    return parts[0]


def test_the_package_root_holds_only_the_api_and_logging():
    files = {f for f in os.listdir(PACKAGE) if f.endswith(".py")}
    assert files == {"__init__.py", "log.py"}, "a root module belongs in the package of its concern"
    assert {f for f in os.listdir(os.path.join(PACKAGE, "analysis")) if f.endswith(".py")} == {"__init__.py"}


def test_packages_import_only_the_layers_below_them():
    """Package-level imports (inside functions too) follow LAYERS: config imports nothing above it, the core never
    imports analysis or cli, and the analysis subpackages import one another only downwards."""
    modules = _modules(PACKAGE)
    assert {_package(m) for m in modules} - {None} == set(LAYERS)
    bad = {}
    for m, path in modules.items():
        own = _package(m)
        for i in _imports(path, m):
            other = _package(i) if i in modules else None
            if own and other and other != own and other not in LAYERS[own]:
                bad.setdefault(m, set()).add(i)
    assert bad == {}
    graph = {p: set(deps) for p, deps in LAYERS.items()}
    assert _cycles(graph) == []  # the table itself is a hierarchy
