"""Mesh sweeps (jaxpar.analysis.sweep.run, jaxpar.cli.sweep): sweep-file checks, the point grid, outputs, resume."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from jaxpar.analysis.planner.plan import plan
from jaxpar.analysis.sweep.report import objective_value
from jaxpar.analysis.sweep.run import SweepError, factorisations, load_sweep, points, run_sweep
from jaxpar.cli import sweep as sweep_cli
from jaxpar.config import load_config, resolve_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_YAML = os.path.join(ROOT, "configs", "tiny.yaml")
SMALL = [
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=128",
    "data.seq_len=8",
    "train.global_batch_size=8",
]


def _write(tmp_path, text: str, name: str = "sweep.yaml") -> str:
    path = tmp_path / name
    path.write_text(text.replace("{tiny}", TINY_YAML).replace("{small}", json.dumps(SMALL)))
    return str(path)


def test_factorisations_of_8():
    every = factorisations(8, {}, n_layers=8, n_heads=8)
    assert len(every) == 20  # ordered ways to split 2^3 over 4 axes: C(6, 3)
    assert len({tuple(m.values()) for m in every}) == 20
    assert all(m["data"] * m["fsdp"] * m["tensor"] * m["pipeline"] == 8 for m in every)
    pruned = factorisations(8, {"max_tensor": 2, "max_pipeline": 2}, n_layers=4, n_heads=4)
    assert len(pruned) == 4 + 3 + 3 + 2 and all(m["tensor"] <= 2 and m["pipeline"] <= 2 for m in pruned)
    # pipeline must divide 3 layers (only 1 does), tensor must divide 2 heads
    odd = factorisations(8, {}, n_layers=3, n_heads=2)
    assert {m["pipeline"] for m in odd} == {1} and {m["tensor"] for m in odd} == {1, 2}
    free = factorisations(8, {"pipeline_divides_layers": False}, n_layers=3, n_heads=8)
    assert {m["pipeline"] for m in free} == {1, 2, 4, 8}


@pytest.mark.parametrize(
    "path", sorted(glob.glob(os.path.join(ROOT, "configs", "sweeps", "*.yaml"))), ids=os.path.basename
)
def test_shipped_sweep_files_load(path):
    sweep = load_sweep(path)
    pts = points(sweep)
    assert pts and len({p["key"] for p in pts}) == len(pts)
    for p in pts:
        assert p["devices"] == p["mesh"]["data"] * p["mesh"]["fsdp"] * p["mesh"]["tensor"] * p["mesh"]["pipeline"]
    # every point is a valid config (a base config's change, e.g. its accumulation, must not invalidate them)
    from jaxpar.config import load_config

    for p in pts:
        load_config(sweep.base, [*sweep.overrides, *p["overrides"]], num_devices=p["devices"])
    if os.path.basename(path) == "tiny_mesh_8.yaml":
        assert len(pts) == 12 * 2  # 12 meshes with tensor, pipeline <= 2, times zero_stage 1 and 3


def test_points_are_the_cartesian_product(tmp_path):
    path = _write(
        tmp_path,
        "base: {tiny}\noverrides: {small}\nmeshes: [{data: 8}, {data: 4, fsdp: 2}]\n"
        "vary: {optimizer.zero_stage: [1, 3], model.remat: [none, full]}\ncompile: false\n",
    )
    sweep = load_sweep(path)
    pts = points(sweep)
    assert len(pts) == 2 * 2 * 2 and len({p["key"] for p in pts}) == 8
    assert pts[0]["overrides"] == [
        "mesh.data=8",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "mesh.pipeline=1",
        "mesh.context=1",
        "optimizer.zero_stage=1",
        "model.remat=none",
    ]
    assert all(p["key"].startswith(" ".join(SMALL)) for p in pts)
    assert sweep.base == TINY_YAML and not sweep.compile


@pytest.mark.parametrize(
    "text, needle",
    [
        ("- just\n- a list\n", "top level must be a mapping"),
        ("model: [1, 2\n", "not valid YAML"),
        ("devices: 8\n", "`base:` must name the config"),
        ("base: 3\ndevices: 8\n", "`base` must be a file name, got 3"),
        ("base: missing.yaml\ndevices: 8\n", "base config 'missing.yaml'"),
        ("base: {tiny}\ndevices: 8\nmeshs: []\n", "unknown sweep key 'meshs'"),
        ("base: {tiny}\n", "exactly one of `devices: D`"),
        ("base: {tiny}\ndevices: 8\nmeshes: [{data: 8}]\n", "exactly one of `devices: D`"),
        ("base: {tiny}\nmeshes: {data: 8}\n", "meshes: must be a non-empty list"),
        ("base: {tiny}\nmeshes: [[8, 1]]\n", "meshes[0]: must be a mapping"),
        ("base: {tiny}\nmeshes: [{data: 4, expert: 2}]\n", "meshes[0]: unknown mesh axis 'expert'"),
        ("base: {tiny}\nmeshes: [{data: 8}, {data: 0}]\n", "meshes[1].data: must be a positive integer"),
        ("base: {tiny}\ndevices: eight\n", "devices: expected an integer"),
        ("base: {tiny}\ndevices: 8\nconstraints: {max_expert: 2}\n", "unknown constraint constraints.max_expert"),
        ("base: {tiny}\ndevices: 8\nconstraints: {max_tensor: 0, max_data: 0}\n", "no factorisation of 8"),
        ("base: {tiny}\ndevices: 8\nvary: {model.hidden: [1]}\n", "unknown config key model.hidden"),
        ("base: {tiny}\ndevices: 8\nvary: {model.remat: [1]}\n", "model.remat: expected a string"),
        (
            "base: {tiny}\ndevices: 8\nvary: {optimizer.zero_stage: 3}\n",
            "vary.optimizer.zero_stage: must be a non-empty",
        ),
        ("base: {tiny}\ndevices: 8\nvary: {mesh.data: [2]}\n", "mesh sizes come from `devices` or `meshes`"),
        ("base: {tiny}\ndevices: 8\noverrides: [model.hidden=2]\n", "unknown config key model.hidden"),
        (
            "base: {tiny}\ndevices: 8\noverrides: [mesh.tensor=1]\n",
            "mesh sizes come from `devices` or `meshes`, not from overrides",
        ),
        ("base: {tiny}\ndevices: 8\noverrides: [train.steps=2, train.steps=3]\n", "train.steps is given twice"),
        (
            "base: {tiny}\ndevices: 8\noverrides: [model.remat=full]\nvary: {model.remat: [none]}\n",
            "vary.model.remat: also set in `overrides`",
        ),
        ("base: {tiny}\ndevices: 8\nobjective: speed\n", "objective: 'speed' is not one of"),
        ("base: {tiny}\ndevices: 8\nobjective: tokens_per_s\n", "needs measured steps: set measure_steps"),
        ("base: {tiny}\ndevices: 8\nmemory_budget_gb: 1\nmemory_budget_bytes: 5\n", "not both"),
        (
            "base: {tiny}\ndevices: 8\nobjective: memory\ndevices: 4\n",
            "line 4: duplicate key 'devices' (first at line 2)",
        ),
    ],
)
def test_bad_sweep_files(tmp_path, text, needle):
    path = _write(tmp_path, text)
    with pytest.raises(SweepError) as err:
        load_sweep(path)
    assert needle in str(err.value)


def test_sweep_files_are_read_and_typed_by_the_config_loader(tmp_path):
    """Reading and scalar typing are the config loader's: a file that is not UTF-8 gets its message, and a number
    YAML 1.1 reads as a string (an exponent without a dot) is a number as it is in a config."""
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("base: caf\xe9.yaml\n".encode("latin-1"))
    with pytest.raises(SweepError, match="not a UTF-8 text file"):
        load_sweep(str(bad))
    path = _write(tmp_path, "base: {tiny}\ndevices: 8\nmemory_budget_bytes: 2e9\ntimeout_s: 60\ncompile: false\n")
    sweep = load_sweep(path)
    assert sweep.budget_bytes == 2e9 and sweep.timeout_s == 60.0
    with pytest.raises(
        SweepError, match="compile: expected true or false, got 'yes please' .*fix the value in the sweep file"
    ):
        load_sweep(_write(tmp_path, "base: {tiny}\ndevices: 8\ncompile: yes please\n"))


def test_cli_reports_bad_sweep_files(tmp_path, capsys):
    assert sweep_cli.main([str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    path = _write(tmp_path, "base: {tiny}\ndevices: 8\nvary: {model.hidden: [1]}\n")
    assert sweep_cli.main([path]) == 2
    err = capsys.readouterr().err
    assert "sweep error" in err and "model.hidden" in err and "Traceback" not in err


def test_cli_refuses_an_out_that_cannot_be_a_directory(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    sweep = os.path.join(ROOT, "configs", "sweeps", "llama_7b_64.yaml")
    for out in (afile, afile / "sub"):  # FileExistsError, NotADirectoryError
        assert sweep_cli.main([sweep, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "sweep error" in err and str(out) in err and "--out" in err and "Traceback" not in err
    assert afile.read_text() == "x"


def test_cli_exits_2_when_every_point_is_refused_by_config_validation(tmp_path, capsys):
    """Both points split 4 heads over tensor=8: refused at validation, nothing planned or compiled."""
    path = _write(
        tmp_path,
        "base: {tiny}\noverrides: {small}\nmeshes: [{data: 1, tensor: 8}]\n"
        "vary: {optimizer.zero_stage: [1, 3]}\ncompile: false\n",
    )
    assert sweep_cli.main([path, "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert "2 points (2 invalid)" in captured.out
    assert captured.err.strip() == (
        "jaxpar-sweep: none of the 2 points ran: 2 refused as invalid configs, 0 failed; each point's error is in "
        "results.md (fix the sweep's base, overrides or meshes)"
    )


@pytest.mark.parametrize(
    "counts, status",
    [
        ({"invalid": 2}, 2),
        ({"invalid": 1, "failed": 1}, 1),
        ({"failed": 2}, 1),
        ({"invalid": 1, "ok": 1}, 0),
        ({"failed": 1, "over_budget": 1}, 0),  # over budget: a valid point, planned and not run
    ],
)
def test_exit_status_when_no_point_ran(counts, status, capsys):
    assert sweep_cli._none_ran(counts) == status
    assert ("none of the" in capsys.readouterr().err) == (status != 0)


def _peak(overrides, devices=8) -> float:
    cfg = resolve_config(load_config(TINY_YAML, [*SMALL, *overrides], validate=False), devices)
    return plan(cfg)["memory"]["peak_estimate"]


def test_analytic_sweep_writes_outputs_and_resumes(tmp_path):
    """compile: false -- the plan of every point, no subprocess: invalid and over-budget points are recorded,
    the three outputs are written, and a rerun recomputes nothing."""
    low = _peak(["mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1", "optimizer.zero_stage=3"])
    high = _peak(["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1", "optimizer.zero_stage=1"])
    assert low < high
    path = _write(
        tmp_path,
        f"base: {{tiny}}\noverrides: {{small}}\n"
        f"meshes: [{{data: 8}}, {{fsdp: 8}}, {{data: 1, tensor: 8}}]\n"
        f"vary: {{optimizer.zero_stage: [1, 3]}}\nobjective: memory\ncompile: false\n"
        f"memory_budget_bytes: {(low + high) / 2}\n",
    )
    out = tmp_path / "out"
    logs: list[str] = []
    records = run_sweep(load_sweep(path), str(out), log=logs.append)
    status = {" ".join(r["overrides"]): r["status"] for r in records}
    assert len(records) == 6 and len(logs) == 6
    mesh8 = "mesh.tensor=1 mesh.pipeline=1 mesh.context=1"
    assert status[f"mesh.data=8 mesh.fsdp=1 {mesh8} optimizer.zero_stage=1"] == "over_budget"
    assert status[f"mesh.data=1 mesh.fsdp=8 {mesh8} optimizer.zero_stage=3"] == "ok"
    invalid = [r for r in records if r["mesh"]["tensor"] == 8]
    assert [r["status"] for r in invalid] == ["invalid", "invalid"]
    assert "must be divisible by mesh.tensor=8" in invalid[0]["error"]
    over = [r for r in records if r["status"] == "over_budget"]
    assert over and all(r["error"].startswith("skipped: over budget") for r in over)

    saved = json.loads((out / "results.json").read_text())
    assert saved["base"] == TINY_YAML and [r["key"] for r in saved["points"]] == [r["key"] for r in records]
    md = (out / "results.md").read_text()
    ok = sorted((r for r in records if r["status"] == "ok"), key=lambda r: r["planned"]["peak_estimate"])
    first = next(line for line in md.splitlines() if line.startswith("| 1 |"))
    assert f"| {ok[0]['mesh']['data']} | {ok[0]['mesh']['fsdp']} |" in first
    assert "Points not ranked:" in md and "over budget" in md
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    logs2: list[str] = []
    again = run_sweep(load_sweep(path), str(out), log=logs2.append)
    assert all("done earlier" in line for line in logs2) and len(logs2) == 6
    assert again == saved["points"]  # nothing recomputed (same wall times)

    # Changed measurement settings make the finished points incomparable: refused, results.json kept as it was.
    changed = tmp_path / "changed.yaml"
    changed.write_text(open(path).read().replace("compile: false", "compile: true"))
    with pytest.raises(SweepError, match=r"other settings \(compile False -> True\).*another --out"):
        run_sweep(load_sweep(str(changed)), str(out), log=logs2.append)
    assert json.loads((out / "results.json").read_text()) == saved


def test_sweep_of_virtual_stages_and_recompute(tmp_path):
    """pipeline.virtual_stages and pipeline.recompute in `vary:` on p = 2 (4 layers, m = 4), planned only. The
    trade shows: interleaving (v = 2) shrinks the bubble from (p - 1)/(m + p - 1) = 1/5 to (p - 1)/(v*m + p - 1)
    = 1/9, and costs memory (the chunk-order copies of the stage's layers and gradients, a longer ring) and
    permutes; recompute saves memory at either v. v = 3 needs the 4 layers in p*v = 6 chunks: invalid, with the
    config's error, and the sweep goes on."""
    small = [o for o in SMALL if not o.startswith(("model.n_layers=", "train.global_batch_size="))]
    small += ["model.n_layers=4", "train.global_batch_size=16", "pipeline.microbatches=4"]
    path = _write(
        tmp_path,
        f"base: {{tiny}}\noverrides: {json.dumps(small)}\nmeshes: [{{data: 4, pipeline: 2}}]\n"
        "vary: {pipeline.virtual_stages: [1, 2, 3], pipeline.recompute: [true, false]}\n"
        "objective: memory\ncompile: false\n",
    )
    out = tmp_path / "out"
    records = run_sweep(load_sweep(path), str(out), log=lambda _: None)
    by = {(r["overrides"][5], r["overrides"][6]): r for r in records}  # after the 5 mesh axes
    v1, v2, v3 = "pipeline.virtual_stages=1", "pipeline.virtual_stages=2", "pipeline.virtual_stages=3"
    rc, keep = "pipeline.recompute=true", "pipeline.recompute=false"
    for key in ((v3, rc), (v3, keep)):
        assert by[key]["status"] == "invalid" and by[key]["planned"] is None
        assert "must be divisible by mesh.pipeline * pipeline.virtual_stages = 2 * 3 = 6" in by[key]["error"]
    peak = {k: r["planned"]["peak_estimate"] for k, r in by.items() if r["status"] == "ok"}
    assert len(peak) == 4
    assert peak[(v1, rc)] < peak[(v1, keep)] and peak[(v2, rc)] < peak[(v2, keep)]  # recompute saves memory
    assert peak[(v1, keep)] < peak[(v2, rc)]  # interleaving costs more than recompute saves here
    comm = {k: r["planned"]["target_comm_bytes"] for k, r in by.items() if r["status"] == "ok"}
    assert comm[(v2, rc)] == comm[(v2, keep)] > comm[(v1, keep)] == comm[(v1, rc)]  # the chunk permutes
    for (v, _), r in by.items():
        if r["status"] == "ok":
            assert r["planned"]["bubble"] == pytest.approx(1 / 5 if v == v1 else 1 / 9)

    md = (out / "results.md").read_text()
    head = next(line for line in md.splitlines() if line.startswith("| rank |"))
    cells = [c.strip() for c in head.strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines() if line.startswith("| ")]
    rows = [row for row in rows if row[0].isdigit()]  # ranked points, best first
    assert [row[0] for row in rows] == ["1", "2", "3", "4"]
    ranked = [(row[cells.index("varied")], row[cells.index("bubble")]) for row in rows]
    assert ranked == [
        (f"{v1} {rc}", "0.200"),
        (f"{v1} {keep}", "0.200"),
        (f"{v2} {rc}", "0.111"),
        (f"{v2} {keep}", "0.111"),
    ]
    assert md.count("| invalid |") == 2 and "pipeline.virtual_stages = 2 * 3 = 6" in md


def _fake_runner(calls: list, fail_on: set[int] = frozenset(), interrupt_on: int | None = None):
    """Stands in for the `jaxpar-plan --compile --json` subprocess: returns a minimal compiled result."""
    compiled = {
        "memory_analysis": {
            "argument_bytes": 100,
            "output_bytes": 90,
            "alias_bytes": 80,
            "temp_bytes": 50,
            "generated_code_bytes": 0,
            "peak_bytes": 100 + 90 - 80 + 50,
        },
        "state": {"params_plus_opt_state": 70, "ratio": 1.0},
        "collectives": [],
    }

    def run(sweep, point):
        calls.append(point["key"])
        if len(calls) == interrupt_on:
            raise KeyboardInterrupt
        if len(calls) in fail_on:
            return 1, "", "Traceback ...\nRuntimeError: boom"
        return 0, json.dumps({"compiled": compiled, "measured": None, "over_budget": False}) + "\n", ""

    return run


def test_interrupted_sweep_resumes_and_retries_failures(tmp_path):
    path = _write(tmp_path, "base: {tiny}\noverrides: {small}\nmeshes: [{data: 8}, {fsdp: 8}, {data: 4, fsdp: 2}]\n")
    sweep, out = load_sweep(path), str(tmp_path / "out")
    calls: list = []
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C during the second point
        run_sweep(sweep, out, log=lambda _: None, runner=_fake_runner(calls, interrupt_on=2))
    saved = json.loads((tmp_path / "out" / "results.json").read_text())["points"]
    assert [r["status"] for r in saved] == ["ok"] and saved[0]["compiled"]["peak_bytes"] == 100 + 90 - 80 + 50

    calls2: list = []
    records = run_sweep(sweep, out, log=lambda _: None, runner=_fake_runner(calls2, fail_on={2}))
    assert calls2 == [p["key"] for p in points(sweep)[1:]]  # the finished point is skipped
    assert [r["status"] for r in records] == ["ok", "ok", "failed"]
    assert records[2]["error"].endswith("RuntimeError: boom")

    calls3: list = []
    records = run_sweep(sweep, out, log=lambda _: None, runner=_fake_runner(calls3))
    assert calls3 == [points(sweep)[2]["key"]]  # only the failed point runs again
    assert [r["status"] for r in records] == ["ok", "ok", "ok"]


def test_comm_objective_ranks_by_the_plan_for_the_platform(tmp_path):
    """A compiled point is planned for cpu as well (its budget check and the CPU executable's comparison), but
    ranked by the plan for the sweep's platform: with bf16 collectives the plan for cpu counts them at fp32, as
    XLA:CPU compiles them, which a GPU does not."""
    bf16 = [*SMALL, "precision.layout=16p", "precision.compute_dtype=bfloat16"]
    path = _write(
        tmp_path,
        f"base: {{tiny}}\noverrides: {json.dumps(bf16)}\n"
        "meshes: [{data: 8}, {data: 4, fsdp: 2}]\nobjective: comm_bytes\nplatform: gpu\n",
    )
    records = run_sweep(load_sweep(path), str(tmp_path / "out"), log=lambda _: None, runner=_fake_runner([]))
    for r in records:
        cfg = resolve_config(load_config(TINY_YAML, [*bf16, *r["overrides"]], validate=False), 8)
        gpu, cpu = sum(plan(cfg, "gpu")["by_axis"].values()), sum(plan(cfg, "cpu")["by_axis"].values())
        assert (r["planned"]["platform"], r["planned"]["target_platform"]) == ("cpu", "gpu")
        assert r["planned"]["comm_bytes"] == cpu and r["planned"]["target_comm_bytes"] == gpu < cpu
        assert objective_value(r, "comm_bytes") == gpu


def test_results_of_another_base_are_not_mixed_in(tmp_path):
    path = _write(tmp_path, "base: {tiny}\noverrides: {small}\nmeshes: [{data: 8}]\ncompile: false\n")
    out = tmp_path / "out"
    run_sweep(load_sweep(path), str(out), log=lambda _: None)
    other = _write(
        tmp_path,
        f"base: {os.path.join(ROOT, 'configs', 'llama_125m.yaml')}\nmeshes: [{{data: 8}}]\ncompile: false\n",
        name="other.yaml",
    )
    with pytest.raises(SweepError, match="holds results for base"):
        run_sweep(load_sweep(other), str(out), log=lambda _: None)


@pytest.mark.slow
def test_two_point_sweep_end_to_end(tmp_path):
    """jaxpar-sweep in a subprocess: each point compiled and timed for one step in its own process with 8
    simulated CPU devices; the rerun skips both points."""
    path = _write(
        tmp_path,
        "base: {tiny}\noverrides: {small}\nmeshes: [{data: 8}, {data: 2, fsdp: 2, tensor: 2}]\n"
        "objective: tokens_per_s\nmeasure_steps: 1\nfast_compile: true\n",
    )
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "jaxpar.cli.sweep", path, "--out", str(out)]
    first = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=900)
    assert "2 points (2 ok)" in first.stdout
    saved = json.loads((out / "results.json").read_text())["points"]
    for r in saved:
        assert r["status"] == "ok" and r["error"] is None
        assert r["compiled"]["state_ratio"] == pytest.approx(1.0, abs=0.01)
        assert r["compiled"]["comm_ratio"] == pytest.approx(1.0, abs=0.01)
        assert r["compiled"]["partitioned_comm_ratio"] == pytest.approx(1.0, abs=0.01)  # fp32: as the executable
        assert r["measured"]["tokens_per_s"] > 0 and r["measured"]["step_time_s"] > 0
        assert r["measured"]["mfu"] is None  # CPU: no known peak, so no MFU
    md = (out / "results.md").read_text()
    assert md.count("| ok |") == 2 and "| 1 |" in md and "| 2 |" in md
    assert (out / "plot.png").read_bytes()[:4] == b"\x89PNG"
    again = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300)
    assert again.stdout.count("done earlier (ok), skipped") == 2
    assert json.loads((out / "results.json").read_text())["points"] == saved
