"""Print the fully resolved config (base files and overrides applied, validated) as YAML.

    .venv/bin/python tools/resolve_config.py configs/llama_7b.yaml mesh.data=8 mesh.fsdp=8 --devices 64

Validation uses `--devices` instead of the local device count, so a config can be checked for a cluster from a
laptop.
"""

import argparse
import sys

import yaml

from jaxpar.config import ConfigError, load_config, resolve_config
from jaxpar.config.sources import COMMAND_LINE


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="YAML config file, e.g. configs/llama_7b.yaml")  # checked below
    p.add_argument("overrides", nargs="*", help="dotted overrides such as mesh.fsdp=8")
    p.add_argument("--devices", type=int, required=True, help="device count the mesh must cover")
    args = p.parse_intermixed_args(argv)
    if args.config is None:  # a required positional before nargs="*" would name `overrides` as missing too
        p.error("a config path is required, e.g. configs/tiny.yaml")
    try:
        cfg = load_config(args.config, args.overrides, num_devices=args.devices, overrides_are=COMMAND_LINE)
        cfg = resolve_config(cfg, args.devices)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    yaml.safe_dump(cfg.to_dict(), sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
