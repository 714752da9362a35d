"""Rollout: the engine protocol, the built-in engine and its sampler."""

from tandem.rollout.engine import BuiltinEngine
from tandem.rollout.group import make_groups
from tandem.rollout.protocol import RolloutEngine, SamplingParams
from tandem.rollout.worker import RolloutWorker

__all__ = ["BuiltinEngine", "RolloutEngine", "RolloutWorker", "SamplingParams", "make_groups"]
