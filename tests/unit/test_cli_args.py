"""Command lines without a config: the error names the missing config path (not `overrides`) and shows the usage."""

import importlib.util
import os

import pytest

from jaxpar.cli import train as train_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _resolve_tool():
    spec = importlib.util.spec_from_file_location("resolve_config", os.path.join(ROOT, "tools", "resolve_config.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "main, argv, prog",
    [
        (train_cli.main, [], "jaxpar-train"),
        (train_cli.main, ["--cpu-devices", "8"], "jaxpar-train"),
        (lambda argv: _resolve_tool().main(argv), ["--devices", "8"], ""),  # prog is argv[0], here pytest's
    ],
    ids=["train", "train-flags-only", "resolve_config"],
)
def test_missing_config_path_is_named(main, argv, prog, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {prog}")
    error_line = err.strip().splitlines()[-1]
    assert "a config path is required" in error_line and "configs/tiny.yaml" in error_line
    assert "overrides" not in error_line


@pytest.mark.parametrize("devices", ["0", "-4"])
def test_resolve_config_refuses_device_counts_below_one(devices, capsys):
    assert _resolve_tool().main([os.path.join(ROOT, "configs", "tiny.yaml"), "--devices", devices]) == 2
    captured = capsys.readouterr()
    assert f"config error: device count {devices}: a mesh needs at least 1 device" in captured.err
    assert captured.out == ""


def test_run_dir_that_cannot_be_created_is_refused_before_device_work(tmp_path, monkeypatch, capsys):
    from jaxpar.training import loop

    def no_mesh(cfg):
        raise AssertionError("the mesh was built before train.run_dir was checked")

    monkeypatch.setattr(loop, "build_mesh", no_mesh)
    afile = tmp_path / "afile"
    afile.write_text("x")
    tiny = os.path.join(ROOT, "configs", "tiny.yaml")
    for run_dir, needle in (
        (afile / "sub", f"cannot be created: {afile} is a file, not a directory"),
        (afile, "is a file"),
        ("/proc/jaxpar-x", "cannot be created or written"),
    ):
        assert train_cli.main([tiny, f"train.run_dir={run_dir}"]) == 2
        err = capsys.readouterr().err
        assert f"config error: train.run_dir='{run_dir}' {needle}" in err and "e.g. train.run_dir=" in err
        assert "Traceback" not in err
    assert afile.read_text() == "x"


def test_run_dir_check_leaves_no_directories_behind(tmp_path):
    from jaxpar.training.start_state import check_run_dir

    check_run_dir(str(tmp_path / "new" / "run"))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    check_run_dir(str(tmp_path / "kept"))
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and list((tmp_path / "kept").iterdir()) == []


def test_run_dir_check_keeps_created_directories_with_several_processes(tmp_path, monkeypatch):
    """Processes check at the same time: one removing a directory another is probing would fail that one (the
    race a 2-process run of examples/own_model.py hit), so with several processes nothing is removed."""
    import jax

    from jaxpar.training.start_state import check_run_dir

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    check_run_dir(str(tmp_path / "new" / "run"))
    assert (tmp_path / "new" / "run").is_dir() and list((tmp_path / "new" / "run").iterdir()) == []


def test_launch_without_double_dash_hints_at_it(capsys):
    from jaxpar.cli import launch

    with pytest.raises(SystemExit) as exit_:
        launch.main(["-n", "2", "--devices-per-process", "4", ".venv/bin/jaxpar-train", "configs/tiny.yaml"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert (
        "unrecognized arguments: .venv/bin/jaxpar-train configs/tiny.yaml; put `--` before the command to "
        "run, e.g. jaxpar-launch -n N -- .venv/bin/jaxpar-train configs/tiny.yaml"
    ) in err
    with pytest.raises(SystemExit):  # a bad flag before `--` is only named
        launch.main(["-n", "2", "--bogus", "--", "true"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --bogus" in err and "put `--`" not in err


def test_resolve_config_docstring_commands_use_the_venv_python():
    """A bare `python` need not have jaxpar installed; the docs run tools with .venv/bin/python."""
    commands = [line.strip() for line in _resolve_tool().__doc__.splitlines() if "tools/resolve_config.py" in line]
    assert commands and all(c.startswith(".venv/bin/python tools/resolve_config.py ") for c in commands), commands


def test_a_failed_process_of_a_multi_process_run_exits_at_once(monkeypatch, capsys, tmp_path):
    """An unexpected error in one process of several ends it with status 1 through os._exit: Python's exit would
    wait in jax.distributed's shutdown for the other processes, which may be blocked in a collective with it."""
    from jaxpar.training import loop

    def fail(*args, **kwargs):
        raise RuntimeError("a collective timed out")

    class Exited(Exception):
        pass

    def exit_now(status):
        raise Exited(status)

    monkeypatch.setattr(loop, "train", fail)
    monkeypatch.setattr(train_cli.os, "_exit", exit_now)
    argv = [os.path.join(ROOT, "configs", "tiny.yaml"), f"train.run_dir={tmp_path}"]
    with pytest.raises(RuntimeError, match="timed out"):  # one process: the error propagates as usual
        train_cli.main(argv)
    monkeypatch.setattr(train_cli, "_multi_process", lambda: True)
    with pytest.raises(Exited) as exited:
        train_cli.main(argv)
    assert exited.value.args == (1,)
    err = capsys.readouterr().err
    assert "RuntimeError: a collective timed out" in err and "exiting without waiting for the other processes" in err
