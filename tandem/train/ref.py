"""The reference worker: a frozen copy of the initial policy that scores samples as they arrive.

Run as its own actor, it fills `Sample.ref_logprobs` while the trainer is busy with an earlier batch
(the seeds' "async ref_logp"), so the KL term costs the train step no forward pass. The teacher of
on-policy distillation is the same worker on the teacher's model, filling `Sample.teacher_logprobs`.
"""

from tandem.model.decoder import CausalLM
from tandem.sample import Sample
from tandem.train.batch import sequence_logprobs


class RefWorker:
    def __init__(
        self, model: CausalLM, token_budget: int, temperature: float = 1.0, into: str = "ref_logprobs"
    ):
        """model: on its device, in the compute dtype (frozen: nothing rounds away); into: the
        Sample field its logprobs go to."""
        self.model = model.eval().requires_grad_(False)
        self.into = into
        self.token_budget = token_budget
        self.temperature = temperature if temperature > 0 else 1.0

    def score(self, samples: list[Sample]) -> list[Sample]:
        """Sets each sample's `ref_logprobs` (or `into`'s field), one per response token."""
        logp = sequence_logprobs(self.model, samples, self.token_budget, self.temperature)
        for s, row in zip(samples, logp, strict=True):
            setattr(s, self.into, row[: len(s.response_ids)].tolist())
        return samples
