"""The rollout role: an engine plus the tokenizer that turns its tokens into response text."""

from collections.abc import Callable, Iterable

from torch import Tensor

from tandem.rollout.protocol import RolloutEngine, SamplingParams
from tandem.sample import Sample


class RolloutWorker:
    """Passes calls to the engine (its contracts are in `RolloutEngine`) and decodes responses."""

    def __init__(self, engine: RolloutEngine, tokenizer):
        self.engine = engine
        self.tokenizer = tokenizer

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        self.engine.generate(samples, params)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        for s in samples:  # partials too: a continued response must not keep its old text
            ids = s.response_ids
            if params.decode_past_eos and eos in ids:  # the response proper ends at its first EOS
                end = ids.index(eos) + 1
                ids, s.loss_mask = ids[:end], [1] * end + [0] * (len(ids) - end)
            s.response_text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return samples

    def set_pending_update(self, version: int, apply: Callable[[], None]) -> None:
        self.engine.set_pending_update(version, apply)

    def apply_pending(self) -> int | None:
        return self.engine.apply_pending()

    def abort(self) -> None:
        self.engine.abort()

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        self.engine.load_weights(named_tensors, version)
