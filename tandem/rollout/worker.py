"""The rollout role: an engine, the agent loop run above it, and the tokenizer that turns tokens
into response text."""

import threading
from collections.abc import Callable, Iterable

from torch import Tensor

from tandem.agent import AgentLoop, SingleTurn, context_end
from tandem.rollout.base import RolloutEngine
from tandem.sample import Sample, SamplingParams

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
        return [self._ends(t) for t in tails]

    def _ends(self, tail: list[int]) -> bool:
        """A stop string ends in the newest token: one more occurrence than without it. Not just
        "in the window": in a multi-turn episode the window may still hold an earlier turn's stop
        string (a tool call's closing tag) right after the tool's output."""
        text = self.tokenizer.decode(tail, skip_special_tokens=True)
        found = [s for s in self.stop if s in text]
        if not found:  # the usual case: one decode
            return False
        before = self.tokenizer.decode(tail[:-1], skip_special_tokens=True)
        return any(text.count(s) > before.count(s) for s in found)

    def cut(self, text: str, include_stop: bool) -> str:
        """The text up to its first stop string: before it, or through it with `include_stop`."""
        found = [(i, len(s)) for s in self.stop if (i := text.find(s)) >= 0]
        if not found:
            return text
        start, length = min(found, key=lambda f: (f[0], -f[1]))  # first; the longest at a tie
        return text[: start + length] if include_stop else text[:start]


class RolloutWorker:
    """Runs the agent loop over the engine (its contracts are in `RolloutEngine`, `AgentLoop`) and
    decodes responses. The default agent, `SingleTurn`, makes one engine call per generate call."""

    def __init__(self, engine: RolloutEngine, tokenizer, agent: AgentLoop | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.agent = agent if agent is not None else SingleTurn(tokenizer)
        self._lock = threading.Lock()  # guards the three fields below, shared with abort()
        self._running = False
        self._abort_all = False
        self._aborted: set[tuple[int, int]] = set()

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        """The agent's episodes (single_turn: the engine's generate), then `response_text` for every
        sample. With `params.stop` the engine ends a response at the token completing a stop string;
        its text ends before the stop string (vLLM's default) or, with
        `include_stop_str_in_output`, right after it (in a multi-turn response, the first stop
        string after its last context token)."""
        with self._lock:
            self._running, self._abort_all, self._aborted = True, False, set()
        try:
            samples = self.agent.run(self._turn, samples, params)  # + an episode's extra samples
        finally:
            with self._lock:
                self._running = False
        stop = self._stop_check(params)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        for s in samples:  # partials too: a continued response must not keep its old text
            ids = s.response_ids
            if params.decode_past_eos and eos in ids:  # the response proper ends at its first EOS
                end = ids.index(eos) + 1
                ids, s.loss_mask = ids[:end], [1] * end + [0] * (len(ids) - end)
            s.response_text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if stop is not None:
                context = context_end(s)  # the cut looks only at the last turn's text
                head = len(self.tokenizer.decode(ids[:context], skip_special_tokens=True)) if context else 0
                text = s.response_text
                s.response_text = text[:head] + stop.cut(text[head:], params.include_stop_str_in_output)
        return samples

    def _turn(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        """One engine call: the agent's `turn`. After `abort()` it starts none: the samples come
        back ABORTED with what they have (and only those `abort(samples)` named, for them)."""
        with self._lock:
            aborted = {s.key for s in samples if self._abort_all or s.key in self._aborted}
        for s in samples:
            if s.key in aborted:
                s.end("abort")
        samples = [s for s in samples if s.key not in aborted]
        if samples:
            self.engine.generate(samples, params, stop_check=self._stop_check(params))
        return samples

    def _stop_check(self, params: SamplingParams) -> StopStrings | None:
        return StopStrings(self.tokenizer, params.stop) if params.stop and not params.past_eos else None

    def set_pending_update(self, version: int, apply: Callable[[], None]) -> None:
        self.engine.set_pending_update(version, apply)

    def apply_pending(self) -> int | None:
        return self.engine.apply_pending()

    def abort(self, samples: Iterable[Sample] | None = None) -> None:
        """The engine's abort, and no further turn of the running call's episodes (for `samples`
        only: of theirs); a no-op while no call runs."""
        samples = None if samples is None else list(samples)
        with self._lock:
            if not self._running:
                return
            if samples is None:
                self._abort_all = True
            else:
                self._aborted.update(s.key for s in samples)
        self.engine.abort(samples)

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        self.engine.load_weights(named_tensors, version)
