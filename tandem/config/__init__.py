"""Nested dataclass config, YAML recipes, dotted overrides, validation with clear errors."""

from tandem.config.loader import load_config, save_config
from tandem.config.schema import (
    AlgoConfig,
    Config,
    CriticConfig,
    DataConfig,
    LoraConfig,
    ModelSection,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    SFTConfig,
    TrainConfig,
)

__all__ = [
    "AlgoConfig",
    "Config",
    "CriticConfig",
    "DataConfig",
    "LoraConfig",
    "ModelSection",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "TrainConfig",
    "load_config",
    "save_config",
]
