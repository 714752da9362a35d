"""GenerateCall: one generate call's request, checked once for every engine."""

from dataclasses import dataclass

from tandem.rollout.protocol import StopCheck
from tandem.sample import Sample, SamplingParams


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
        """The checked request; ValueError on a partial response whose per-token lists are not
        aligned, or stop strings with no check for an engine that has no tokenizer."""
        for s in samples:
            for name in ("logprobs", "versions", "loss_mask"):
                if len(getattr(s, name)) != len(s.response_ids):
                    raise ValueError(
                        f"Sample (group {s.group_id}, index {s.index}) has {len(s.response_ids)} "
                        f"response_ids but {len(getattr(s, name))} {name}; a partial response must "
                        "keep its per-token lists aligned."
                    )
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
        w = self.text.window
        return self.text([ids[max(0, len(ids) - w) :] for ids in responses])
