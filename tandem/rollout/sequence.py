"""Sequence: one `Sample` while the paged engine generates it. Thin on purpose: the `Sample` stays
the record, and `write_back` appends the new tokens to it when the call ends."""

from dataclasses import dataclass, field

from torch import Tensor

from tandem.sample import Sample


@dataclass
class Sequence:
    """Sample `sample` being extended; its blocks in the `BlockManager` are named by `seq_id`.

    token_ids = prompt + the response it came with + the new tokens. The block manager knows all
    but the last sampled token, whose keys the next decode step computes.
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
