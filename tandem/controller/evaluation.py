"""Held-out evaluation: greedy (by default) responses to validation prompts, scored by the reward."""

from tandem.controller.stats import val_stats
from tandem.reward import RewardPool
from tandem.rollout.group import make_groups
from tandem.rollout.protocol import SamplingParams
from tandem.rollout.worker import RolloutWorker
from tandem.sample import Prompt, Sample


def evaluate(
    rollout: RolloutWorker,
    reward: RewardPool,
    prompts: list[Prompt],
    prompt_ids: list[list[int]],
    params: SamplingParams,
) -> tuple[dict[str, float], list[Sample]]:
    """-> ({"val/accuracy", "val/score/mean", ...}: `tandem.controller.stats.val_stats`, the scored
    samples), one response per prompt."""
    samples = rollout.generate(make_groups(prompts, prompt_ids, n=1), params)
    return val_stats(samples, reward.score(samples), float(rollout.version)), samples
