"""The loop's statistics: each step's batch statistics under verl's metric names (`rollout_stats`),
the held-out ones (`val_stats`, val/*), the counters per train step, each step's metrics line, the
learning checks and the summary (`StepMetrics`).

Counters (rollout aborts and restarts, reward errors and timeouts, DAPO's filter) add up over a
step's window and start again at zero; the rewards scored and failed add up over the run.
"""

import math
from statistics import mean

from tandem.buffer import RolloutBuffer
from tandem.controller.timeline import Timeline
from tandem.errors import TandemError
from tandem.sample import Sample, episodes


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
        **_summary("critic/score", [s.reward for s in episodes(samples)]),
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
    samples = episodes(samples)  # an episode's extra samples carry none
    names = sorted({k for s in samples for k in s.agent_stats})
    return {f"{prefix}/{k}/mean": mean(float(s.agent_stats.get(k, 0.0)) for s in samples) for k in names}


CORRECT = 1.0  # the full score of every built-in verifier: a held-out sample scored this is right


def val_stats(samples: list[Sample], reward: dict[str, float], version: float) -> dict[str, float]:
    """The val/* metrics of scored held-out samples; `reward` is the reward call's counters.

    val/accuracy is the fraction of samples scored at least CORRECT, so a fraction in [0, 1]
    whatever the reward's scale; val/score/mean is the mean reward. A failed reward scores 0.
    """
    parts = sorted({k for s in samples for k in s.reward_parts})
    return {
        "val/accuracy": mean(float(s.reward >= CORRECT) for s in samples),
        "val/score/mean": mean(s.reward for s in samples),
        "val/response_length/mean": mean(len(s.response_ids) for s in samples),
        "val/reward_errors": reward.get("reward/errors", 0.0) + reward.get("reward/timeouts", 0.0),
        "val/version": version,
        **agent_stats(samples, "val/agent"),  # e.g. val/agent/tool_use/mean: held-out tool use
        # a verifier's parts, e.g. the addition verifier's strict accuracy (the bare answer alone)
        **{f"val/{k}/mean": mean(float(s.reward_parts.get(k, 0.0)) for s in samples) for k in parts},
    }


DEAD_STEPS = 5  # consecutive steps with nothing to learn from that end a run (`check_learning`)

STEP_COUNTERS = (
    "rollout/aborted",
    "rollout/restarts",
    "reward/errors",
    "reward/timeouts",
    "reward/output_bytes",
)
FILTER_COUNTERS = ("filter/dropped_groups", "filter/extra_prompts")


CLIPPED_WARNING = 0.25  # the share of a step's responses cut at max_new_tokens that gets a warning


def zero_signal_advice(m: dict[str, float]) -> str:
    """Why a step whose every advantage is 0 learned nothing, and what to change, by its rewards:
    all right, all wrong, or each group uniform."""
    score, clipped = m.get("critic/score/mean", math.nan), m.get("response_length/clip_ratio", 0.0)
    low, high = m.get("critic/score/min", score), m.get("critic/score/max", score)
    head = (
        f"within each group every response got the same reward (mean {score:.3g}), so the policy "
        "gradient is 0. "
    )
    if low == high and high >= CORRECT:
        return head + "Every response was right: the task is solved (lower run.steps, or a harder task)"
    if low == high:
        cut = (
            f"{100 * clipped:.0f}% of the responses were cut at rollout.max_new_tokens (raise it first); "
            if clipped > 0
            else ""
        )
        return head + (
            f"No response was right: {cut}a small model's samples are rarely right at a high "
            "rollout.temperature (0.5-0.7 suits a 100M-parameter instruct model), or the task is too hard "
            "for it (an easier task, a warm start, an instruction in data.system_prompt that asks for the "
            "answer's format, or a larger rollout.n)"
        )
    return head + (
        "Groups differ but each is uniform: raise rollout.n (more samples a prompt) or rollout.temperature "
        "(more varied samples)"
    )


def clipped_warning(m: dict[str, float], max_new_tokens: int) -> str | None:
    """A warning line when at least CLIPPED_WARNING of a step's responses hit the length limit."""
    clipped = m.get("response_length/clip_ratio", 0.0)
    if clipped < CLIPPED_WARNING:
        return None
    return (
        f"warning: {100 * clipped:.0f}% of step {int(m.get('version', 0))}'s responses were cut at "
        f"rollout.max_new_tokens={max_new_tokens} (response_length/clip_ratio): a cut answer usually "
        "scores 0. Raise rollout.max_new_tokens, or ask for shorter answers."
    )


class StepMetrics:
    def __init__(self, filtering: bool):
        self.filtering = filtering  # DAPO's dynamic sampling: its counters too
        self.extra = self.zeroed()  # this step's counters (and the engines' sleep figures)
        self.rewards = {"scored": 0.0, "failed": 0.0}  # training samples, over the run
        self.window = {"scored": 0.0, "failed": 0.0}  # and in this step's window
        self.rewards_in_step = dict(self.window)  # the last step's window
        self.last: dict[str, float] = {}  # the latest step's line
        self.dead = 0  # the latest consecutive steps that learned nothing
        self.started = self.step_start = 0.0

    def zeroed(self) -> dict[str, float]:
        return dict.fromkeys((*STEP_COUNTERS, *(FILTER_COUNTERS if self.filtering else ())), 0.0)

    def start(self, now: float) -> None:
        self.started = self.step_start = now

    def count(self, key: str, value: float = 1.0) -> None:
        self.extra[key] = self.extra.get(key, 0.0) + value

    def rewarded(self, samples: list[Sample], metrics: dict[str, float]) -> None:
        """A reward call's counters, and its samples scored (or failed) over the run."""
        for k, v in metrics.items():
            self.count(k, v)
        failed = metrics.get("reward/errors", 0.0) + metrics.get("reward/timeouts", 0.0)
        for counts in (self.rewards, self.window):
            counts["scored"] += len(samples)
            counts["failed"] += failed

    def slept(self, metrics: dict[str, float]) -> None:
        """A rollout engine freed its memory: the bytes add up, the workers slept (and woke) in parallel."""
        self.count("memory/engine_bytes", metrics["memory/engine_bytes"])
        for k in ("perf/sleep_s", "perf/wake_s"):
            self.extra[k] = max(self.extra.get(k, 0.0), metrics[k])

    def step(
        self,
        batch: list[Sample],
        train: dict[str, float],
        version: int,
        buffer: RolloutBuffer,
        timeline: Timeline,
        now: float,
    ) -> dict[str, float]:
        """The line of the step that made `version` from `batch`; the counters start again."""
        wall = now - self.step_start
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in batch)
        self.last = {
            **rollout_stats(batch, version - 1),
            **train,
            **self.extra,
            **buffer.stats(),
            **timeline.idle_ratios(self.step_start, now),
            **timeline.seconds_by_name(self.step_start, now),
            "timing_s/step": wall,
            "perf/samples_per_s": len(batch) / wall,
            "perf/throughput_tokens_per_s": tokens / wall,
            "version": float(version),
        }
        self.extra, self.step_start = self.zeroed(), now
        self.rewards_in_step, self.window = self.window, {"scored": 0.0, "failed": 0.0}
        return self.last

    def summary(self, trained: int, val: dict[int, dict], steps: int, now: float) -> dict[str, float]:
        """`trained` samples in this process; `val`: validation metrics by version; `steps` the last."""
        out = {
            "critic/score/mean_final": self.last.get("critic/score/mean", math.nan),
            "perf/run_samples_per_s": trained / (now - self.started),
            "reward/failed_fraction": self.rewards["failed"] / max(self.rewards["scored"], 1.0),
        }
        if 0 in val and steps in val:
            start, end = val[0]["val/accuracy"], val[steps]["val/accuracy"]
            out |= {
                "val/accuracy_start": start,
                "val/accuracy_final": end,
                "val/accuracy_gain_points": 100 * (end - start),
            }
        return out

    def check_learning(self, version: int, steps: int, first: int) -> None:
        """A TandemError once DEAD_STEPS consecutive steps had nothing to learn from: every reward
        failed or every update was skipped for a non-finite loss or gradient (then also every step
        of a shorter run, counted from `first`), or every advantage was 0 (a short smoke run of an
        untrained model may well see only that, so it needs all DEAD_STEPS). The run would exit 0
        having learned nothing, so it ends non-zero and says which."""
        m, rewards = self.last, self.rewards_in_step
        broken = min(DEAD_STEPS, steps - first)
        if rewards["failed"] >= rewards["scored"] > 0:
            why = "every reward failed (reward/errors, reward/timeouts; the reward worker's log says why)"
        elif m.get("actor/skipped_fraction", 0.0) == 1.0:
            why = (
                "every update was skipped for a non-finite loss or gradient (actor/skipped_steps): "
                "check the rewards' scale and the weights (e.g. a checkpoint that was trained into NaN)"
            )
        elif m.get("critic/advantages/max", 1.0) == 0.0 == m.get("critic/advantages/min", 1.0):
            why = f"every advantage was 0: {zero_signal_advice(m)}"
            broken = DEAD_STEPS
        else:
            self.dead = 0
            return
        self.dead += 1
        if self.dead >= broken:
            raise TandemError(
                f"{self.dead} step{'s' * (self.dead > 1)} in a row (to step {version}) learned nothing; "
                f"in the last, {why}. "
                "The run stops instead of exiting 0 with nothing learned; metrics.jsonl has every "
                "step's figures."
            )
