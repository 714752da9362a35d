"""An OpenAI agent's episode as chains of completions: what its requests extend and what becomes
its training samples (as AReaL's `openai/cache.py` and slime's `trajectory.py` record them).

A request whose messages are an earlier request's messages, the assistant message the endpoint
returned for it, then new messages EXTENDS that completion: its prompt is the earlier prompt ids +
the generated ids + the new messages' ids (`ChatRenderer.continuation`: nothing is re-tokenized,
and the engine's prefix cache serves the shared prefix). A chain is a first prompt, then every
completion that extends the one before (loss mask 1, behaviour logprobs and versions from the
engine) and everything between them (tool results, user turns: loss mask 0). Every chain that no
later request extended is one training sample, all with the episode's reward: the chain of the
last completion the agent received is the episode's own sample (the group's), and each other one
(an agent that rewrote its history, a sub-agent's calls, choices of an n > 1 request it did not
continue) an extra sample of the episode (`Sample.episode_of`), counted in agent/samples
(docs/agents.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.agent.chat import ChatRenderer, same_message
from tandem.agent.openai_request import Choice, Request
from tandem.sample import Sample

FAULTS = ("errors", "timeouts", "no_calls")  # an episode that ends on one gets reward 0
STATS = ("turns", "tool_calls", "tool_parse_errors", *FAULTS, "bad_requests", "truncated", "samples",
         "prompt_tokens", "reused_prompt_tokens")  # fmt: skip
EXTRA_INDEX = 1 << 16  # an episode's extra samples: index (i + 1) * EXTRA_INDEX + k for the group's sample i


@dataclass
class Chain:
    """Completions that extend each other: one training sample's tokens."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)

    def then(self, context: list[int], s: Sample) -> Chain:
        """This chain, the context ids, then the generated response of `s` (its own prompt is this
        chain's prompt + response + context)."""
        version = s.versions[0] if s.versions else (self.versions[-1] if self.versions else 0)
        return Chain(
            self.prompt_ids,
            self.response_ids + context + s.response_ids,
            self.logprobs + [0.0] * len(context) + s.logprobs,
            self.versions + [version] * len(context) + s.versions,
            self.loss_mask + [0] * len(context) + [1] * len(s.response_ids),
        )

    def fill(self, s: Sample, reward: float, finish: str) -> None:
        """`s` becomes this chain's tokens, FINISHED with the episode's reward."""
        s.prompt_ids = list(self.prompt_ids)
        s.response_ids, s.logprobs = list(self.response_ids), list(self.logprobs)
        s.versions, s.loss_mask = list(self.versions), list(self.loss_mask)
        s.agent_reward = reward
        s.end("length" if finish == "length" else "stop")


@dataclass
class Served:
    """One choice the endpoint returned: what a later request may extend."""

    chain: Chain
    ids: list[int]
    text: str  # the completion's text (plain completions extend on it)
    message: dict | None  # chat: the assistant message returned
    ended_on_eos: bool
    finish: str  # the engine's finish reason: "stop" or "length"
    extended: bool = False  # a served request continued it: its chain is not a sample of its own

    @classmethod
    def of(cls, chain: Chain, s: Sample, choice: Choice, chat: bool, eos: int | None) -> Served:
        """The engine sample `s`, answered as `choice`, ending `chain`."""
        message = None
        if chat:
            message = {"role": "assistant", "content": choice.content}
            if choice.tool_calls:
                message["tool_calls"] = choice.tool_calls
        ended_on_eos = bool(s.response_ids) and s.response_ids[-1] == eos
        return cls(chain, list(s.response_ids), choice.text, message, ended_on_eos, s.finish_reason or "stop")


@dataclass
class Call:
    """A served request: its messages (chat) or prompt text, and its choices."""

    messages: list[dict] | None
    prompt_text: str | None
    prompt_ids: list[int]
    choices: list[Served]

    def context(
        self, choice: Served, r: Request, chat: Callable[[], ChatRenderer], tokenizer
    ) -> list[int] | None:
        """The ids between `choice` of this call and the request `r` when `r` extends it, else None.
        `chat`: the endpoint's renderer (built on first use)."""
        if r.chat and self.messages is not None:
            n = len(self.messages)
            if len(r.messages) <= n + 1 or r.messages[:n] != self.messages:
                return None
            if not same_message(r.messages[n], choice.message or {}):
                return None
            return chat().continuation(r.messages[: n + 1], r.messages[n + 1 :], r.tools, choice.ended_on_eos)
        if not r.chat and self.messages is None:
            if isinstance(r.prompt, list):
                head = self.prompt_ids + choice.ids
                return list(r.prompt[len(head) :]) if r.prompt[: len(head)] == head else None
            if self.prompt_text is not None and r.prompt.startswith(self.prompt_text + choice.text):
                rest = r.prompt[len(self.prompt_text + choice.text) :]
                return tokenizer.encode(rest, add_special_tokens=False) if rest else []
        return None


@dataclass(eq=False)  # compared by identity: `in` over a call's episodes must not compare field by field
class Episode:
    """One agent episode: its group's sample, the task its agent got, the calls it made."""

    id: str
    sample: Sample
    task: dict[str, Any]
    deadline: float
    stats: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STATS, 0.0))
    calls: list[Call] = field(default_factory=list)
    last: Served | None = None  # the last choice the agent received (choice 0 of its last call)
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    future: Any = None
    ended: bool = False  # finished, failed or cancelled: takes no more requests
    aborted: bool = False  # running when the worker was aborted: comes back ABORTED, whatever follows

    def extension(
        self, r: Request, chat: Callable[[], ChatRenderer], tokenizer
    ) -> tuple[Served, list[int], list[int]] | None:
        """(the choice `r` extends, the ids between, the whole prompt ids), the latest call first;
        None when `r` starts a chain of its own."""
        for call in reversed(self.calls):
            for choice in call.choices:
                found = call.context(choice, r, chat, tokenizer)
                if found is not None:
                    return choice, found, call.prompt_ids + choice.ids + found
        return None

    def record(self, call: Call, parent: Served | None, context: list[int]) -> None:
        """A served request, which extended `parent` (None: a fresh chain) after `context` ids."""
        if parent is not None:
            parent.extended = True
        self.calls.append(call)
        self.last = call.choices[0]
        self.stats["turns"] += 1
        self.stats["prompt_tokens"] += len(call.prompt_ids)
        self.stats["reused_prompt_tokens"] += len(call.prompt_ids) - len(context) if parent else 0

    def samples(self, reward: float) -> list[Sample]:
        """The episode's sample becomes its last chain, with `reward` -> its extra samples: the other
        chains no request extended, with the same reward."""
        s = self.sample
        extras = []
        for served in (c for call in self.calls for c in call.choices):
            if served.extended or served is self.last:
                continue
            extra = Sample(s.prompt, [], s.group_id, (s.index + 1) * EXTRA_INDEX + len(extras))
            served.chain.fill(extra, reward, served.finish)
            extra.episode_of = s.index
            extras.append(extra)
        (self.last.chain if self.last is not None else Chain(s.prompt_ids)).fill(s, reward, "stop")
        return extras
