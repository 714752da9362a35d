"""The records that flow through tandem: a `Prompt` (one dataset row) and a `Sample` (one response).

One `Sample` travels end to end — engine, reward, buffer, trainer — carrying its tokens, the
behaviour logprob and policy version of every response token, its reward and its status, so no
parallel lists ever need to be kept aligned by hand.
"""

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


@dataclass
class Prompt:
    """One dataset row. Exactly one of `messages` (chat) or `text` (plain) is set.

    `ground_truth`, `data_source` and `extra_info` follow verl's columns; `columns` holds every other
    column of the row, passed to TRL-style reward functions as keyword arguments.
    """

    messages: list[dict[str, str]] | None = None
    text: str | None = None
    ground_truth: Any = None
    data_source: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, Any] = field(default_factory=dict)


class Status(str, Enum):
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class Sample:
    """One response to one prompt. Per-token lists are aligned with `response_ids`."""

    prompt: Prompt
    prompt_ids: list[int]
    group_id: int = 0  # samples of one prompt share a group id (GRPO groups)
    index: int = 0  # position within the group
    response_ids: list[int] = field(default_factory=list)
    response_text: str = ""
    logprobs: list[float] = field(default_factory=list)  # behaviour logprob of each response token
    versions: list[int] = field(default_factory=list)  # policy version that produced each token
    loss_mask: list[int] = field(default_factory=list)  # 1 where the token is trained on
    max_new_tokens: int | None = None  # this request's cap on response tokens; None = the call's
    # Sampling seed of this request: its tokens then do not depend on the rest of its batch. None =
    # the engine's shared generator. Give the samples of one group different seeds, or they agree.
    seed: int | None = None
    ref_logprobs: list[float] = field(default_factory=list)  # reference policy's, when a ref worker ran
    teacher_logprobs: list[float] = field(default_factory=list)  # the teacher's (algo.distill.teacher)
    reward: float = 0.0
    # The reward the episode's agent returned (rollout.agent=openai:...): the reward role takes it
    # as the sample's reward instead of calling reward.fn. None: score it with reward.fn.
    agent_reward: float | None = None
    # An extra sample of one episode (rollout.agent=openai:..., docs/agents.md): the `index` of the
    # group's sample whose episode made it. It shares that sample's reward and advantage, is trained
    # as a row of its own, and is not one of the group's rollout.n. None: a sample of its own.
    episode_of: int | None = None
    reward_parts: dict[str, float] = field(default_factory=dict)
    advantage: float = 0.0
    token_advantages: list[float] = field(default_factory=list)  # a critic's, per token (GAE); else empty
    status: Status = Status.RUNNING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    timings: dict[str, float] = field(default_factory=dict)
    # What the agent loop did in this episode (turns, tool calls, ...): `agent/<name>/mean` metrics.
    # Empty under rollout.agent=single_turn. It travels with the sample, so a re-submitted partial
    # episode keeps counting where it stopped.
    agent_stats: dict[str, float] = field(default_factory=dict)
    # MoE with algo.routing_replay: the experts the engine's forward routed each prompt and response
    # token to, (len(prompt_ids) + len(response_ids), MoE layers, k) int16, -1 where it ran none
    # (the last token, never fed back); the trainer's forward uses them (docs/moe.md).
    routing: "Tensor | None" = None

    @property
    def key(self) -> tuple[int, int]:
        """(group_id, index): names the sample within one generate call (e.g. to `abort` it)."""
        return self.group_id, self.index

    def extend(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        """Append newly generated response tokens, each with its behaviour logprob and the policy
        version whose forward gave its logits; they are trained on (loss mask 1)."""
        self.response_ids = self.response_ids + list(ids)
        self.logprobs = self.logprobs + list(logprobs)
        self.versions = self.versions + list(versions)
        self.loss_mask = self.loss_mask + [1] * len(ids)

    def extend_context(self, ids: list[int], version: int | None = None) -> None:
        """Append tokens the policy did not sample — a tool's output in a multi-turn episode: they
        condition the tokens after them but are never trained on (loss mask 0, logprob 0.0).

        Their version is `version`, by default that of the newest response token (a ValueError
        when there is none): the context arrives after that token, and taking its version keeps
        `version_span`, hence staleness, exactly what the generated tokens make it."""
        if version is None:
            if not self.versions:
                raise ValueError("extend_context on an empty response needs a version")
            version = self.versions[-1]
        self.response_ids = self.response_ids + list(ids)
        self.logprobs = self.logprobs + [0.0] * len(ids)
        self.versions = self.versions + [version] * len(ids)
        self.loss_mask = self.loss_mask + [0] * len(ids)

    def end(self, reason: str) -> None:
        """The engine is done with it: "stop" / "length" finish it, "abort" returns it as a partial
        to continue in a later call."""
        if reason not in ("stop", "length", "abort"):
            raise ValueError(f"finish_reason={reason!r}; valid: stop, length, abort")
        self.status = Status.ABORTED if reason == "abort" else Status.FINISHED
        self.finish_reason = reason

    @property
    def version_span(self) -> tuple[int, int]:
        """(oldest, newest) policy version among the response tokens; (-1, -1) when empty."""
        if not self.versions:
            return (-1, -1)
        return (min(self.versions), max(self.versions))


def episodes(samples: list[Sample]) -> list[Sample]:
    """The samples that are episodes of their own: without an episode's extra samples."""
    return [s for s in samples if s.episode_of is None]
