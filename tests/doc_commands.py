"""The command lines documented in the repository, extracted and parsed for tests/system/test_documented_commands.py.

Sources: README.md; every file of tools/ (the module docstring of a .py file, the `#` comments of any other
file); the module docstrings of examples/*.py, benchmarks/*.py and of jaxpar/cli/*.py (the --help texts); the `#`
comments of configs/**/*.yaml.

A command line is
  * in README.md: each line of a fenced shell code block (no language, bash or sh; `\\` continuations joined;
    comment lines skipped; a ```python block is a script, run by tests/system/test_public_api.py), and each
    inline code span whose text is a program followed by at least one argument;
  * in docstrings and comments: such an inline code span; a line whose text starts with a program, joined with
    the non-blank lines below it that are indented deeper (continuations); or the rest of a line after ": " when
    it starts with a program.
A program is `python`, `python3`, `pip`, `pip3`, `pytest`, `sbatch`, `srun`, `tensorboard` or any `jaxpar-*`
name, optionally behind `.venv/bin/` and `NAME=value` environment assignments. A trailing `# comment` is not
part of the command. Commands are deduplicated by their normalised words (`.venv/bin/` dropped), keeping every
place they appear.

Usage brackets: an optional group `[...]` (a `[` at the start of a word) is dropped when it holds a placeholder
(an upper-case word such as CONFIG or N, `key=value`, or `...`) and unwrapped otherwise, so `[--quick]` runs as
`--quick`. A command with a placeholder left after that is a synopsis: it cannot run as written.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import os
import re
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = re.compile(
    r"(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:\.venv/bin/)?"
    r"(?:python3?|pip3?|pytest|sbatch|srun|tensorboard|jaxpar-[A-Za-z0-9_-]+)(?=\s|$)"
)
_SPAN = re.compile(r"`([^`]+)`")
_OPTIONAL = re.compile(r"(?<!\S)\[([^\[\]]*)\]")
_PLACEHOLDER_WORD = re.compile(r"[A-Z][A-Z0-9_]*(?:\.[a-z]+)?")
_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


@dataclasses.dataclass
class Documented:
    """One documented command: `text` as written (continuations joined, trailing comment dropped) and every
    `where` (file:line) it appears."""

    text: str
    where: list[str]

    @property
    def parts(self) -> list[list[str]]:
        """The words of each `&&`-separated part, optional brackets resolved (module docstring)."""
        words = shlex.split(resolve_brackets(self.text), comments=True)
        parts, current = [], []
        for w in words:
            if w == "&&":
                parts.append(current)
                current = []
            else:
                current.append(w)
        return [*parts, current]

    @property
    def is_synopsis(self) -> bool:
        return any(is_placeholder(w) for part in self.parts for w in part)


def is_placeholder(word: str) -> bool:
    """CONFIG, RUN_DIR, SWEEP.yaml, N, `...`, or a path with such a component (RUN/checkpoints/STEP)."""
    if word == "..." or word.endswith("..."):
        return True
    if _ENV.fullmatch(word) and "." not in word.split("=", 1)[0]:  # NAME=value: an environment assignment
        return False
    return any(_PLACEHOLDER_WORD.fullmatch(c) for c in word.split("/"))


def resolve_brackets(text: str) -> str:
    """Drops optional groups holding a placeholder, unwraps the others (innermost first)."""

    def one(m: re.Match) -> str:
        inner = m.group(1)
        words = inner.split()
        if not words or any(is_placeholder(w) or ("=" in w and not w.startswith("-")) for w in words):
            return ""
        return inner

    resolved = text
    while (new := _OPTIONAL.sub(one, resolved)) != resolved:
        resolved = new
    return text if resolved == text else " ".join(resolved.split())


def _strip_comment(text: str) -> str:
    """`cmd args  # note` -> `cmd args`: the first `#` after whitespace that is outside quotes starts a comment."""
    for m in re.finditer(r"\s#", text):
        try:
            shlex.split(text[: m.start()])
        except ValueError:  # an open quote: the # is inside it
            continue
        return text[: m.start()].strip()
    return text.strip()


def _is_command(text: str) -> bool:
    m = PROGRAM.match(text)
    return m is not None and text[m.end() :].strip() != ""


def _from_prose(lines: list[str], first_line: int, rel: str) -> list[tuple[str, str]]:
    """Commands in docstring or comment lines (module docstring); `first_line` is the 1-based line of lines[0]."""
    found = _spans(lines, first_line, rel)
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        where = f"{rel}:{first_line + i}"
        if _is_command(stripped):
            indent = len(line) - len(line.lstrip())
            text = stripped
            while (
                i + 1 < len(lines) and lines[i + 1].strip() and len(lines[i + 1]) - len(lines[i + 1].lstrip()) > indent
            ):
                i += 1
                text += " " + lines[i].strip()
            found.append((_strip_comment(text), where))
        else:
            plain = _SPAN.sub(lambda s: "`" + "x" * len(s.group(1)) + "`", line)  # ": " inside spans is not prose
            for cut in re.finditer(r": ", plain):
                rest = line[cut.end() :].strip()
                if _is_command(rest):
                    found.append((_strip_comment(rest), where))
                    break
        i += 1
    return found


def _docstring(path: str) -> tuple[list[str], int]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    node = tree.body[0] if tree.body else None
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
        return [], 1
    return node.value.value.split("\n"), node.lineno


def _comments(path: str) -> list[tuple[list[str], int]]:
    """Runs of consecutive `#` comment lines (without `#!` and `#SBATCH`-style directives), with their first line."""
    runs, current, start = [], [], 0
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            m = re.match(r"\s*#(?![!A-Z])(.*)$", line.rstrip("\n"))
            if m is None:
                m = re.match(r".*?\s#(?![!A-Z])(.*)$", line.rstrip("\n"))  # a trailing comment on a YAML line
                if m is not None:
                    runs.append(([m.group(1)], n))
                if current:
                    runs.append((current, start))
                current = []
                continue
            if not current:
                start = n
            current.append(m.group(1))
    if current:
        runs.append((current, start))
    return runs


def _readme_spans(path: str, rel: str) -> list[tuple[str, str]]:
    """Inline spans of README prose (outside fences), with their line numbers."""
    found = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    fence, block, block_start = False, [], 1
    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            if fence and block:
                found += _spans(block, block_start, rel)
            block, block_start = [], n + 1
            continue
        if not fence:
            block.append(line)
    return found + (_spans(block, block_start, rel) if block else [])


def _spans(lines: list[str], first_line: int, rel: str) -> list[tuple[str, str]]:
    joined = "\n".join(lines)
    return [
        (" ".join(m.group(1).split()), f"{rel}:{first_line + joined.count(chr(10), 0, m.start())}")
        for m in _SPAN.finditer(joined)
        if _is_command(" ".join(m.group(1).split()))
    ]


def _readme_fences(path: str, rel: str) -> list[tuple[str, str]]:
    found = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    fence, pending, pending_line, shell = False, "", 0, True
    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            shell = line.strip()[3:] in ("", "bash", "sh", "console")  # a ```python block is a program
            continue
        if not fence or not shell:
            continue
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        pending_line = pending_line if pending else n
        pending = f"{pending} {stripped.rstrip(chr(92)).strip()}".strip()
        if not stripped.endswith("\\"):
            found.append((_strip_comment(pending), f"{rel}:{pending_line}"))
            pending = ""
    return found


def pyproject_section(name: str) -> dict[str, str]:
    """`key = value` lines of one [section] of pyproject.toml, values as written (Python 3.10 has no tomllib)."""
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(rf"^\[{re.escape(name)}\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert m, f"pyproject.toml has no [{name}]"
    return {k.strip().strip('"'): v.strip() for k, v in re.findall(r"^([\w\"-]+)\s*=\s*(.+)$", m.group(1), re.M)}


def source_files() -> list[str]:
    """Every file searched, relative to the repository root."""
    files = ["README.md"]
    files += sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tools", "*")) if os.path.isfile(p))
    files += sorted(
        os.path.relpath(p, ROOT)
        for p in [
            *glob.glob(os.path.join(ROOT, "examples", "*.py")),
            *glob.glob(os.path.join(ROOT, "benchmarks", "*.py")),
        ]
    )
    files += sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "jaxpar", "cli", "*.py")))
    files += sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True)
    )
    return files


def extract() -> list[Documented]:
    """Every documented command, deduplicated (module docstring), in order of first appearance."""
    found: list[tuple[str, str]] = []
    for rel in source_files():
        path = os.path.join(ROOT, rel)
        if rel == "README.md":
            found += _readme_fences(path, rel) + _readme_spans(path, rel)
        elif rel.endswith(".py"):
            lines, start = _docstring(path)
            found += _from_prose(lines, start, rel)
        else:
            for lines, start in _comments(path):
                found += _from_prose(lines, start, rel)
    by_key: dict[tuple, Documented] = {}
    for text, where in found:
        key = tuple(w.removeprefix(".venv/bin/") for w in shlex.split(resolve_brackets(text), comments=True))
        if key in by_key:
            by_key[key].where.append(where)
        else:
            by_key[key] = Documented(text, [where])
    return list(by_key.values())
