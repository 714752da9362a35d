"""Sums, means, variances and whitening over the positions a 0/1 mask selects.

Positions outside the mask are dropped with `torch.where`, not multiplied by 0, so padding that
holds nan or inf (garbage logprobs past the end of a response) never leaks into a result.
"""

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """x, mask (same shape; mask bool or 0/1 float) -> sum of x where mask != 0, over `dim` or all."""
    kept = torch.where(mask.bool(), x, 0.0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """x, mask (same shape) -> mean of x where mask != 0, over `dim` or all. An empty slice gives 0."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """x, mask (same shape) -> scalar. var = sum_m (x - mean)^2 / (n - 1) (or / n when not unbiased).

    The denominator is at least 1, so one selected value gives 0 rather than nan.
    """
    mean = masked_mean(x, mask)
    n = mask.bool().sum()
    denominator = (n - 1 if unbiased else n).clamp(min=1)
    return masked_sum((x - mean) ** 2, mask) / denominator


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """x, mask (same shape) -> same shape. (x - mean) / (std + eps) over the masked values, 0 elsewhere.

    std is the unbiased one (as verl's `masked_whiten`); eps is added to std, as in GRPO's
    advantage, so both estimators share one convention.
    """
    den = masked_var(x, mask).sqrt() + eps
    # den == 0 only when eps == 0 and the values are all equal: then every whitened value is 0, not nan.
    keep = mask.bool() & (den != 0)
    return torch.where(keep, (x - masked_mean(x, mask)) / den, 0.0)
