"""Rewards: rule-based verifiers, user reward functions, and the process pool that runs them."""

from tandem.reward.pool import RewardPool
from tandem.reward.user_fn import RewardFn, load_reward_fn
from tandem.reward.verifiers import VERIFIERS

__all__ = ["VERIFIERS", "RewardFn", "RewardPool", "load_reward_fn"]
