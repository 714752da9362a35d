"""Rollout: the engine contract, the built-in engines and their sampler, the vLLM adapter."""

from tandem.rollout.base import RolloutEngine
from tandem.rollout.engine import BuiltinEngine
from tandem.rollout.group import make_groups
from tandem.rollout.paged_engine import PagedEngine
from tandem.rollout.protocol import ON_UPDATE_POLICIES, SamplingParams
from tandem.rollout.vllm_engine import VLLMEngine
from tandem.rollout.worker import RolloutWorker

__all__ = [
    "ON_UPDATE_POLICIES",
    "BuiltinEngine",
    "PagedEngine",
    "RolloutEngine",
    "RolloutWorker",
    "SamplingParams",
    "VLLMEngine",
    "make_groups",
]
