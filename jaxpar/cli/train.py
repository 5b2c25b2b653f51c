"""`jaxpar-train CONFIG [section.key=value ...]`: train a model from a YAML config.

Examples:
  jaxpar-train configs/tiny.yaml --cpu-devices 8
  jaxpar-train configs/tiny.yaml --cpu-devices 8 mesh.data=4 mesh.fsdp=2 mesh.tensor=1 optimizer.zero_stage=2
  # a new run on another mesh (data=4 x tensor=2), in its own directory, seeded from runs/tiny's latest checkpoint:
  jaxpar-train configs/tiny.yaml --cpu-devices 8 mesh.data=4 train.run_dir=runs/data4 --restore-from runs/tiny
  # a model family of one's own (a file that calls jaxpar.register_model), selected by model.name:
  jaxpar-train configs/tiny.yaml --cpu-devices 8 --import examples/gpt2.py model.name=gpt2
    model.n_kv_heads=null model.tie_embeddings=true
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="jaxpar-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # nargs="?" and a check below: with a required positional followed by nargs="*", argparse would name
    # `overrides` as missing too when no argument is given.
    p.add_argument("config", nargs="?", help="YAML config file, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides such as mesh.fsdp=4 train.steps=50")
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help="simulate N CPU devices (sets JAX_NUM_CPU_DEVICES before jax starts)",
    )
    p.add_argument(
        "--restore-from",
        default=None,
        help="checkpoint directory (or one step directory) to start from instead of RUN_DIR's latest",
    )
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="FILE.py|MODULE",
        help="import a Python file or module first, e.g. one that registers a model family for model.name "
        "(jaxpar.register_model); repeatable",
    )
    args = p.parse_intermixed_args(argv)
    if args.config is None:
        p.error("a config path is required, e.g. jaxpar-train configs/tiny.yaml")  # exits with status 2
    return args


def import_module_or_file(spec: str) -> None:
    """Imports `spec`: a .py file (as a module named after it, its directory first on sys.path, so that it can
    import its neighbours) or a dotted module name.

    Raises:
      FileNotFoundError: a .py path that does not exist. ImportError: a module that cannot be imported.
    """
    import importlib
    import importlib.util

    if not spec.endswith(".py"):
        importlib.import_module(spec)
        return
    path = os.path.abspath(spec)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file {path}")
    name = os.path.splitext(os.path.basename(path))[0]
    sys.path.insert(0, os.path.dirname(path))
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"{path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_devices is not None:
        if args.cpu_devices < 1:
            print("jaxpar-train: --cpu-devices must be >= 1", file=sys.stderr)
            return 2
        os.environ["JAX_NUM_CPU_DEVICES"] = str(args.cpu_devices)
    from jaxpar.log import configure_logging
    from jaxpar.parallel import distributed  # jax is imported only after the device count is set

    configure_logging()
    from jaxpar.config import ConfigError, load_config_with_sources, validate_config
    from jaxpar.config.sources import COMMAND_LINE
    from jaxpar.training import faults
    from jaxpar.training.loop import TrainingDiverged, train

    try:
        faults.parse(os.environ.get(faults.ENV, ""))
    except ValueError as e:
        print(f"jaxpar-train: {e}", file=sys.stderr)
        return 2
    for spec in args.imports:
        try:
            import_module_or_file(spec)
        except (ImportError, OSError) as e:
            print(f"jaxpar-train: --import {spec}: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
    try:
        cfg, sources = load_config_with_sources(args.config, args.overrides, overrides_are=COMMAND_LINE)
    except ConfigError as e:
        print(f"jaxpar-train: config error: {e}", file=sys.stderr)
        return 2
    if args.restore_from:  # the path as given (an override would read it as YAML); messages name --restore-from
        cfg = cfg.replace(checkpoint=dataclasses.replace(cfg.checkpoint, restore_from=args.restore_from))
    try:
        distributed.initialize(cfg.distributed)  # before anything asks jax for devices
        validate_config(cfg)
    except ConfigError as e:  # named with the file or override that set each key
        print(f"jaxpar-train: config error: {sources.explain(e)}", file=sys.stderr)
        return 2
    from jaxpar.analysis.planner.memory import state_memory_report
    from jaxpar.data.errors import DataError

    try:
        train(cfg, on_compiled=(state_memory_report,))
    except ConfigError as e:
        print(f"jaxpar-train: config error: {sources.explain(e)}", file=sys.stderr)
        return 2
    except DataError as e:  # a shard set damaged after it was opened (the checks at start passed)
        print(f"jaxpar-train: data error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"jaxpar-train: stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "jaxpar-train: interrupted; started again, the run resumes from its latest complete checkpoint (or from "
            "the start, if none was saved yet)",
            file=sys.stderr,
        )
        return 130
    except Exception:
        if not _multi_process():
            raise
        _exit_now()
    return 0


def _multi_process() -> bool:
    import jax

    return jax.process_count() > 1


def _exit_now() -> None:
    """Prints the error being handled and ends this process at once with status 1, without Python's exit.

    Why: in a multi-process run the other processes may be blocked in a collective with this one, and Python's
    exit runs jax.distributed's shutdown, which waits for every process: the failed process would then never
    end, and neither would its launcher (`jaxpar-launch` stops the others once one has exited) or the job."""
    import traceback

    import jax

    traceback.print_exc()
    print(
        f"jaxpar-train: process {jax.process_index()} failed; exiting without waiting for the other processes",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
