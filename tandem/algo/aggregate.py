"""Loss aggregation: a (B, T) per-token loss -> one scalar.

The trainer splits a mini-batch into micro-batches and sums their aggregated losses, so every mode
divides by counts of the WHOLE mini-batch when given (global_tokens, global_seqs, norm_len); the
sum over micro-batches then equals the aggregate of the mini-batch. Without them a call counts its
own batch. A sequence counts only if it has at least one masked token: a row with none (padding,
a response whose every token is masked out) contributes nothing and must not dilute the mean.

Every mode: fn(loss_mat (B, T), mask (B, T), *, global_tokens=None, global_seqs=None,
norm_len=None) -> scalar. Counts below 1 count as 1, so an empty batch gives 0, not nan. The three
counts are context the trainer passes to every mode; a mode drops the ones it does not divide by.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from tandem.algo.masked import masked_mean, masked_sum
from tandem.registry import OptionRegistry

AggFn = Callable[..., Tensor]
LOSS_AGGS: OptionRegistry[AggFn] = OptionRegistry(
    "loss aggregation", context=["global_tokens", "global_seqs", "norm_len"]
)


def _count(given: float | Tensor | None, local: Tensor | int, like: Tensor) -> Tensor:
    """The global count when given, else this call's own; as a scalar in like's dtype, at least 1."""
    count = local if given is None else given
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1)


def active_seqs(mask: Tensor) -> Tensor:
    """mask (B, T) -> scalar: the number of rows with at least one masked token."""
    return mask.bool().any(dim=-1).sum()


@LOSS_AGGS.register("token-mean")
def token_mean(loss_mat: Tensor, mask: Tensor, *, global_tokens: float | Tensor | None = None) -> Tensor:
    """loss_mat, mask (B, T) -> scalar. sum(loss · mask) / global_tokens (default: mask.sum())."""
    return masked_sum(loss_mat, mask) / _count(global_tokens, mask.bool().sum(), loss_mat)


@LOSS_AGGS.register("seq-mean-token-sum")
def seq_mean_token_sum(
    loss_mat: Tensor, mask: Tensor, *, global_seqs: float | Tensor | None = None
) -> Tensor:
    """loss_mat, mask (B, T) -> scalar. sum_i sum_t (loss · mask) / global_seqs (default: active rows)."""
    return masked_sum(loss_mat, mask) / _count(global_seqs, active_seqs(mask), loss_mat)


@LOSS_AGGS.register("seq-mean-token-mean")
def seq_mean_token_mean(
    loss_mat: Tensor, mask: Tensor, *, global_seqs: float | Tensor | None = None
) -> Tensor:
    """loss_mat, mask (B, T) -> scalar. sum_i (sum_t loss · mask / max(len_i, 1)) / global_seqs."""
    per_seq = masked_mean(loss_mat, mask, dim=-1)  # (B,), 0 for rows with no masked token
    return per_seq.sum() / _count(global_seqs, active_seqs(mask), loss_mat)


@LOSS_AGGS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss_mat: Tensor,
    mask: Tensor,
    *,
    global_seqs: float | Tensor | None = None,
    norm_len: float | None = None,
) -> Tensor:
    """loss_mat, mask (B, T) -> scalar. sum(loss · mask) / (global_seqs · norm_len) (Dr. GRPO).

    norm_len defaults to T; pass a constant (the max response length) when micro-batches are
    padded to different lengths, or their sum will not equal the mini-batch's.
    """
    seqs = _count(global_seqs, active_seqs(mask), loss_mat)
    length = _count(norm_len, loss_mat.shape[-1], loss_mat)
    return masked_sum(loss_mat, mask) / (seqs * length)


def aggregate(
    mode: str,
    loss_mat: Tensor,
    mask: Tensor,
    *,
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_len: float | None = None,
) -> Tensor:
    """loss_mat, mask (B, T) -> scalar, by the mode named in LOSS_AGGS (TandemError lists them)."""
    fn = LOSS_AGGS.get(mode)
    return fn(loss_mat, mask, global_tokens=global_tokens, global_seqs=global_seqs, norm_len=norm_len)
