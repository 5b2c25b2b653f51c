"""Thin script equivalent to `jaxpar-train`: python experiments/train.py CONFIG [--cpu-devices N] [key=value ...]"""

import sys

from jaxpar.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
