"""Held-out evaluation: greedy (by default) responses to validation prompts, scored by the reward."""

from statistics import mean

from tandem.controller.stats import agent_stats
from tandem.reward import RewardPool
from tandem.rollout import RolloutWorker, SamplingParams, make_groups
from tandem.sample import Prompt, Sample


def evaluate(
    rollout: RolloutWorker,
    reward: RewardPool,
    prompts: list[Prompt],
    prompt_ids: list[list[int]],
    params: SamplingParams,
) -> tuple[dict[str, float], list[Sample]]:
    """-> ({"val/accuracy", "val/response_length/mean", ...}, the scored samples).

    Accuracy is the mean score of one response per prompt; the built-in verifiers score 1 for a
    correct answer and 0 otherwise, so for them it is the fraction answered correctly.
    """
    samples = rollout.generate(make_groups(prompts, prompt_ids, n=1), params)
    errors = reward.score(samples)
    metrics = {
        "val/accuracy": mean(s.reward for s in samples),
        "val/response_length/mean": mean(len(s.response_ids) for s in samples),
        "val/reward_errors": errors.get("reward/errors", 0.0) + errors.get("reward/timeouts", 0.0),
        "val/version": float(rollout.version),
        **agent_stats(samples, "val/agent"),
    }
    return metrics, samples
