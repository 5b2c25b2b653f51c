"""`jaxpar-checkpoints PATH [--step N] [--json]`: list a checkpoint's steps, saved config, mesh and arrays.

PATH is a run directory (holding `checkpoints/`), its `checkpoints/` directory, or one step directory. Prints the
complete steps, any incomplete step directories (never restored), and for the chosen step (default: the
step PATH names, else the latest complete one) the saved mesh (data/fsdp/tensor/pipeline), zero_stage, model
dims, data position and every array's dotted name, shape, dtype and saved sharding. Only metadata is read:
no array data, no accelerator (jax runs on CPU).

Examples:
  jaxpar-checkpoints runs/tiny
  jaxpar-checkpoints runs/tiny/checkpoints --json        # the latest complete step; --step N for another

Exit status: 0, or 2 for a missing path, no complete checkpoint, or a step that is not complete.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="jaxpar-checkpoints", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("path", help="run dir, its checkpoints/ dir, or a step dir")
    p.add_argument("--step", type=int, default=None, help="step to describe (default: latest complete)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # metadata only: never claim an accelerator
    from jaxpar.checkpoint_info import (  # imports jax (via orbax)
        checkpoint_info,
        format_checkpoint_info,
    )

    try:
        info = checkpoint_info(args.path, args.step)
    except (OSError, ValueError) as e:
        print(f"jaxpar-checkpoints: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=2) if args.json else format_checkpoint_info(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
