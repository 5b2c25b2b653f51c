"""Golden losses: the five golden configs (tests/golden_runs.py: tiny.yaml's layout, 1F1B, interleaved 1F1B,
ZeRO-3 with accumulation, MoE with expert parallelism) trained 20 steps here equal the committed table
(tests/fixtures/golden_losses.json) within its tolerance; and tools/compare_losses.py, which runs them at two
commits through tools/golden_losses.py, finds a commit bitwise equal to itself.

Why the comparison is strict enough to fail on a real change: the tolerance is 10 times the largest spread
measured across the instruction sets CI runs (2.3e-7 relative, two fp32 ulps of the loss: tests/golden_table.py,
docs/testing.md), 2.3e-6. The learning rate times 1.0001 already moves the losses by 2e-6 at step 3 and 2e-5 by
step 12 (the table records that run, and tests/unit/test_golden_table.py checks that it fails); a lost
microbatch or a loss divided by the wrong token count moves them far more. What it lets through, on purpose, is a
change of the order of fp32 sums (a few ulps, like another CPU): tools/compare_losses.py checks those bitwise.
"""

import os
import subprocess
import sys

import golden_runs
import golden_table
import pytest

pytestmark = pytest.mark.slow


def test_losses_match_the_golden_table(tmp_path, devices8):
    table = golden_table.load()
    assert golden_table.stale(table) == [], "the table is stale: python tools/golden_losses.py write"
    losses = golden_runs.run(list(golden_runs.CONFIGS), str(tmp_path))
    off = golden_table.check(table, losses)
    versions = golden_table.versions_note(table)
    assert off == [], "\n".join(
        [
            *off,
            versions or "with the versions the table was made with",
            "if the change is meant (docs/testing.md, golden losses): python tools/golden_losses.py write",
        ]
    )


def test_compare_losses_finds_head_equal_to_itself():
    """tools/compare_losses.py HEAD HEAD on one config for 2 steps: two worktrees, two runs of
    tools/golden_losses.py, each importing its own worktree's jaxpar, and a report of equal bits (the report of
    a difference: tests/unit/test_golden_table.py)."""
    cmd = [sys.executable, os.path.join(golden_runs.ROOT, "tools", "compare_losses.py"), "HEAD", "HEAD"]
    out = subprocess.run([*cmd, "--configs", "default", "--steps", "2"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-2:] == ["default  bitwise equal (2 steps)", "all configs bitwise equal"]
