"""`jaxpar-checkpoints PATH [--step N] [--json]`: list a checkpoint's steps, saved config, mesh and arrays.
`jaxpar-checkpoints import-hf HF_DIR --out RUN_DIR [KEY=VALUE ...]` and
`jaxpar-checkpoints export-hf PATH --out HF_DIR [--dtype D] [--step N]`:
Hugging Face weights (Llama, Qwen2, Qwen3, Mistral, Mixtral, Gemma 2, DeepSeek-V3) in and out.

PATH is a run directory (holding `checkpoints/`), its `checkpoints/` directory, or one step directory. Prints the
complete steps, any incomplete step directories (never restored), and for the chosen step (default: the
step PATH names, else the latest complete one) its format version and the jaxpar version that wrote it (and
whether this jaxpar restores it: `jaxpar.checkpoint.format`), the saved mesh (data/fsdp/tensor/pipeline),
zero_stage, model dims, data position and every array's dotted name, shape, dtype and saved sharding. Only
metadata is read: no array data, no accelerator (jax runs on CPU).

Examples:
  jaxpar-checkpoints runs/tiny
  jaxpar-checkpoints runs/tiny/checkpoints --json        # the latest complete step; --step N for another

  jaxpar-checkpoints import-hf tests/fixtures/hf_llama_untied --out runs/hf_import      # step-0 checkpoint
  jaxpar-checkpoints export-hf runs/tiny_hf --out runs/tiny_hf_export --dtype bfloat16   # transformers loads it

import-hf writes RUN_DIR/checkpoints/0 (the weights as float32 parameters and a fresh AdamW state, restorable
onto any mesh and ZeRO stage), RUN_DIR/config.yaml (config.json's model, the defaults and the overrides given)
and RUN_DIR/hf_config.json; export-hf writes config.json and safetensors (`jaxpar.training.hf_checkpoint`). Both run on
the host CPU, and on every process of a job (`jaxpar-launch -n N -- jaxpar-checkpoints import-hf ...`): each reads
and writes only its own share, so no host holds the whole model.

Exit status: 0, or 2 for a missing path, no complete checkpoint, a step that is not complete, or (import-hf,
export-hf) a directory or config that cannot be converted, or a step of a format version this jaxpar does not
read (the message says why).
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


def _parse_hf_args(command: str, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=f"jaxpar-checkpoints {command}", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if command == "import-hf":
        p.add_argument("hf_dir", help="a Hugging Face model directory: config.json + *.safetensors")
        p.add_argument("--out", required=True, help="the new run directory")
        p.add_argument("overrides", nargs="*", help="dotted config overrides for RUN_DIR/config.yaml")
    else:
        p.add_argument("path", help="run dir, its checkpoints/ dir, or a step dir")
        p.add_argument("--out", required=True, help="the Hugging Face directory to write")
        p.add_argument(
            "--dtype",
            default="float32",
            choices=("float32", "bfloat16", "float16"),
            help="dtype of the safetensors (default float32: the parameters exactly)",
        )
        p.add_argument("--step", type=int, default=None, help="step to export (default: latest complete)")
        p.add_argument("--max-shard-bytes", type=int, default=5 * 2**30, help="split files above this size")
    return p.parse_intermixed_args(argv)


def _hf_main(command: str, argv: list[str]) -> int:
    args = _parse_hf_args(command, argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a conversion on the host: never claim an accelerator
    from jaxpar.config import ConfigError
    from jaxpar.model.hf import HFConfigError
    from jaxpar.parallel import distributed
    from jaxpar.training.hf_checkpoint import export_hf, import_hf

    try:
        distributed.initialize()  # under jaxpar-launch or a cluster: every process takes its part
        if command == "import-hf":
            info = import_hf(args.hf_dir, args.out, args.overrides)
            print(
                f"imported {args.hf_dir} ({info['parameters']:,} parameters, {info['dtype']}) as step 0 of "
                f"{args.out}; train it with: jaxpar-train {os.path.join(args.out, 'config.yaml')}"
            )
        else:
            files = export_hf(
                args.path, args.out, dtype=args.dtype, step=args.step, max_shard_bytes=args.max_shard_bytes
            )
            print(f"exported {args.path} to {args.out}: {', '.join(files)}")
    except (OSError, HFConfigError, ConfigError) as e:
        print(f"jaxpar-checkpoints {command}: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("import-hf", "export-hf"):
        return _hf_main(argv[0], argv[1:])
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # metadata only: never claim an accelerator
    from jaxpar.checkpoint.info import (  # imports jax (via orbax)
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
