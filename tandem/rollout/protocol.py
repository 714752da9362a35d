"""The rollout engine protocol: what every backend (builtin, paged, vLLM) implements.

Threads: `generate`, `apply_pending` and `load_weights` come from one thread, one call at a time;
`set_pending_update` and `abort` from any thread at any moment. docs/rollout.md has the contract.
"""

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from tandem.sample import Sample

# What a running generate call does with a weight update that arrives mid-call.
ON_UPDATE_POLICIES = ("drain", "abort", "continue")
# Which logprob the engine records per token (docs/rollout.md, "Sampling").
LOGPROBS_MODES = ("raw", "processed")


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


class StopCheck(Protocol):
    """Tells the engine, which has no tokenizer, that a response's text now ends on a stop string
    (`RolloutWorker` builds one from its tokenizer): the last `window` tokens of each live response
    (all of a shorter one) -> whether each ends now."""

    window: int

    def __call__(self, tails: list[list[int]]) -> list[bool]: ...


class RolloutEngine(Protocol):
    """Generates responses and takes new weights, between calls or (per policy) in the middle."""

    @property
    def version(self) -> int:
        """The policy version of the weights the engine now serves."""
        ...

    def generate(
        self, samples: list[Sample], params: SamplingParams, stop_check: StopCheck | None = None
    ) -> list[Sample]:
        """Extend each sample's response to its end and return the same list, on the newest weights
        (a pending update is applied first). A partial response (from an aborted call) is continued,
        to at most `max_new_tokens` in all. Each new token is APPENDED to response_ids, logprobs
        (per `params.logprobs_mode`), versions (of the weights whose forward gave its logits) and
        loss_mask (1). A sample ends FINISHED ("stop", "length") or, when `abort()` or an update
        under "abort" stopped the call, ABORTED ("abort") with the tokens it has so far.

        `stop_check` ends responses on `params.stop` as they decode; an engine that detokenizes
        (vLLM) may ignore it, one that does not raises ValueError when `params.stop` comes alone.
        """
        ...

    def named_weights(self) -> Mapping[str, Tensor]:
        """The tensors, by Hugging Face name with the trainer's shapes and dtypes, that an update's
        `apply()` writes into: the live parameters, or buffers the engine loads from (vLLM)."""
        ...

    def set_pending_update(self, version: int, apply: Callable[[], None]) -> None:
        """Thread-safe. `apply()` copies staged weights of `version` into `named_weights()`, once, on
        the generating thread: at the next generate call, at `apply_pending()`, or between two steps
        under "continue". A later call replaces an update not yet applied. The staged weights must
        not change until it has run (receive the next version into another buffer)."""
        ...

    def apply_pending(self) -> int | None:
        """While idle: apply the pending update now -> its version, or None when none was pending."""
        ...

    def abort(self, samples: Iterable[Sample] | None = None) -> None:
        """Thread-safe. The running generate call stops at its next step and returns its unfinished
        samples ABORTED with their partial responses; with `samples` (matched by group_id and
        index) only those stop. No-op when no call runs; it never carries over to a later call."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """While idle: copy these parameters (Hugging Face names) in now and serve `version`; it
        replaces any pending update."""
        ...

    def rng_state(self) -> Tensor | None:
        """While idle: the state of the stream unseeded requests draw from, for a checkpoint; None
        when the engine cannot restore it."""
        ...

    def set_rng_state(self, state: Tensor) -> None:
        """While idle: continue that stream from a state `rng_state` returned."""
        ...
