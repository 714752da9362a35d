"""Entropy of the policy's next-token distribution, from logits."""

import torch
from torch import Tensor


def entropy_from_logits(logits: Tensor) -> Tensor:
    """logits (B, T, V) -> (B, T). H = logsumexp(z) - sum_v softmax(z)_v · z_v.

    Equal to -sum p log p, but never takes the log of an underflowed probability, and shifting every
    logit by a constant leaves it unchanged. Computed in the logits' dtype: upcast bf16 first if
    the metric must be exact.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
