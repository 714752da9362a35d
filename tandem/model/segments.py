"""Sequences packed back to back in one row, with attention confined to each (padding-free batches).

The trainer packs a micro-batch's sequences into one (1, T) row: every matmul then runs on real
tokens only. Attention must not cross from one sequence into the next, so instead of a mask the
packed layout attends itself: runs of equal-length neighbours are viewed as one (n, H, L, D) batch
and attend causally (SDPA's flash kernel on a GPU, two batched matmuls on the CPU). Sorting a
micro-batch by length (as the trainer does) makes those runs long; any order is correct.

A shared prompt (`Segments.shared`): the samples of one GRPO group share their prompt, so it is laid
once, followed by every response; each response attends to the prompt and to itself, at the
positions it would have alone. Every token then sees exactly the context it has in a sequence of
its own, so its logits are those of that sequence (up to the kernels' summation order), and the
prompt's forward and backward run once for the group instead of once a sample. In the
batch-invariant mode (`tree_attention`) each response's keys are laid out as in that sequence, so
they are the same bits.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


class Segments:
    """lengths: the packed units' lengths, in order; they add up to the row's T. A unit is one
    sequence, or (`shared`) a prompt followed by its responses.

    A plain class, not a dataclass: FSDP2 rebuilds dataclass arguments to cast their tensors.
    """

    def __init__(self, lengths: list[int], trees: dict[int, tuple[int, list[int]]] | None = None):
        """trees: unit index -> (prompt length, the lengths of the responses that follow it)."""
        self.lengths = list(lengths)
        self.trees = dict(trees or {})
        self._masks: dict[int, Tensor] = {}  # a tree's start -> its `tree_mask`
        # (start, count, length, tree) of runs of equal-length plain neighbours; a tree alone
        self.runs: list[tuple[int, int, int, tuple[int, list[int]] | None]] = []
        start = 0
        for i, n in enumerate(self.lengths):
            tree = self.trees.get(i)
            if tree is None and self.runs and self.runs[-1][2] == n and self.runs[-1][3] is None:
                s, count, _, _ = self.runs[-1]
                self.runs[-1] = (s, count + 1, n, None)
            else:
                self.runs.append((start, 1, n, tree))
            start += n

    @classmethod
    def shared(cls, units: list[tuple[int, list[int]]]) -> "Segments":
        """units: (prompt length, response lengths) of each unit; one response is a plain sequence."""
        lengths = [p + sum(rs) for p, rs in units]
        trees = {i: (p, list(rs)) for i, (p, rs) in enumerate(units) if len(rs) > 1}
        return cls(lengths, trees)

    def positions(self, device: torch.device | str = "cpu") -> Tensor:
        """(1, T): each sequence's positions restart at 0; each response of a shared prompt
        continues the prompt's."""
        parts = []
        for i, n in enumerate(self.lengths):
            if i in self.trees:
                p, responses = self.trees[i]
                parts += [torch.arange(p, device=device)]
                parts += [torch.arange(p, p + r, device=device) for r in responses]
            else:
                parts.append(torch.arange(n, device=device))
        return torch.cat(parts)[None]

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, attention: Callable[..., Tensor] | None = None
    ) -> Tensor:
        """q (1, H, T, D), k, v (1, Hkv, T, D) -> (1, H, T, D): causal attention within each sequence.
        attention: `batch_invariant.attention`-like (q, k, v, additive mask) to run each run through
        (a shared prompt's unit by `tree_attention`, which calls it)."""
        outs = []
        # Each run's part of q, k, v by one split, not a slice a run: a slice's backward writes its
        # gradient into zeros the size of the whole row, once per run and layer (43% of the train
        # step of `bench/determinism.py`'s toy batch, 512 short samples, went to filling them).
        sizes = [count * length for _, count, length, _ in self.runs]
        parts = zip(*(x.squeeze(0).split(sizes, dim=1) for x in (q, k, v)), strict=True)
        for (start, count, length, tree), qkv in zip(self.runs, parts, strict=True):
            rq, rk, rv = (x.unflatten(1, (count, length)).transpose(0, 1) for x in qkv)  # (count, h, L, D)
            if tree is not None and attention is not None:
                out = tree_attention(rq, rk, rv, *tree, attention)
            elif tree is not None:
                # built once per micro-batch, not once per layer
                allowed = self._masks.get(start)
                if allowed is None or allowed.device != q.device:
                    allowed = self._masks[start] = tree_mask(*tree, device=q.device)
                if q.is_cuda:
                    out = F.scaled_dot_product_attention(rq, rk, rv, attn_mask=allowed, enable_gqa=True)
                else:
                    out = causal_attention(rq, rk, rv, allowed)
            elif attention is not None:
                mask = torch.full((length, length), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
                out = attention(rq, rk, rv, mask[None, None])
            elif q.is_cuda:  # flash attention: fast, and no (L x L) scores kept for backward
                out = F.scaled_dot_product_attention(rq, rk, rv, is_causal=True, enable_gqa=True)
            else:
                out = causal_attention(rq, rk, rv)
            outs.append(out.transpose(0, 1).flatten(1, 2))  # (H, count·L, D)
        return torch.cat(outs, dim=1)[None]


def tree_attention(
    q: Tensor, k: Tensor, v: Tensor, prompt: int, responses: list[int], attention: Callable[..., Tensor]
) -> Tensor:
    """q (1, H, L, D), k, v (1, Hkv, L, D) of a prompt followed by its responses -> (1, H, L, D), by a
    batch-invariant `attention` (q, k, v, additive mask), each token's the bits of a sequence of
    its own: such an attention sums over keys in tiles counted from the sequence's first key, so
    the prompt attends as a sequence of its own, and every response to a copy of the prompt's keys
    followed by its own, from key 0, as the engine's cache holds them. All go in one call, one
    entry each (the prompt first), padded to the longest: padding keys trail every row's visible
    ones, masked (adding exact zeros); padding query rows are dropped. Only the prompt's keys are
    copied, never its forward: the matmuls and norms around attention still run once for the group."""
    device, n, longest = q.device, len(responses), max(responses)
    rows = max(prompt, longest)  # query rows of every entry
    steps = torch.arange(rows, device=device)
    # Query t of the prompt sees its keys 0..t; of a response, the prompt's and its own up to t; a
    # padding row (zeros) its entry's last key
    offset = torch.tensor([0] + [prompt] * n, device=device)[:, None]
    cap = torch.tensor([prompt, *responses], device=device)[:, None] - 1  # (n + 1, 1)
    visible = torch.arange(prompt + longest, device=device) <= (offset + steps.minimum(cap))[..., None]
    mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))[:, None]

    # Every response's tokens, then zeros, as one gather of the responses' rows and a zero row after
    # them: one op (and one index_add in the backward) instead of a copy per response.
    total = sum(responses)
    starts = torch.tensor([0, *responses[:-1]], device=device).cumsum(0)[:, None]  # (n, 1)

    def gather(length: int) -> Tensor:  # -> (n * length,): each response's rows, then the zero row
        at = torch.arange(length, device=device)
        return torch.where(at <= cap[1:], starts + at, total).flatten()

    query_rows, key_rows = gather(rows), gather(longest)

    def entries(x: Tensor, picked: Tensor, keys: bool) -> Tensor:  # (1, h, L, D) -> (n + 1, h, ., D)
        own = F.pad(x[0, :, prompt:], (0, 0, 0, 1)).index_select(1, picked)  # (h, n * length, D)
        own = own.unflatten(1, (n, -1)).transpose(0, 1)
        head = x[:, :, :prompt]
        if keys:  # each response's own keys after a copy of the prompt's
            own = torch.cat([head.expand(n, -1, -1, -1), own], dim=2)
        return torch.cat([F.pad(head, (0, 0, 0, own.shape[2] - prompt)), own])

    # A masked key adds exact zeros whatever it holds: the zeros of padding give the same bits as
    # any other keys there.
    keys, values = entries(k, key_rows, True), entries(v, key_rows, True)
    out = attention(entries(q, query_rows, False), keys, values, mask)  # (n + 1, H, rows, D)
    # unbind, not out[i] an entry: each index's backward would fill zeros the size of all of out
    parts = [o[:, :r] for o, r in zip(out.unbind(0), [prompt, *responses], strict=True)]
    return torch.cat(parts, dim=1)[None]


def tree_mask(prompt: int, responses: list[int], device: torch.device | str = "cpu") -> Tensor:
    """(L, L) bool, True where a query (row) may attend a key (column), for a prompt followed by
    its responses: the prompt causally; each response the whole prompt and itself causally."""
    part = torch.cat([torch.zeros(prompt, dtype=torch.long)] + [
        torch.full((r,), i + 1, dtype=torch.long) for i, r in enumerate(responses)
    ]).to(device)  # fmt: skip
    length = part.shape[0]
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return causal & ((part[None, :] == 0) | (part[None, :] == part[:, None]))


def causal_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None = None) -> Tensor:
    """q (n, H, L, D), k, v (n, Hkv, L, D) -> (n, H, L, D): softmax(q·kᵀ/√D + causal) · v.
    allowed: an (L, L) bool mask in place of the causal one (`tree_mask`).

    Two batched matmuls over the Hkv key heads, each serving its H/Hkv query heads (Hugging Face's
    order: head i reads key head i // G); softmax in fp32. For the short rows of RL batches this is
    several times faster on the CPU than SDPA's flash kernel, whose backward is built for long ones.
    """
    n, h, length, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    scores = torch.matmul(q.reshape(n, hkv, g * length, d), k.transpose(-1, -2)) * d**-0.5  # (n, Hkv, G·L, L)
    if allowed is None:
        allowed = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    probs = scores.float().masked_fill(~allowed.repeat(g, 1), float("-inf")).softmax(-1).to(v.dtype)
    return torch.matmul(probs, v).view(n, h, length, d)
