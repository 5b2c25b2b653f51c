"""Every command given a bad path: a missing one, a file where a directory belongs, a directory it cannot write, and
what a write cut short leaves behind. Each answers with one line naming the path, the problem and the fix, exits
non-zero (2 for usage errors; jaxpar-launch as a shell does, 127 / 126) without a traceback, and before any work
(the step that would do it is replaced by one that fails the test). In-process `main()` calls: no subprocess.

The tests run as root here, and root writes into a directory whatever its mode, so `read_only` makes the directory
0555 and, where that leaves it writable (root), makes `os.access` report it unwritable as it is to any other
user; the commands check their output directory with `os.access` and a probe file
(`jaxpar.config.paths.output_dir_problem`) before they start.
"""

from __future__ import annotations

import os

import pytest
import yaml

from jaxpar.cli import checkpoints, data, launch, plan, sweep, train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
SWEEP = os.path.join(ROOT, "configs", "sweeps", "tiny_two_meshes.yaml")
HF = os.path.join(ROOT, "tests", "fixtures", "hf_llama_untied")
RUN = "train.run_dir={tmp}/run"  # a fresh run: model.init_from is read


@pytest.fixture
def paths(tmp_path, monkeypatch):
    """{name: path}: `file` (a regular file), `missing`, `read_only` (a directory no one may write in, see the module
    docstring) and `tmp`; and every command's work replaced by a failure, so a command that does not refuse first
    fails the test."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.access(ro, os.W_OK):  # root: the mode does not stop it
        real = os.access

        def access(path, mode, *args, **kwargs):
            if mode & os.W_OK and os.path.abspath(path).startswith(str(ro)):
                return False
            return real(path, mode, *args, **kwargs)

        monkeypatch.setattr(os, "access", access)

    def never(what):
        def fail(*args, **kwargs):
            raise AssertionError(f"{what} ran before the path was refused")

        return fail

    from jaxpar.analysis.sweep import run as sweep_run
    from jaxpar.data import tokenize_corpus
    from jaxpar.parallel import mesh
    from jaxpar.training import loop

    monkeypatch.setattr(loop, "build_mesh", never("the training run"))
    monkeypatch.setattr(sweep_run, "run_point", never("a sweep point"))
    monkeypatch.setattr(tokenize_corpus, "_run", never("tokenizing"))
    # import-hf and export-hf: their mesh of every device comes after the checks, before any weight is read
    monkeypatch.setattr(mesh, "process_mesh", never("the import or export"))
    monkeypatch.setattr(launch, "launch", never("a process"))
    yield {"tmp": str(tmp_path), "file": str(afile), "missing": str(tmp_path / "missing"), "read_only": str(ro)}
    ro.chmod(0o755)


def _interrupted_sweep(p):
    """results.json cut off mid-write (by a writer that was not atomic)."""
    out = os.path.join(p["tmp"], "sweep")
    os.makedirs(out)
    with open(os.path.join(out, "results.json"), "w") as f:
        f.write('{"base": "x", "points": [{"key": ')
    return out


def _interrupted_checkpoint(p):
    """A run whose only save was cut short: Orbax's temporary step directory, never renamed."""
    step = os.path.join(p["tmp"], "run", "checkpoints", "5.orbax-checkpoint-tmp-1700000000")
    os.makedirs(os.path.join(step, "state"))
    return os.path.dirname(os.path.dirname(step))


def _interrupted_import(p):
    """import-hf cut short after the checkpoint, before config.yaml."""
    run = os.path.join(p["tmp"], "imported")
    os.makedirs(os.path.join(run, "checkpoints", "0"))
    return run


def _interrupted_export(p):
    """export-hf cut short: weights written, config.json (written last) not."""
    out = os.path.join(p["tmp"], "exported")
    os.makedirs(out)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(b"\x00" * 8)
    return out


# (command, argv with {placeholders} from `paths` or a setup's {made} path, exit status, what the line says)
CASES = {
    "train-missing-config": (train.main, ["{missing}.yaml"], 2, "does not exist; pass a path such as"),
    "train-config-is-a-dir": (train.main, ["{tmp}"], 2, "is a directory; pass a YAML file"),
    "train-run-dir-is-a-file": (train.main, [TINY, "train.run_dir={file}"], 2, "is a file; give a directory you"),
    "train-run-dir-read-only": (train.main, [TINY, "train.run_dir={read_only}"], 2, "is not writable; give a dir"),
    "train-run-dir-in-read-only": (
        train.main,
        [TINY, "train.run_dir={read_only}/run"],
        2,
        "cannot be created: {read_only} is not writable",
    ),
    "train-restore-missing": (
        train.main,
        [TINY, RUN, "--restore-from", "{missing}"],
        2,
        "does not exist; pass a run directory",
    ),
    "train-restore-is-a-file": (train.main, [TINY, RUN, "--restore-from", "{file}"], 2, "is a file, not a directory"),
    "train-init-from-is-a-file": (
        train.main,
        [TINY, RUN, "model.init_from={file}"],
        2,
        "is a file, not a directory; give",
    ),
    "plan-missing-config": (plan.main, ["{missing}.yaml"], 2, "does not exist; pass a path such as"),
    "plan-config-is-a-dir": (plan.main, ["{tmp}"], 2, "is a directory; pass a YAML file"),
    "sweep-missing-file": (sweep.main, ["{missing}.yaml"], 2, "does not exist; pass a path such as"),
    "sweep-file-is-a-dir": (sweep.main, ["{tmp}"], 2, "is a directory; pass a YAML file"),
    "sweep-out-is-a-file": (sweep.main, [SWEEP, "--out", "{file}"], 2, "is a file; pick another --out"),
    "sweep-out-read-only": (sweep.main, [SWEEP, "--out", "{read_only}"], 2, "is not writable; pick another --out"),
    "sweep-results-cut-short": (
        sweep.main,
        [SWEEP, "--out", "{made}"],
        2,
        "results.json is not a jaxpar-sweep results file",
        _interrupted_sweep,
    ),
    "data-missing-input": (
        data.main,
        ["tokenize", "{missing}", "--tokenizer", "byte", "--out", "{tmp}/shards"],
        2,
        "matches no file; give an existing file",
    ),
    "data-out-is-a-file": (
        data.main,
        ["tokenize", TINY, "--tokenizer", "byte", "--out", "{file}"],
        2,
        "is a file; give a directory you can write",
    ),
    "data-out-read-only": (
        data.main,
        ["tokenize", TINY, "--tokenizer", "byte", "--out", "{read_only}"],
        2,
        "is not writable; give a directory you can write",
    ),
    "checkpoints-missing": (checkpoints.main, ["{missing}"], 2, "does not exist; pass a run directory"),
    "checkpoints-on-a-file": (checkpoints.main, ["{file}"], 2, "is a file, not a directory; pass a run directory"),
    "checkpoints-save-cut-short": (
        checkpoints.main,
        ["{made}"],
        2,
        "no complete checkpoint in {made}/checkpoints (incomplete: 5.orbax-checkpoint-tmp",
        _interrupted_checkpoint,
    ),
    "import-hf-missing": (checkpoints.main, ["import-hf", "{missing}", "--out", "{tmp}/r"], 2, "does not exist; pass"),
    "import-hf-out-is-a-file": (checkpoints.main, ["import-hf", HF, "--out", "{file}"], 2, "is a file; import into"),
    "import-hf-out-read-only": (
        checkpoints.main,
        ["import-hf", HF, "--out", "{read_only}"],
        2,
        "is not writable; import into a new run directory",
    ),
    "import-hf-cut-short": (
        checkpoints.main,
        ["import-hf", HF, "--out", "{made}"],
        2,
        "but no config.yaml (written after the checkpoint: an import cut short?)",
        _interrupted_import,
    ),
    "export-hf-missing": (checkpoints.main, ["export-hf", "{missing}", "--out", "{tmp}/e"], 2, "does not exist; pass"),
    "export-hf-out-is-a-file": (checkpoints.main, ["export-hf", "{tmp}", "--out", "{file}"], 2, "is a file; export"),
    "export-hf-out-read-only": (
        checkpoints.main,
        ["export-hf", "{tmp}", "--out", "{read_only}"],
        2,
        "is not writable; export into a new or empty directory",
    ),
    "export-hf-cut-short": (
        checkpoints.main,
        ["export-hf", "{tmp}", "--out", "{made}"],
        2,
        "holds model.safetensors but no config.json (written last): an export that was cut short",
        _interrupted_export,
    ),
    "launch-missing": (launch.main, ["-n", "2", "--", "{missing}"], 127, "does not exist; give the path"),
    "launch-a-file": (launch.main, ["-n", "2", "--", "{file}"], 126, "is not executable; chmod +x it"),
    "launch-a-dir": (launch.main, ["-n", "2", "--", "{tmp}"], 126, "is a directory, not a program"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_path_gives_one_line_and_a_status(case, paths, capsys):
    main, argv, status, needle, *setup = CASES[case]
    names = dict(paths, made=setup[0](paths) if setup else "")
    argv = [a.format(**names) for a in argv]
    assert main(argv) == status
    err = capsys.readouterr().err
    prog = f"jaxpar-{main.__module__.rpartition('.')[2]}"
    lines = [line for line in err.splitlines() if line.startswith(prog)]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert needle.format(**names) in lines[0], lines[0]
    named = [
        names[k] for k in ("missing", "file", "read_only", "made", "tmp") if names[k] and names[k] in " ".join(argv)
    ]
    assert named[0] in lines[0], f"the path is not named: {lines[0]}"


def test_config_and_results_are_written_whole(tmp_path, monkeypatch):
    """A kill in the middle of writing a run's config.yaml (or a sweep's results.md, an export's config.json: the
    same `write_atomic`) leaves the previous file and no temporary one: the new file is renamed over it only once
    whole."""
    from jaxpar.config import load_config, save_config

    path = tmp_path / "config.yaml"
    old = load_config(TINY, num_devices=8)
    save_config(old, str(path))
    before = path.read_text()

    def killed(*args):
        raise KeyboardInterrupt  # as a signal arriving before the rename

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        save_config(load_config(TINY, ["train.steps=7"], num_devices=8), str(path))
    assert path.read_text() == before and os.listdir(tmp_path) == ["config.yaml"]
    assert yaml.safe_load(before)["train"]["steps"] == old.train.steps
