"""GenerateCall: one generate call's request, checked once for every engine.

What the engines share before their first step: the per-token lists of partial responses are
aligned, stop strings come with a check (or the engine detokenizes itself), the stop ids, and the
samples that need no new token at all (a partial that already ends) are finished up front.
"""

from dataclasses import dataclass

from tandem.rollout.protocol import SamplingParams, StopCheck
from tandem.sample import Sample


@dataclass
class GenerateCall:
    """params: the call's sampling; stop_ids: tokens that end a response ([] when decoding past
    EOS); text: the stop-string check to run while decoding, None without stop strings."""

    params: SamplingParams
    stop_ids: list[int]
    text: StopCheck | None

    @classmethod
    def check(
        cls,
        samples: list[Sample],
        params: SamplingParams,
        stop_check: StopCheck | None,
        eos_token_ids: list[int],
        detokenizes: bool = False,
    ) -> "GenerateCall":
        """The checked request; ValueError on misaligned partials, or stop strings with no check
        for an engine that has no tokenizer (`detokenizes=False`)."""
        for s in samples:
            check_aligned(s)
        past_eos = params.past_eos
        if params.stop and not past_eos and stop_check is None and not detokenizes:
            raise ValueError(
                "SamplingParams.stop needs a stop_check (the engine has no tokenizer): "
                "generate through RolloutWorker, which builds one."
            )
        stop_ids = [] if past_eos else list(eos_token_ids) + list(params.stop_token_ids)
        return cls(params, stop_ids, stop_check if params.stop and not past_eos else None)

    def cap(self, s: Sample) -> int:
        """The most response tokens this sample may have: its own cap, within the call's."""
        return min(s.max_new_tokens or self.params.max_new_tokens, self.params.max_new_tokens)

    def needs_tokens(self, s: Sample) -> bool:
        """False, after finishing it, for a sample whose response needs no new token: it ends on a
        stop token or stop string, or is at its length cap."""
        ids = s.response_ids
        if ids and (ids[-1] in self.stop_ids or (self.text is not None and self.ends([ids])[0])):
            s.end("stop")
        elif len(ids) >= self.cap(s):
            s.end("length")
        else:
            return True
        return False

    def ends(self, responses: list[list[int]]) -> list[bool]:
        """Whether each response now ends on a stop string (the check sees its last tokens only)."""
        assert self.text is not None
        return self.text([tail_tokens(ids, self.text.window) for ids in responses])


def check_aligned(s: Sample) -> None:
    lists = {"logprobs": s.logprobs, "versions": s.versions, "loss_mask": s.loss_mask}
    for name, values in lists.items():
        if len(values) != len(s.response_ids):
            raise ValueError(
                f"Sample (group {s.group_id}, index {s.index}) has {len(s.response_ids)} response_ids "
                f"but {len(values)} {name}; a partial response must keep its per-token lists aligned."
            )


def tail_tokens(ids: list[int], n: int) -> list[int]:
    return ids[max(0, len(ids) - n) :]
