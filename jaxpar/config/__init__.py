"""Typed, validated run configuration loaded from YAML with dotted overrides."""

from jaxpar.config.decode import config_from_dict
from jaxpar.config.errors import ConfigError
from jaxpar.config.load import check_unique_overrides, load_config, load_config_with_sources, save_config
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
    "load_config_with_sources",
    "resolve_config",
    "save_config",
    "validate_config",
]
