"""Batch statistics of a step's samples, under verl's metric names, and held-out ones (val/*)."""

from statistics import mean

from tandem.sample import Sample


def _summary(prefix: str, values: list[float]) -> dict[str, float]:
    return {f"{prefix}/mean": mean(values), f"{prefix}/max": max(values), f"{prefix}/min": min(values)}


def rollout_stats(samples: list[Sample], trained_version: int) -> dict[str, float]:
    """`trained_version` is the policy version the samples are trained against (staleness is the
    gap to the oldest version that produced a sample's tokens; 0 in sync mode). The advantages are
    the train worker's (`critic/advantages/*`): it computes them, on its own copy of the samples."""
    lengths = [float(len(s.response_ids)) for s in samples]
    parts = sorted({k for s in samples for k in s.reward_parts})  # e.g. a verl function's extra keys
    return {
        **{f"reward/{k}/mean": mean(float(s.reward_parts.get(k, 0.0)) for s in samples) for k in parts},
        **_summary("critic/score", [s.reward for s in samples]),
        **_summary("response_length", lengths),
        "response_length/clip_ratio": mean(float(s.finish_reason == "length") for s in samples),
        **_summary("prompt_length", [float(len(s.prompt_ids)) for s in samples]),
        **_summary(
            "staleness", [float(trained_version - s.version_span[0]) for s in samples if s.versions] or [0.0]
        ),
        **agent_stats(samples),
    }


def agent_stats(samples: list[Sample], prefix: str = "agent") -> dict[str, float]:
    """`<prefix>/<name>/mean` over the episodes of every counter the agent loop kept in
    `Sample.agent_stats` (tools: turns, tool_calls, tool_errors, tool_use, truncated); {} for
    single-turn samples."""
    names = sorted({k for s in samples for k in s.agent_stats})
    return {f"{prefix}/{k}/mean": mean(float(s.agent_stats.get(k, 0.0)) for s in samples) for k in names}


CORRECT = 1.0  # the full score of every built-in verifier: a held-out sample scored this is right


def val_stats(samples: list[Sample], reward: dict[str, float], version: float) -> dict[str, float]:
    """The val/* metrics of scored held-out samples; `reward` is the reward call's counters.

    val/accuracy is the fraction of samples scored at least CORRECT, so a fraction in [0, 1]
    whatever the reward's scale; val/score/mean is the mean reward. A failed reward scores 0.
    """
    return {
        "val/accuracy": mean(float(s.reward >= CORRECT) for s in samples),
        "val/score/mean": mean(s.reward for s in samples),
        "val/response_length/mean": mean(len(s.response_ids) for s in samples),
        "val/reward_errors": reward.get("reward/errors", 0.0) + reward.get("reward/timeouts", 0.0),
        "val/version": version,
        **agent_stats(samples, "val/agent"),  # e.g. val/agent/tool_use/mean: held-out tool use
    }
