"""The command lines the repository documents, found for tests/system/test_documented_commands.py.

Where a command is:
  * README.md and docs/*.md: every line of a fenced block marked ```bash (or sh, shell, console). A ```python block
    is a script (tests/system/test_public_api.py runs the one in docs/api.md); any other block is text.
  * The module docstrings of jaxpar/cli/*.py (their --help texts), examples/*.py, benchmarks/*.py and tools/*.py,
    and the `#` comments of tools/*.sbatch and configs/**/*.yaml: every line indented by two or more spaces whose
    first word is a program (`jaxpar-*`, `python`, `python3`, `pip`, `sbatch`, optionally behind `.venv/bin/`),
    joined with the lines below it that are indented deeper.
A line ending in `\\` continues on the next. Blank lines and lines that start with `#` are skipped; a `#` that
follows a space outside quotes starts a comment. `&&` separates the parts of one command. A command is kept once
(`.venv/bin/` aside), with every place it appears.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import os
import re
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHELL_FENCES = ("bash", "sh", "shell", "console")
_PROGRAM = re.compile(r"(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:\.venv/bin/)?(?:jaxpar-[\w-]+|python3?|pip|sbatch)(?:\s|$)")
_ENV = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")
_PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*(?:\.[a-z]+)?")


@dataclasses.dataclass(frozen=True)
class Part:
    """One `&&`-separated part: environment assignments, the program (`.venv/bin/` dropped) and its arguments."""

    env: tuple[str, ...]
    program: str
    args: tuple[str, ...]

    @property
    def script(self) -> str | None:
        """The repository file of `python FILE ...`, else None."""
        if self.program in ("python", "python3") and self.args and not self.args[0].startswith("-"):
            return self.args[0]
        return None

    @property
    def text(self) -> str:
        return shlex.join([*self.env, self.program, *self.args])


@dataclasses.dataclass
class Command:
    """A documented command as written (continuations joined, comment dropped) and where it appears (file:line)."""

    text: str
    where: list[str]

    @property
    def parts(self) -> list[Part]:
        words, parts, current = shlex.split(self.text, comments=True), [], []
        for w in [*words, "&&"]:
            if w != "&&":
                current.append(w)
                continue
            env = []
            while current and _ENV.fullmatch(current[0]) and "." not in current[0].split("=")[0]:
                env.append(current.pop(0))
            parts.append(Part(tuple(env), current[0].removeprefix(".venv/bin/"), tuple(current[1:])))
            current = []
        return parts

    @property
    def is_synopsis(self) -> bool:
        """A usage line: it holds a placeholder (CONFIG, N, [--flag X], key=value ..., RUN/checkpoints/STEP)."""
        return any(is_placeholder(w) for p in self.parts for w in p.args)


def is_placeholder(word: str) -> bool:
    if word.startswith("[") or (word.endswith("]") and "[" not in word) or word.endswith("..."):
        return True
    return any(_PLACEHOLDER.fullmatch(c) for c in word.split("/"))


def _fenced(lines: list[str], rel: str) -> list[tuple[str, str]]:
    found, shell, fence, pending, start = [], False, False, "", 0
    for n, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence, shell = not fence, stripped[3:].strip() in SHELL_FENCES
            continue
        if not (fence and shell) or (not pending and (not stripped or stripped.startswith("#"))):
            continue
        start = start if pending else n
        pending = f"{pending} {stripped.removesuffix(chr(92)).strip()}".strip()
        if not stripped.endswith("\\"):
            found.append((pending, f"{rel}:{start}"))
            pending = ""
    return found


def _indented(lines: list[str], first: int, rel: str) -> list[tuple[str, str]]:
    """Commands among docstring or comment lines (module docstring); `first` is the file line of lines[0]."""
    found, i = [], 0
    while i < len(lines):
        line = lines[i]
        indent = len(line) - len(line.lstrip())
        if indent >= 2 and _PROGRAM.match(line.strip()):
            text, start = line.strip(), i
            while (
                i + 1 < len(lines) and lines[i + 1].strip() and len(lines[i + 1]) - len(lines[i + 1].lstrip()) > indent
            ):
                i += 1
                text += " " + lines[i].strip()
            found.append((text, f"{rel}:{first + start}"))
        i += 1
    return found


def _docstring(path: str) -> tuple[list[str], int]:
    with open(path, encoding="utf-8") as f:
        body = ast.parse(f.read()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        if isinstance(body[0].value.value, str):
            return body[0].value.value.split("\n"), body[0].lineno
    return [], 1


def _comments(path: str) -> list[tuple[list[str], int]]:
    """Runs of consecutive `#` comment lines (the text after `#`) with the line of each run's first; a trailing
    comment is a run of its own; `#!` and `#SBATCH`-style directives are not comments."""
    runs: list[tuple[list[str], int]] = []
    last = -1
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            whole = re.match(r"\s*#(?![!A-Z])(.*)$", line.rstrip("\n"))
            trailing = None if whole else re.match(r".*?\s#(?![!A-Z])(.*)$", line.rstrip("\n"))
            if whole and last == n - 1:
                runs[-1][0].append(whole.group(1))
            elif whole or trailing:
                runs.append(([(whole or trailing).group(1)], n))
            last = n if whole else -1
    return runs


def markdown_files() -> list[str]:
    """README.md and the pages of docs/, relative to the repository root."""
    return ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def source_files() -> list[str]:
    """Every file searched, relative to the repository root (module docstring)."""
    patterns = ["jaxpar/cli/*.py", "examples/*.py", "benchmarks/*.py", "tools/*", "configs/**/*.yaml"]
    files = [
        os.path.relpath(p, ROOT) for pat in patterns for p in sorted(glob.glob(os.path.join(ROOT, pat), recursive=True))
    ]
    return markdown_files() + [f for f in files if os.path.isfile(os.path.join(ROOT, f))]


def extract() -> list[Command]:
    """Every documented command, kept once, in order of first appearance."""
    found: list[tuple[str, str]] = []
    for rel in source_files():
        path = os.path.join(ROOT, rel)
        if rel.endswith(".md"):
            with open(path, encoding="utf-8") as f:
                found += _fenced(f.read().split("\n"), rel)
        elif rel.endswith(".py"):
            lines, first = _docstring(path)
            found += _indented(lines, first, rel)
        else:
            for lines, first in _comments(path):
                found += _indented(lines, first, rel)
    by_words: dict[tuple, Command] = {}
    for text, where in found:
        key = tuple(w.removeprefix(".venv/bin/") for w in shlex.split(text, comments=True))
        if key in by_words:
            by_words[key].where.append(where)
        else:
            by_words[key] = Command(text, [where])
    return list(by_words.values())


def pyproject_section(name: str) -> dict[str, str]:
    """`key = value` lines of one [section] of pyproject.toml, values as written (Python 3.10 has no tomllib)."""
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(rf"^\[{re.escape(name)}\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert m, f"pyproject.toml has no [{name}]"
    return {k.strip().strip('"'): v.strip() for k, v in re.findall(r"^([\w\"-]+)\s*=\s*(.+)$", m.group(1), re.M)}
