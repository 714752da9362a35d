"""The rollout role: an engine plus the tokenizer that turns its tokens into response text."""

from collections.abc import Callable, Iterable

from torch import Tensor

from tandem.rollout.protocol import RolloutEngine, SamplingParams
from tandem.sample import Sample

# Extra tokens a stop-string window decodes, for what decoding a window alone gets wrong at its
# start: a leading space SentencePiece drops, a character whose first bytes fall before the window.
STOP_WINDOW_SLACK = 4


class StopStrings:
    """The `StopCheck` for `params.stop`: decode the tail of each live response, look for the
    stop strings in it.

    Why a check handed to the engine rather than a `decode` callable the engine would hold: the
    engine stays free of text — it only learns "this response ends here" after each decode step,
    the way vLLM's scheduler asks its stop checker — while tokenizer, stop strings and the cut of
    the text stay together here, and an engine with its own detokenizer can ignore the check.

    `window`: a stop string of n UTF-8 bytes spans at most n tokens (every token holds at least one
    byte) and, checked after every token, it ends in the newest one; so the last n tokens plus
    `STOP_WINDOW_SLACK` hold it. Decoding that window instead of the whole response keeps the cost
    per step at one short decode per live response, whatever the response length.
    """

    def __init__(self, tokenizer, stop: list[str]):
        if not stop:
            raise ValueError("StopStrings needs at least one stop string")
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.window = max(len(s.encode()) for s in self.stop) + STOP_WINDOW_SLACK

    def __call__(self, tails: list[list[int]]) -> list[bool]:
        texts = (self.tokenizer.decode(t, skip_special_tokens=True) for t in tails)
        return [any(s in text for s in self.stop) for text in texts]

    def cut(self, text: str, include_stop: bool) -> str:
        """The text up to its first stop string: before it, or through it with `include_stop`."""
        found = [(i, len(s)) for s in self.stop if (i := text.find(s)) >= 0]
        if not found:
            return text
        start, length = min(found, key=lambda f: (f[0], -f[1]))  # first; the longest at a tie
        return text[: start + length] if include_stop else text[:start]


class RolloutWorker:
    """Passes calls to the engine (its contracts are in `RolloutEngine`) and decodes responses."""

    def __init__(self, engine: RolloutEngine, tokenizer):
        self.engine = engine
        self.tokenizer = tokenizer

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        """The engine's generate, then `response_text` for every sample. With `params.stop` the
        engine ends a response at the token completing a stop string; its text ends before the
        stop string (vLLM's default) or, with `include_stop_str_in_output`, right after it."""
        stop = StopStrings(self.tokenizer, params.stop) if params.stop and not params.past_eos else None
        self.engine.generate(samples, params, stop_check=stop)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        for s in samples:  # partials too: a continued response must not keep its old text
            ids = s.response_ids
            if params.decode_past_eos and eos in ids:  # the response proper ends at its first EOS
                end = ids.index(eos) + 1
                ids, s.loss_mask = ids[:end], [1] * end + [0] * (len(ids) - end)
            s.response_text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if stop is not None:
                s.response_text = stop.cut(s.response_text, params.include_stop_str_in_output)
        return samples

    def set_pending_update(self, version: int, apply: Callable[[], None]) -> None:
        self.engine.set_pending_update(version, apply)

    def apply_pending(self) -> int | None:
        return self.engine.apply_pending()

    def abort(self, samples: Iterable[Sample] | None = None) -> None:
        self.engine.abort(samples)

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        self.engine.load_weights(named_tensors, version)
