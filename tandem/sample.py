"""The records that flow through tandem: a `Prompt` (one dataset row), a `Sample` (one response), and
the `SamplingParams` of the generate call that makes it.

One `Sample` travels end to end — engine, reward, buffer, trainer — carrying its tokens, the
behaviour logprob and policy version of every response token, its reward and its status, so no
parallel lists ever need to be kept aligned by hand.
"""

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


# Which logprob the engine records per token (docs/rollout.md, "Sampling").
LOGPROBS_MODES = ("raw", "processed")


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
    # The adapter of the engine's table (`DecoderEngine.load_adapters`) its rows take, by name, in a
    # call of rows of several adapters (tandem serve's); None: the weights the engine serves.
    adapter: str | None = None
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


@dataclass
class SamplingParams:
    """How one generate call samples (docs/rollout.md, "Sampling"); the defaults are plain softmax
    sampling at `temperature`. Per-request settings live on the `Sample` (`max_new_tokens`, `seed`)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off; drop tokens below min_p x the top token's probability (after T)
    repetition_penalty: float = 1.0  # 1 = off; HF/vLLM rule on the prompt's and response's tokens
    max_new_tokens: int = 16  # per sample, counting the tokens of a partial response it comes with
    stop_token_ids: list[int] = field(default_factory=list)
    # A response ends with the token that completes one of these in its text (a `StopCheck`).
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # vLLM's default: response_text ends before it
    # "raw": log softmax(logits / T) of the unmodified model, what the trainer recomputes;
    # "processed": the renormalized distribution sampled from (penalty, min-p, top-k, top-p).
    logprobs_mode: str = "raw"
    # Keep decoding past EOS to each sample's length cap, but count the response only up to its
    # first EOS (text, reward and loss mask stop there): emulates long generations in benchmarks.
    decode_past_eos: bool = False
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks); no stop token or string

    @property
    def past_eos(self) -> bool:
        """Decoding goes on past EOS (ignore_eos, decode_past_eos): no stop token or string ends it."""
        return self.ignore_eos or self.decode_past_eos

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r}; valid: {', '.join(LOGPROBS_MODES)}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1] (0 = off)")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1 = off)")
        if isinstance(self.stop, str) or any(not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} must be a list of non-empty strings")


def episodes(samples: list[Sample]) -> list[Sample]:
    """The samples that are episodes of their own: without an episode's extra samples."""
    return [s for s in samples if s.episode_of is None]
