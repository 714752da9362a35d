"""The reference worker: a frozen copy of the initial policy that scores samples as they arrive.

Run as its own actor, it fills `Sample.ref_logprobs` while the trainer is busy with an earlier batch
(the seeds' "async ref_logp"), so the KL term costs the train step no forward pass.
"""

import torch
from torch import Tensor

from tandem.model import CausalLM, token_logprobs
from tandem.sample import Sample
from tandem.train.batch import collate, micro_batches, response_logits


@torch.no_grad()
def sequence_logprobs(
    model: CausalLM,
    samples: list[Sample],
    pad_token_id: int,
    token_budget: int,
    temperature: float = 1.0,
    rows: list[int] | None = None,
) -> Tensor:
    """Logprobs of every response token under `model` -> (B, R_max), 0 past each response's end.

    rows: compute only these samples (a data-parallel rank's share); the other rows stay 0.
    """
    width = max(max(len(s.response_ids) for s in samples), 1)
    out = torch.zeros(len(samples), width)
    device = next(model.parameters()).device
    rows = list(range(len(samples))) if rows is None else rows
    lengths = [len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in rows]
    for part in micro_batches(lengths, token_budget):
        idx = [rows[j] for j in part]
        c = collate([samples[i] for i in idx], pad_token_id, device)
        logp = token_logprobs(response_logits(model, c), c.resp_tokens, temperature)
        out[idx, : logp.shape[1]] = logp.cpu() * c.resp_mask.cpu()
    return out


class RefWorker:
    def __init__(self, model: CausalLM, pad_token_id: int, token_budget: int, temperature: float = 1.0):
        self.model = model.eval().requires_grad_(False)
        self.pad_token_id, self.token_budget = pad_token_id, token_budget
        self.temperature = temperature if temperature > 0 else 1.0

    def score(self, samples: list[Sample]) -> list[Sample]:
        """Sets each sample's `ref_logprobs` (one per response token)."""
        logp = sequence_logprobs(self.model, samples, self.pad_token_id, self.token_budget, self.temperature)
        for s, row in zip(samples, logp, strict=True):
            s.ref_logprobs = row[: len(s.response_ids)].tolist()
        return samples
