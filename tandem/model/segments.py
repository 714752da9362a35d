"""Sequences packed back to back in one row, with attention confined to each (padding-free batches).

The trainer packs a micro-batch's sequences into one (1, T) row: every matmul then runs on real
tokens only. Attention must not cross from one sequence into the next, so instead of a mask the
packed layout attends itself: runs of equal-length neighbours are viewed as one (n, H, L, D) batch
and attend causally (SDPA's flash kernel on a GPU, two batched matmuls on the CPU). Sorting a
micro-batch by length (as the trainer does) makes those runs long; any order is correct.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


class Segments:
    """lengths: the packed sequences' lengths, in order; they add up to the row's T.

    A plain class, not a dataclass: FSDP2 rebuilds dataclass arguments to cast their tensors.
    """

    def __init__(self, lengths: list[int]):
        self.lengths = list(lengths)
        self.runs: list[tuple[int, int, int]] = []  # (start, count, length) of equal-length runs
        start = 0
        for n in self.lengths:
            if self.runs and self.runs[-1][2] == n:
                s, count, _ = self.runs[-1]
                self.runs[-1] = (s, count + 1, n)
            else:
                self.runs.append((start, 1, n))
            start += n

    def positions(self, device: torch.device | str = "cpu") -> Tensor:
        """(1, T): each sequence's positions restart at 0."""
        return torch.cat([torch.arange(n, device=device) for n in self.lengths])[None]

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, attention: Callable[..., Tensor] | None = None
    ) -> Tensor:
        """q (1, H, T, D), k, v (1, Hkv, T, D) -> (1, H, T, D): causal attention within each sequence.
        attention: `batch_invariant.attention`-like (q, k, v, additive mask) to run each run through."""
        outs = []
        for start, count, length in self.runs:

            def run(x: Tensor, start: int = start, count: int = count, length: int = length) -> Tensor:
                # (1, h, count·L, D) -> (count, h, L, D): a view when the run is contiguous
                return x[0, :, start : start + count * length].unflatten(1, (count, length)).transpose(0, 1)

            if attention is not None:
                mask = torch.full((length, length), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
                out = attention(run(q), run(k), run(v), mask[None, None])
            elif q.is_cuda:  # flash attention: fast, and no (L x L) scores kept for backward
                out = F.scaled_dot_product_attention(run(q), run(k), run(v), is_causal=True, enable_gqa=True)
            else:
                out = causal_attention(run(q), run(k), run(v))
            outs.append(out.transpose(0, 1).flatten(1, 2))  # (H, count·L, D)
        return torch.cat(outs, dim=1)[None]


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """q (n, H, L, D), k, v (n, Hkv, L, D) -> (n, H, L, D): softmax(q·kᵀ/√D + causal) · v.

    Two batched matmuls over the Hkv key heads, each serving its H/Hkv query heads (Hugging Face's
    order: head i reads key head i // G); softmax in fp32. For the short rows of RL batches this is
    several times faster on the CPU than SDPA's flash kernel, whose backward is built for long ones.
    """
    n, h, length, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    scores = torch.matmul(q.reshape(n, hkv, g * length, d), k.transpose(-1, -2)) * d**-0.5  # (n, Hkv, G·L, L)
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril().repeat(g, 1)
    probs = scores.float().masked_fill(~causal, float("-inf")).softmax(-1).to(v.dtype)
    return torch.matmul(probs, v).view(n, h, length, d)
