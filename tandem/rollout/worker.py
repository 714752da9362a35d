"""The rollout role: an engine plus the tokenizer that turns its tokens into response text."""

from collections.abc import Iterable

from torch import Tensor

from tandem.rollout.protocol import RolloutEngine, SamplingParams
from tandem.sample import Sample


class RolloutWorker:
    def __init__(self, engine: RolloutEngine, tokenizer):
        self.engine = engine
        self.tokenizer = tokenizer

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        self.engine.generate(samples, params)
        for s in samples:
            s.response_text = self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
        return samples

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        self.engine.load_weights(named_tensors, version)
