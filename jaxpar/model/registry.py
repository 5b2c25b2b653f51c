"""Model families by name: `model.name` in a config selects one. `llama`, `qwen2`, `qwen3`, `mistral` and
`mixtral` (`jaxpar.model.llama`) and `gemma2` (`jaxpar.model.gemma`) are built in; a script registers its own with
`register_model` before it loads a config that names it.

A family is a builder `build(cfg: ModelConfig, rngs: nnx.Rngs) -> module` whose module follows
`jaxpar.model.interface.LanguageModel`. It reads the `ModelConfig` fields it needs (say which in its docstring)
and raises ValueError for a setting it cannot honour.
"""

from __future__ import annotations

import dataclasses
import keyword
from collections.abc import Callable

from flax import nnx

from jaxpar.config.errors import ConfigError
from jaxpar.config.schema import ModelConfig
from jaxpar.model.interface import LanguageModel

ModelBuilder = Callable[[ModelConfig, nnx.Rngs], LanguageModel]
# Forward FLOPs per token that `ModelConfig.remat` recomputes in the backward, from (model config, seq_len): the
# hardware-FLOPs (HFU) count of a family; see `jaxpar.model.llama.recompute_flops_per_token` for the built-in one.
RecomputeFlops = Callable[[ModelConfig, float], float]
# The FP8 GEMMs one row of a family's layer stack runs (`precision.fp8.scaling=delayed` keeps an amax history for
# each); see `jaxpar.model.llama.fp8_gemm_sites` for the built-in one.
Fp8GemmSites = Callable[[ModelConfig], int]


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """A registered model family.

    Attributes:
      name: what `model.name` says to select it.
      build: `build(cfg, rngs) -> LanguageModel`.
      recompute_flops_per_token: the family's recomputed forward FLOPs per token under its remat policy, or None
        when unknown (then the `hfu` metric is null; `mfu` needs only the model FLOPs).
      fp8_gemm_sites: the FP8 GEMMs (`jaxpar.parallel.tensor.column_matmul` / `row_matmul` and the experts') one
        row of the layer stack runs, or None when unknown (then FP8 delayed scaling is refused for the family).
    """

    name: str
    build: ModelBuilder
    recompute_flops_per_token: RecomputeFlops | None = None
    fp8_gemm_sites: Fp8GemmSites | None = None


_FAMILIES: dict[str, ModelFamily] = {}


def register_model(
    name: str,
    build: ModelBuilder,
    *,
    recompute_flops_per_token: RecomputeFlops | None = None,
    fp8_gemm_sites: Fp8GemmSites | None = None,
    replace: bool = False,
) -> ModelFamily:
    """Registers a model family under `name` for `model.name` to select.

    Args:
      name: a non-empty identifier, e.g. "gpt2".
      build: `build(cfg: ModelConfig, rngs: nnx.Rngs)` returning a `jaxpar.model.interface.LanguageModel`.
      recompute_flops_per_token, fp8_gemm_sites: see `ModelFamily`.
      replace: allow replacing an existing registration (else registering a taken name is an error).

    Returns:
      the registered `ModelFamily`.

    Raises:
      ValueError: `name` is empty or not an identifier, or already registered and `replace` is false.
      TypeError: `build` (or `fp8_gemm_sites`, when given) is not callable.
    """
    _register_builtins()  # first, so that a built-in name is taken whatever ran before
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"a model name must be an identifier such as 'gpt2', got {name!r}")
    if not callable(build):
        raise TypeError(
            f"build must be callable (cfg: ModelConfig, rngs: nnx.Rngs) -> module, got {type(build).__name__}"
        )
    if fp8_gemm_sites is not None and not callable(fp8_gemm_sites):
        raise TypeError(
            f"fp8_gemm_sites must be callable (cfg: ModelConfig) -> int, got {type(fp8_gemm_sites).__name__}"
        )
    if name in _FAMILIES and not replace:
        raise ValueError(f"model {name!r} is already registered; pick another name or pass replace=True")
    family = ModelFamily(name, build, recompute_flops_per_token, fp8_gemm_sites)
    _FAMILIES[name] = family
    return family


def registered_models() -> tuple[str, ...]:
    """The names `model.name` may take now, sorted."""
    _register_builtins()
    return tuple(sorted(_FAMILIES))


def model_family(name: str) -> ModelFamily:
    """The family registered as `name`.

    Raises:
      ConfigError: no family has that name (`model.name`); the message lists the registered ones and how to add
        one. Raised when a model is first derived from a config (`build_plan`, the planner), before device work.
    """
    _register_builtins()
    if name not in _FAMILIES:
        raise ConfigError(
            f"model.name={name!r} is not a registered model (registered: "
            f"{', '.join(sorted(_FAMILIES))}); a script registers its own with "
            f"jaxpar.register_model({name!r}, build) before loading the config (jaxpar-train: --import FILE.py)"
        )
    return _FAMILIES[name]


_BUILTINS_REGISTERED = False


def _register_builtins() -> None:
    global _BUILTINS_REGISTERED
    if _BUILTINS_REGISTERED:
        return
    _BUILTINS_REGISTERED = True
    import functools

    from jaxpar.model.gemma import Gemma2
    from jaxpar.model.gemma import fp8_gemm_sites as gemma_fp8_gemm_sites
    from jaxpar.model.llama import VARIANTS, Llama, fp8_gemm_sites, recompute_flops_per_token

    for name, variant in VARIANTS.items():
        build = functools.partial(Llama, variant=variant)
        _FAMILIES[name] = ModelFamily(name, build, recompute_flops_per_token, fp8_gemm_sites)
    # Gemma 2's recomputed FLOPs per layer are llama's: its GeGLU and extra norms add no matmul
    _FAMILIES["gemma2"] = ModelFamily("gemma2", Gemma2, recompute_flops_per_token, gemma_fp8_gemm_sites)
