"""What a generate call asks of an engine beyond its sampling (`SamplingParams`, beside `Sample` in
tandem/sample.py): how it ends responses on stop strings (`StopCheck`), and what it does with an
update mid-call (`ON_UPDATE_POLICIES`). The engine contract itself is `RolloutEngine`
(rollout/base.py)."""

from typing import Protocol

# What a running generate call does with a weight update that arrives mid-call.
ON_UPDATE_POLICIES = ("drain", "abort", "continue")


class StopCheck(Protocol):
    """Tells the engine, which has no tokenizer, that a response's text now ends on a stop string
    (`RolloutWorker` builds one from its tokenizer): the last `window` tokens of each live response
    (all of a shorter one) -> whether each ends now."""

    window: int

    def __call__(self, tails: list[list[int]]) -> list[bool]: ...
