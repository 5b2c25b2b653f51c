"""Library messages go through `logging` (jaxpar.log): a script can silence or redirect them; the commands print
plain lines, info and warnings on stdout, errors on stderr; library code has no print()."""

from __future__ import annotations

import ast
import logging
import os

import pytest

from jaxpar.log import LOGGER, configure_logging

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# The ways around `logging` a library message could take: print(), warnings.warn, writing to sys.stdout /
# sys.stderr, tqdm.write. (A progress bar the user asks for, train.progress_bar or `jaxpar-data tokenize`'s, is a
# display, not a message.)
_AROUND_LOGGING = {"print", "warnings.warn", "sys.stdout.write", "sys.stderr.write", "tqdm.write"}


def _messages_around_logging(source: str) -> list[int]:
    """Lines of `source` that call one of `_AROUND_LOGGING`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
            if ast.unparse(node.func) in _AROUND_LOGGING:
                lines.append(node.lineno)
    return sorted(lines)


def test_library_code_speaks_only_through_logging():
    """Every module of jaxpar/ except the commands (jaxpar/cli/, which print their output) reports through
    `logging`, so that a script can silence or redirect every message."""
    sample = "print(1)\nwarnings.warn('x')\nsys.stderr.write('x')\ntqdm.write('x')\nlog.info('x')\nf.write('x')\n"
    assert _messages_around_logging(sample) == [1, 2, 3, 4]
    found = []
    for d, dirs, files in os.walk(os.path.join(ROOT, "jaxpar")):
        dirs[:] = [x for x in dirs if x not in ("cli", "configs", "__pycache__")]
        for f in files:
            path = os.path.join(d, f)
            if f.endswith(".py"):
                with open(path, encoding="utf-8") as fh:
                    found += [f"{os.path.relpath(path, ROOT)}:{n}" for n in _messages_around_logging(fh.read())]
    assert found == []


def test_training_messages_are_log_records(caplog):
    from jaxpar.training.loop import _log

    with caplog.at_level(logging.INFO, logger="jaxpar"):
        _log("step 0: val_loss 5.5")
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("jaxpar.training", "INFO", "step 0: val_loss 5.5")
    ]


@pytest.fixture
def clean_logger():
    """The "jaxpar" logger as a fresh process has it (an earlier test may have configured it), restored after."""
    saved = (list(LOGGER.handlers), LOGGER.level, LOGGER.propagate, getattr(LOGGER, "_jaxpar_configured", False))
    LOGGER.handlers[:] = [h for h in LOGGER.handlers if isinstance(h, logging.NullHandler)]
    LOGGER._jaxpar_configured = False
    yield
    LOGGER.handlers[:], LOGGER.level, LOGGER.propagate = saved[0], saved[1], saved[2]
    LOGGER._jaxpar_configured = saved[3]


def test_commands_print_plain_lines_and_scripts_can_silence_them(capsys, clean_logger):
    configure_logging()
    configure_logging()  # idempotent: one line per record, not two
    log = logging.getLogger("jaxpar.training")
    log.info("resumed at step 4")
    log.warning("jaxpar: injecting nan at step 5 on process 0")
    log.error("watchdog: no progress")
    out, err = capsys.readouterr()
    assert out == "resumed at step 4\njaxpar: injecting nan at step 5 on process 0\n"
    assert err == "watchdog: no progress\n"
    logging.getLogger("jaxpar").setLevel(logging.WARNING)  # what a script does to silence the progress lines
    log.info("hidden")
    assert capsys.readouterr().out == ""


def test_configured_lines_follow_a_swapped_stdout(capsys, clean_logger):
    """Configured once (e.g. by a command run in-process earlier), the lines still reach the current stdout."""
    import io
    import sys

    configure_logging()
    saved, sys.stdout = sys.stdout, io.StringIO()
    try:
        logging.getLogger("jaxpar.training").info("step 1")
        assert sys.stdout.getvalue() == "step 1\n"
    finally:
        sys.stdout = saved
