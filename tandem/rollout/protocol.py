"""What a generate call asks of an engine: its sampling (`SamplingParams`), how it ends responses on
stop strings (`StopCheck`), and what it does with an update mid-call (`ON_UPDATE_POLICIES`). The
engine contract itself is `RolloutEngine` (rollout/base.py)."""

from dataclasses import dataclass, field
from typing import Protocol

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
