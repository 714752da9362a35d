"""Turn Samples into padded tensors, and split a batch into micro-batches by a token budget."""

from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.sample import Sample


@dataclass
class Collated:
    """A right-padded micro-batch. `resp_*` tensors are (b, R) and aligned with response tokens."""

    ids: Tensor  # (b, T) prompt + response
    mask: Tensor  # (b, T) bool, real tokens
    resp_index: Tensor  # (b, R) position of the logits that predict each response token
    resp_tokens: Tensor  # (b, R)
    resp_mask: Tensor  # (b, R) float, 1 where the token is trained on


def collate(samples: list[Sample], pad_token_id: int, device: torch.device | str = "cpu") -> Collated:
    b = len(samples)
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    r = max(max(len(s.response_ids) for s in samples), 1)
    ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.bool)
    resp_index = torch.zeros(b, r, dtype=torch.long)
    resp_tokens = torch.full((b, r), pad_token_id, dtype=torch.long)
    resp_mask = torch.zeros(b, r)
    for i, s in enumerate(samples):
        p, n = len(s.prompt_ids), len(s.response_ids)
        ids[i, : p + n] = torch.tensor(s.prompt_ids + s.response_ids)
        mask[i, : p + n] = True
        resp_index[i, :n] = torch.arange(p - 1, p - 1 + n)
        resp_tokens[i, :n] = torch.tensor(s.response_ids, dtype=torch.long)
        resp_mask[i, :n] = torch.tensor(s.loss_mask or [1] * n, dtype=torch.float)
    return Collated(*(t.to(device) for t in (ids, mask, resp_index, resp_tokens, resp_mask)))


def response_logits(model, c: Collated) -> Tensor:
    """One forward over prompt + response -> the logits that predict each response token (b, R, V)."""
    positions = torch.arange(c.ids.shape[1], device=c.ids.device).expand_as(c.ids)
    logits = model(c.ids, positions, c.mask)  # (b, T, V)
    return logits.gather(1, c.resp_index[..., None].expand(-1, -1, logits.shape[-1]))


def pad_rows(rows: list[list[float]], width: int) -> Tensor:
    """Ragged per-token lists -> (B, width) float tensor, zero-padded."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float)
    return out


def micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Index groups whose padded size (count x longest) stays within the budget.

    Sequences are taken shortest first, so each micro-batch holds similar lengths and pads little:
    with heavy-tailed response lengths, padding every row to the longest would multiply the work.
    A sequence longer than the budget gets a micro-batch of its own rather than an error.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        n = lengths[i]
        if current and (len(current) + 1) * max(longest, n) > token_budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups
