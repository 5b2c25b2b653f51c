"""jaxpar: train Flax NNX language models over a (data, fsdp, tensor, pipeline) mesh with explicit collectives.

The names a training script needs (each documented where it is defined):

    configs and meshes    Config, ConfigError, load_config, build_mesh
    a whole run           train, TrainResult, TrainingDiverged
    its parts             Hook, RunContext, default_hooks (the built-in hooks: `jaxpar.training.hooks`)
    the step itself       StepPlan, build_plan, init_state, abstract_state, make_train_step, make_eval_step
    losses, optimizers    cross_entropy, cross_entropy_with_z_loss, VocabParallelLoss, skip_nonfinite
    models                register_model, LanguageModel (writing one: `jaxpar.model`)
    a saved run           restore, Restored, sample_text
    processes, messages   initialize (jax.distributed from the environment jaxpar-launch or a cluster sets),
                          configure_logging

Shape letters, one meaning each, used by every module (a name's suffix gives its array's dimensions in order:
`x_BTD`, `w_DF`; a module names only the letters it adds or narrows, e.g. "B: rows per microbatch"):

    B  batch rows: sequences in the array at hand (per device, or per microbatch where a function says so)
    T  sequence length in tokens (T' = T/t where sequence parallelism splits it over `tensor`)
    D  model width (model.d_model)          F  MLP hidden width (model.d_ff; model.moe.d_expert in an expert)
    H  query heads                          G  key/value heads (G divides H: grouped-query attention)
    K  head width (model.head_dim)          V  vocabulary
    L  layers (the stacked `layers` axis)   S  pipeline stages
    M  microbatches of one step (gradient accumulation or pipeline; a module using both names which)
    E  experts                              C  capacity: assignments per expert and sequence
    A  router assignments (B T k)           N  packed sequences or rows cut from a token stream
    Q  data sources of a mixture

Lower-case letters are sizes and counts in formulas, as the papers write them:

    d  size of the `data` mesh axis         f  size of the `fsdp` mesh axis
    t  size of the `tensor` mesh axis       p  size of the `pipeline` mesh axis: pipeline stages
    v  virtual stages per device            m  microbatches
    k  experts per token (model.moe.top_k)  ep expert-parallel size
    b  rows per microbatch and device

The global batch has no letter (`train.global_batch_size`, sequences over all devices).

Imports are lazy: `import jaxpar` does not import jax, so a script (or `jaxpar-train --cpu-devices N`) can still
set JAX_NUM_CPU_DEVICES or XLA_FLAGS after it.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "Config": "jaxpar.config",
    "ConfigError": "jaxpar.config",
    "load_config": "jaxpar.config",
    "build_mesh": "jaxpar.parallel.mesh",
    "train": "jaxpar.training.loop",
    "TrainResult": "jaxpar.training.hooks",
    "TrainingDiverged": "jaxpar.training.hooks",
    "Hook": "jaxpar.training.hooks",
    "RunContext": "jaxpar.training.hooks",
    "default_hooks": "jaxpar.training.hooks",
    "StepPlan": "jaxpar.training.plan",
    "build_plan": "jaxpar.training.plan",
    "init_state": "jaxpar.training.state",
    "abstract_state": "jaxpar.training.state",
    "make_train_step": "jaxpar.training.step",
    "make_eval_step": "jaxpar.training.step",
    "cross_entropy": "jaxpar.training.loss",
    "cross_entropy_with_z_loss": "jaxpar.training.loss",
    "VocabParallelLoss": "jaxpar.training.loss",
    "skip_nonfinite": "jaxpar.training.optimizer",
    "register_model": "jaxpar.model",
    "LanguageModel": "jaxpar.model",
    "restore": "jaxpar.training.restore",
    "Restored": "jaxpar.training.restore",
    "sample_text": "jaxpar.training.sample",
    "configure_logging": "jaxpar.log",
    "initialize": "jaxpar.parallel.distributed",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'jaxpar' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
