"""The rollout engine protocol: what every backend (built-in, later vLLM) implements.

Threads: `generate`, `apply_pending` and `load_weights` are called from one thread, one call at a
time; `set_pending_update` and `abort` may be called from any other thread at any moment.
docs/rollout.md describes the contract in full.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from tandem.sample import Sample

# What a running generate call does with a weight update that arrives mid-call.
ON_UPDATE_POLICIES = ("drain", "abort", "continue")


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 16  # per sample, counting the tokens of a partial response it comes with
    stop_token_ids: list[int] = field(default_factory=list)
    # Keep decoding past EOS to each sample's length cap, but count the response only up to its
    # first EOS (text, reward and loss mask stop there): emulates long generations in benchmarks.
    decode_past_eos: bool = False
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks)


class RolloutEngine(Protocol):
    """Generates responses and takes new weights, between calls or (per policy) in the middle."""

    @property
    def version(self) -> int:
        """The policy version of the weights the engine now serves."""
        ...

    def generate(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        """Extend each sample's response to its end and return the same list.

        First applies any pending update, so every call starts on the newest weights. A sample may
        come with a partial response (from an aborted call): generation continues after it, at most
        `max_new_tokens` in all, and the new tokens are APPENDED to response_ids, logprobs (the
        behaviour logprob: log-softmax of the logits sampled from), versions (the version of the
        weights whose forward produced the token's logits) and loss_mask (1). Each sample ends
        FINISHED with finish_reason "stop" or "length", or — when `abort()` or an update under the
        "abort" policy stopped the call — ABORTED with "abort" and the tokens it has so far.
        """
        ...

    def set_pending_update(self, version: int, apply: Callable[[], None]) -> None:
        """Thread-safe. `apply()` copies staged weights of `version` into the engine's model.

        It is called once, on the generating thread: at the start of the next generate call, at
        `apply_pending()`, or between two decode steps under the "continue" policy. A later call
        replaces an earlier update not yet applied. The staged weights must not change until it has
        run (receive the next version into another buffer).
        """
        ...

    def apply_pending(self) -> int | None:
        """From the generating thread while no generate call runs: apply the pending update now.
        Returns its version, or None when none was pending."""
        ...

    def abort(self) -> None:
        """Thread-safe. The running generate call stops at its next decode step and returns its
        unfinished samples ABORTED with their partial responses. No-op when no call runs; it never
        carries over to a later call."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """While idle: copy the given parameters (Hugging Face names) into the engine's model now
        and serve `version`; it replaces any pending update."""
        ...
