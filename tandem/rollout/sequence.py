"""Sequence: one `Sample` while a built-in engine generates it. Thin on purpose: the `Sample` stays
the record, and `write_back` appends the new tokens to it when the call ends. `sample_tokens` and
`take_tokens` are how both built-in engines end a step: draw each row's token, record it, and mark
the sequences that now end on a stop token or string."""

from dataclasses import dataclass, field

import torch
from torch import Tensor

from tandem.rollout.call import GenerateCall
from tandem.rollout.sampler import sample_next, seen_tokens, uniform_draws
from tandem.sample import Sample, SamplingParams


@dataclass
class Sequence:
    """Sample `sample` being extended; in the paged engine its blocks in the `BlockManager` are
    named by `seq_id`, and the block manager knows all but the last sampled token, whose keys the
    next decode step computes.

    token_ids = prompt + the response it came with + the new tokens.
    """

    seq_id: int
    sample: Sample
    token_ids: list[int]
    max_tokens: int  # the most tokens token_ids may reach: prompt + the response cap
    new_logprobs: list[float] = field(default_factory=list)
    new_versions: list[int] = field(default_factory=list)
    stopped: bool = False  # ended on a stop token or stop string
    num_computed: int = 0  # leading tokens whose keys are in the cache, while its prompt is prefilled
    routes: Tensor | None = None  # (max_tokens, L, k): each computed token's experts, when recorded

    @classmethod
    def start(cls, seq_id: int, sample: Sample, cap: int) -> "Sequence":
        """`cap`: the most response tokens, counting those the sample comes with."""
        tokens = sample.prompt_ids + sample.response_ids
        return cls(seq_id, sample, list(tokens), len(sample.prompt_ids) + cap)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def response_ids(self) -> list[int]:
        """The whole response so far: the sample's partial, then the new tokens."""
        return self.token_ids[len(self.sample.prompt_ids) :]

    @property
    def at_cap(self) -> bool:
        return len(self.token_ids) >= self.max_tokens

    @property
    def ended(self) -> bool:
        return self.stopped or self.at_cap

    def record(self, token: int, logprob: float, version: int) -> None:
        """One sampled token, from logits the weights of `version` computed."""
        self.token_ids.append(token)
        self.new_logprobs.append(logprob)
        self.new_versions.append(version)

    def write_back(self) -> None:
        """Append the new tokens to the sample; one that has not ended (the call stopped) is ABORTED."""
        new = self.token_ids[len(self.token_ids) - len(self.new_logprobs) :]
        self.sample.extend(new, self.new_logprobs, self.new_versions)
        self.sample.end("stop" if self.stopped else "length" if self.at_cap else "abort")
        if self.routes is not None:
            self.sample.routing = self.routes[: len(self.token_ids)].clone()


def sample_tokens(
    logits: Tensor,
    seqs: list[Sequence],
    params: SamplingParams,
    generator: torch.Generator,
    live: list[bool] | None = None,
) -> tuple[list[int], list[float]]:
    """logits (R, V) of `seqs` -> each row's next token and its logprob (`sample_next`). A seeded
    live sample draws from its own stream at its response position, so its tokens depend on nothing
    else in the batch; the other rows draw from `generator`. live[r] False: row r's sequence has
    ended and its token is dropped (every row is live by default)."""
    draws = seen = seeds = positions = None
    if params.temperature > 0:
        if any(seq.sample.seed is not None for seq in seqs):  # else one draw, no per-row lists
            live = live or [True] * len(seqs)
            seeds = [seq.sample.seed if alive else None for seq, alive in zip(seqs, live, strict=True)]
            positions = [len(seq.token_ids) - len(seq.sample.prompt_ids) for seq in seqs]
        draws = uniform_draws(logits.shape[0], logits.device, generator, seeds, positions)
    if params.repetition_penalty != 1.0:
        seen = seen_tokens([seq.token_ids for seq in seqs], logits.shape[-1], logits.device)
    tokens, logprobs = sample_next(logits, params, draws, seen)
    return tokens.tolist(), logprobs.tolist()


def take_tokens(
    seqs: list[Sequence],
    tokens: list[int],
    logprobs: list[float],
    version: int,
    call: GenerateCall,
    live: list[bool] | None = None,
) -> None:
    """Record each live sequence's new token, from logits of the weights of `version`, and whether
    it now ends on a stop token or a stop string (either wins over the length cap)."""
    taking = []
    for seq, token, logprob, alive in zip(seqs, tokens, logprobs, live or [True] * len(seqs), strict=True):
        if alive:
            seq.record(token, logprob, version)
            seq.stopped = token in call.stop_ids
            taking.append(seq)
    unstopped = [seq for seq in taking if not seq.stopped]
    if call.text is not None and unstopped:
        for seq, end in zip(unstopped, call.ends([seq.response_ids for seq in unstopped]), strict=True):
            seq.stopped = end
