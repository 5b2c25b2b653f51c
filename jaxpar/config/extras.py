"""Optional dependencies: which extra of pyproject.toml provides each module, and the one error that names it.

The core install (`pip install jaxpar`) runs the default training run and every command; these features need an
extra (pyproject.toml says why each dependency sits where it does):

  extra  modules                                   needed by
  data   tokenizers, sentencepiece, tiktoken,      `jaxpar-data tokenize` with an hf / sentencepiece / tiktoken
         pyarrow                                   tokenizer or Parquet input; decoding samples of shards made
                                                   with such a tokenizer
  plot   matplotlib                                `jaxpar-sweep`'s plot.png (without it the sweep writes its
                                                   results and says that plot.png was skipped)
  wandb  wandb                                     `metrics.wandb: true`

(The `gpu-compile` extra, jax's CUDA plugin for compiling without GPUs, is in `PLUGIN_EXTRAS`: a jax plugin is
found by its distribution, not imported, so `jaxpar.analysis.gpu.deviceless` checks it, and its version, itself and
names it with `install_command`.) A feature calls `require(module,
feature)` where it imports the module, and `check(module, feature)` (no import) where it can refuse early, before
any device work. jax-free.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

EXTRAS = {
    "data": ("tokenizers", "sentencepiece", "tiktoken", "pyarrow"),
    "plot": ("matplotlib",),
    "wandb": ("wandb",),
}
_EXTRA_OF = {module: extra for extra, modules in EXTRAS.items() for module in modules}
# Extras of jax plugins, found by distribution and version rather than by import (module docstring).
PLUGIN_EXTRAS = ("gpu-compile",)
# The feature the wandb extra serves, as its missing-extra message names it: refused at load by the config's
# checks, and at import by `jaxpar.training.trackers` for a tracker built by hand.
WANDB_FEATURE = "metrics.wandb=true (Weights & Biases)"


class MissingExtra(ImportError):
    """A feature needs a module of an extra that is not installed; the message names the extra to install."""


def install_command(extra: str) -> str:
    """The command that installs `extra`, e.g. "pip install 'jaxpar[data]'".

    Raises:
      KeyError: an extra that is in neither `EXTRAS` nor `PLUGIN_EXTRAS`.
    """
    if extra not in EXTRAS and extra not in PLUGIN_EXTRAS:
        raise KeyError(f"no extra {extra!r}; the extras are {', '.join((*EXTRAS, *PLUGIN_EXTRAS))}")
    return f"pip install 'jaxpar[{extra}]'"


def _extra(module: str) -> tuple[str, str]:
    top = module.partition(".")[0]
    if top not in _EXTRA_OF:
        raise KeyError(f"{top!r} is in no extra; the extras' modules are {', '.join(sorted(_EXTRA_OF))}")
    return top, _EXTRA_OF[top]


def missing_message(module: str, feature: str, instead: str = "") -> str:
    """ "FEATURE needs MODULE (the EXTRA extra), which is not installed: pip install 'jaxpar[EXTRA]'", and
    " (or INSTEAD)" when `instead` names another way (e.g. "set metrics.wandb=false")."""
    top, extra = _extra(module)
    return f"{feature} needs {top} (the {extra!r} extra), which is not installed: {install_command(extra)}" + (
        f" (or {instead})" if instead else ""
    )


def installed(module: str) -> bool:
    """Whether the top-level package of `module` (an extra's module, e.g. "pyarrow.parquet") is installed, without
    importing it.

    Raises:
      KeyError: a module of no extra.
    """
    return importlib.util.find_spec(_extra(module)[0]) is not None


def check(module: str, feature: str, instead: str = "") -> None:
    """Refuses `feature` early when `module` is not installed (nothing is imported).

    Raises:
      MissingExtra: naming the extra (`missing_message`).
      KeyError: a module of no extra.
    """
    if not installed(module):
        raise MissingExtra(missing_message(module, feature, instead))


def require(module: str, feature: str) -> ModuleType:
    """Imports and returns `module` (e.g. "tokenizers", "pyarrow.parquet") for `feature`.

    Raises:
      MissingExtra: the module's package is not installed (the message names the extra; the ImportError is
        chained). Another import failure inside an installed package propagates unchanged.
      KeyError: a module of no extra.
    """
    top, _ = _extra(module)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.partition(".")[0] != top:
            raise  # the package is there, but something it imports is not: not a missing extra
        raise MissingExtra(missing_message(module, feature)) from e
