"""Run configuration: pydantic sections and loading with precedence CLI > file > defaults."""

from zerotrain.config.loader import load_config
from zerotrain.config.sections import (
    DataConfig,
    DatasetConfig,
    HardwareConfig,
    LoraConfig,
    Mode,
    ModelConfig,
    ObjectiveConfig,
    OptimizerConfig,
    PlannerConfig,
    Quantization,
    RunConfig,
    TrainingConfig,
    parse_bytes,
)

__all__ = [
    "DataConfig", "DatasetConfig", "HardwareConfig", "LoraConfig", "Mode", "ModelConfig", "ObjectiveConfig", "OptimizerConfig",
    "PlannerConfig", "Quantization", "RunConfig", "TrainingConfig", "load_config", "parse_bytes",
]
