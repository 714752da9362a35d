"""Sequences packed back to back in one row, with attention confined to each (padding-free batches).

The trainer packs a micro-batch's sequences into one (1, T) row: every matmul then runs on real
tokens only. Attention must not cross from one sequence into the next, so instead of a mask the
packed layout attends itself: runs of equal-length neighbours are viewed as one (n, H, L, D) batch
and go through SDPA with a causal mask. Sorting a micro-batch by length (as the trainer does) makes
those runs long; any order is correct.
"""

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

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q (1, H, T, D), k, v (1, Hkv, T, D) -> (1, H, T, D): causal attention within each sequence."""
        outs = []
        for start, count, length in self.runs:

            def run(x: Tensor, start: int = start, count: int = count, length: int = length) -> Tensor:
                # (1, h, count·L, D) -> (count, h, L, D): a view when the run is contiguous
                return x[0, :, start : start + count * length].unflatten(1, (count, length)).transpose(0, 1)

            out = F.scaled_dot_product_attention(run(q), run(k), run(v), is_causal=True, enable_gqa=True)
            outs.append(out.transpose(0, 1).flatten(1, 2))  # (H, count·L, D)
        return torch.cat(outs, dim=1)[None]
