"""Library messages go through `logging` (jaxpar.log): a script can silence or redirect them; the commands print
plain lines, info and warnings on stdout, errors on stderr; the training core has no print()."""

from __future__ import annotations

import ast
import logging
import os

import pytest

from jaxpar.log import LOGGER, configure_logging

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_core_never_prints():
    found = []
    for d, dirs, files in os.walk(os.path.join(ROOT, "jaxpar")):
        dirs[:] = [x for x in dirs if x not in ("cli", "analysis", "configs", "__pycache__")]
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                        found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
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
