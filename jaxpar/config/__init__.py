"""Typed, validated run configuration loaded from YAML with dotted overrides."""

from jaxpar.config.errors import ConfigError
from jaxpar.config.load import check_unique_overrides, config_from_dict, load_config, save_config
from jaxpar.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DataSourceConfig,
    DistributedConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    PipelineConfig,
    PrecisionConfig,
    TensorConfig,
    TrainConfig,
)
from jaxpar.config.validate import resolve_config, validate_config

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DataSourceConfig",
    "DistributedConfig",
    "MeshConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "PrecisionConfig",
    "TensorConfig",
    "TrainConfig",
    "check_unique_overrides",
    "config_from_dict",
    "load_config",
    "resolve_config",
    "save_config",
    "validate_config",
]
