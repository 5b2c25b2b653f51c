"""Models: the interface a jaxpar model follows, the registry `model.name` selects from (built in: `llama`), the
layer stack, the tensor-parallel building blocks, and the parameter dicts the train state holds.

Writing a model (`examples/gpt2.py` is a complete one): `LanguageModel` (`jaxpar.model.interface`) says what it
must provide; `stack_layers` / `scan_layers` (`jaxpar.model.stack`) stack and run its layers; `Embed`, `LMHead`,
`RMSNorm` (`jaxpar.model.layers`), `dot_product_attention` (`jaxpar.model.attention`: XLA or cuDNN, within
packed documents), `column_parallel`, `row_parallel` and the `TensorParallel` context
(`jaxpar.parallel.tensor`) make it tensor-parallel; `MoE` (`jaxpar.model.moe`) is a mixture-of-experts MLP for
`model.moe` (the model then also provides `run_blocks_with_stats`); `register_model` gives it the name
`model.name` selects.
"""

from jaxpar.config.schema import ModelConfig
from jaxpar.model.attention import dot_product_attention
from jaxpar.model.interface import LanguageModel
from jaxpar.model.layers import Embed, LMHead, RMSNorm
from jaxpar.model.moe import MoE
from jaxpar.model.params import ModelDef, build_model, init_params, logical_axes, model_def
from jaxpar.model.registry import ModelFamily, model_family, register_model, registered_models
from jaxpar.model.stack import ATTENTION_CONTEXT, MLP_HIDDEN, Gather, no_gather, scan_layers, stack_layers
from jaxpar.parallel.tensor import NO_TENSOR_PARALLEL, TensorParallel, column_parallel, row_parallel

__all__ = [
    "ATTENTION_CONTEXT",
    "MLP_HIDDEN",
    "NO_TENSOR_PARALLEL",
    "Embed",
    "Gather",
    "LMHead",
    "LanguageModel",
    "ModelConfig",
    "ModelDef",
    "ModelFamily",
    "MoE",
    "RMSNorm",
    "TensorParallel",
    "build_model",
    "column_parallel",
    "dot_product_attention",
    "init_params",
    "logical_axes",
    "model_def",
    "model_family",
    "no_gather",
    "register_model",
    "registered_models",
    "row_parallel",
    "scan_layers",
    "stack_layers",
]
