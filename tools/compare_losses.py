"""Are the golden losses of two commits bitwise equal? For a change that claims to change no numerics (a refactor).

    python tools/compare_losses.py BASE [HEAD] [--configs default,1f1b] [--steps 20]
    python tools/compare_losses.py HEAD~1

Checks out each commit (HEAD: the current HEAD) into a temporary `git worktree`, runs the golden configs
(tests/golden_runs.py: five layouts, 20 steps, 8 simulated CPU devices) with that commit's jaxpar/ and configs/
in a process of this Python (tools/golden_losses.py run, with the worktree first on PYTHONPATH), and prints per
config: bitwise equal, or the first step whose fp32 loss differs and the largest relative difference. Both runs
use this checkout's golden configs and token stream, so a commit from before they existed can be compared too.
--steps N trains N steps (the learning rate decays over train.steps, so they are not the first N of a longer
run). About 30 s per commit on 2 cores. Exit status: 0 when every config is bitwise equal, 1 otherwise (also when
a commit's run fails), 2 when a commit is not found.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import golden_runs  # noqa: E402  (tests/, put on the path above)
import golden_table  # noqa: E402


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", golden_runs.ROOT, *args], check=True, capture_output=True, text=True).stdout


def _commit(rev: str) -> str | None:
    """The full hash of `rev`, or None when it names no commit."""
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").strip()
    except subprocess.CalledProcessError:
        return None


def _losses_at(commit: str, names: list[str], steps: int, tmp: str) -> dict:
    """`tools/golden_losses.py run` with `commit` checked out into a worktree under `tmp` (removed afterwards)."""
    tree = os.path.join(tmp, commit[:12])
    _git("worktree", "add", "--detach", "--quiet", tree, commit)
    try:
        return golden_runs.run_in_subprocess(names, steps=steps, root=tree)
    finally:
        _git("worktree", "remove", "--force", tree)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the commit before the change (any git revision)")
    parser.add_argument("head", nargs="?", default="HEAD", help="the commit after it (default: HEAD)")
    parser.add_argument("--configs", default=",".join(golden_runs.CONFIGS), help="comma-separated (default: all)")
    parser.add_argument(
        "--steps", type=int, default=golden_runs.STEPS, help=f"steps per config (default {golden_runs.STEPS})"
    )
    args = parser.parse_args(argv)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in golden_runs.CONFIGS]
    if unknown or args.steps < 1:
        parser.error(f"--configs takes {', '.join(golden_runs.CONFIGS)} and --steps a number >= 1")
    commits = {}
    for label, rev in (("BASE", args.base), ("HEAD", args.head)):
        commits[label] = _commit(rev)
        if commits[label] is None:
            print(f"compare_losses: {rev!r} ({label}) is not a commit of {golden_runs.ROOT}", file=sys.stderr)
            return 2
    results = {}
    with tempfile.TemporaryDirectory(prefix="jaxpar-compare-") as tmp:
        for label, commit in commits.items():
            subject = _git("log", "-1", "--format=%h %s", commit).strip()
            print(f"{label}: {subject[:100]}", flush=True)
            try:
                results[label] = _losses_at(commit, names, args.steps, tmp)
            except RuntimeError as err:
                print(f"compare_losses: the run at {label} failed: {err}", file=sys.stderr)
                return 1
    failed = False
    for label, result in results.items():
        for name, error in result["errors"].items():
            print(f"{name}: failed at {label}:\n{error}")
            failed = True
    done = [n for n in names if all(n in r["losses"] for r in results.values())]
    base, head = ({n: results[label]["losses"][n] for n in done} for label in ("BASE", "HEAD"))
    lines, equal = golden_table.bitwise_report(base, head)
    print("\n".join(lines))
    equal = equal and not failed
    print("all configs bitwise equal" if equal else "the losses differ (or a run failed)")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
