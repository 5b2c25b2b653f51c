"""The Llama-style decoder-only transformer (Flax NNX) and its parameter dicts."""
from jaxpar.model.params import ModelDef, init_params, logical_axes, model_def, param_count
from jaxpar.model.transformer import Transformer, token_loss_sum

__all__ = ["ModelDef", "Transformer", "init_params", "logical_axes", "model_def", "param_count",
           "token_loss_sum"]
