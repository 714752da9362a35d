"""Nested dataclass config, YAML recipes, dotted overrides, types checked with clear errors. A leaf:
it imports nothing of tandem above it; the value checks run at start-up (`tandem.runtime.startup`)."""

from tandem.config.loader import read_config, save_config
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
    "read_config",
    "save_config",
]
