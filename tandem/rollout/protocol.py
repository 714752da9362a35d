"""The rollout engine protocol: what every backend (built-in, later vLLM) implements."""

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from tandem.sample import Sample


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks)


class RolloutEngine(Protocol):
    """Generates responses and takes new weights. `version` is the policy version it now serves."""

    version: int

    def generate(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        """Fill each sample's response_ids, logprobs, versions, loss_mask, status and finish_reason."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Copy the given parameters (Hugging Face names) into the engine's model; serve `version`."""
        ...
