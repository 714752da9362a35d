"""The batch-invariance self-test: one token sequence through every path that computes its logits.

`tandem.model.batch_invariant` fixes every call's shape; what a library then does with one shape
(that a row's result does not depend on its place within the call, or on the thread count) it
cannot fix. `first_difference` checks it on the machine and device at hand: a model of the run's
shapes and dtype (one decoder layer: every layer has the same shapes), the same sequence alone
and in batches of several sizes among random others, at every thread count the run's roles use,
through the trainer's padded and packed forwards and the engines' prefill and decode on the
contiguous and the paged KV cache. A deterministic run calls it before it starts anything
(`tandem.runtime.run`), and tests/test_batch_invariant.py uses the same path functions.
"""

import dataclasses
import random
from collections.abc import Iterable

import torch
from torch import Tensor

from tandem.model.config import ModelConfig
from tandem.model.decoder import CausalLM, init_weights
from tandem.model.kv_cache import KVCache
from tandem.model.paged_kv import PagedBatch, PagedKVCache
from tandem.model.segments import Segments

BATCH_SIZES = (1, 3, 8, 33)  # the self-test's batch sizes (its sequence at a random row of each)


def padded_logits(model: CausalLM, rows: list[list[int]]) -> Tensor:
    """The trainer's padded layout: rows right-padded -> logits (B, T, V)."""
    width = max(map(len, rows))
    device = model.lm_head.weight.device
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), True
    ids, mask = ids.to(device), mask.to(device)
    return model(ids, torch.arange(width, device=device).expand_as(ids), mask)


def packed_logits(model: CausalLM, rows: list[list[int]]) -> Tensor:
    """The trainer's packed layout: one row of segments -> logits (sum of lengths, V)."""
    device = model.lm_head.weight.device
    segments = Segments([len(r) for r in rows])
    ids = torch.tensor([t for r in rows for t in r], device=device)[None]
    return model(ids, segments.positions(device), segments)[0]


def kv_cache_logits(model: CausalLM, prompts: list[list[int]], steps: list[list[int]]) -> list[Tensor]:
    """BuiltinEngine's layout: a left-padded prefill into a KVCache, then one token per row per step
    -> the logits (B, V) after the prefill and after each step."""
    device = model.lm_head.weight.device
    n, width = len(prompts), max(map(len, prompts))
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), True
    ids, mask = ids.to(device), mask.to(device)
    cache = KVCache(model.cfg, n, width + len(steps), model.lm_head.weight.dtype, device)
    out = [model(ids, (mask.long().cumsum(-1) - 1).clamp(min=0), mask, cache)[:, -1]]
    position = mask.sum(-1)
    for tokens in steps:
        step = torch.ones(n, 1, dtype=torch.bool, device=device)
        out.append(model(torch.tensor(tokens, device=device)[:, None], position[:, None], step, cache)[:, -1])
        position = position + 1
    return out


class Paged:
    """Sequences in a PagedKVCache, each in its own shuffled blocks, run as ModelRunner does."""

    def __init__(self, model: CausalLM, count: int, longest: int, block_size: int, rng: random.Random):
        self.model, self.bs = model, block_size
        self.device = model.lm_head.weight.device
        per = -(-longest // block_size)
        blocks = list(range(count * per))
        rng.shuffle(blocks)
        self.tables = [blocks[i * per : (i + 1) * per] for i in range(count)]
        dtype = model.lm_head.weight.dtype
        self.cache = PagedKVCache(model.cfg, count * per, block_size, dtype, self.device)

    def step(self, rows: list[tuple[int, list[int], int]]) -> Tensor:
        """rows (sequence, its new tokens, tokens it had before) -> each row's last logits (B, V)."""
        t = max(len(new) for _, new, _ in rows)
        ids, slots = torch.zeros(len(rows), t, dtype=torch.long), torch.full((len(rows), t), -1)
        for i, (seq, new, before) in enumerate(rows):
            ids[i, : len(new)] = torch.tensor(new)
            positions = range(before, before + len(new))
            slots[i, : len(new)] = torch.tensor(
                [self.tables[seq][p // self.bs] * self.bs + p % self.bs for p in positions]
            )
        context = torch.tensor([before + len(new) for _, new, before in rows])
        query = torch.tensor([len(new) for _, new, _ in rows])
        ids, slots, context, query = (x.to(self.device) for x in (ids, slots, context, query))
        tables = torch.tensor([self.tables[s] for s, _, _ in rows], device=self.device)
        batch = PagedBatch(self.cache, slots, tables, context, query)
        logits = self.model(ids, batch.positions(), slots >= 0, batch)
        return logits[torch.arange(len(rows), device=self.device), query - 1]


def paged_logits(
    model: CausalLM, prompts: list[list[int]], steps: list[list[int]], block_size: int, rng: random.Random
) -> list[Tensor]:
    """The paged engine's layout: each prompt in two chunks (a chunked prefill) at random cuts,
    then one token per row per step -> the logits (B, V) after the prefill and after each step."""
    paged = Paged(model, len(prompts), max(map(len, prompts)) + len(steps), block_size, rng)
    cuts = [rng.randint(0, len(p) - 1) for p in prompts]
    first = [(i, p[:c], 0) for i, (p, c) in enumerate(zip(prompts, cuts, strict=True)) if c]
    if first:
        paged.step(first)
    out = [paged.step([(i, p[c:], c) for i, (p, c) in enumerate(zip(prompts, cuts, strict=True))])]
    lengths = [len(p) for p in prompts]
    for tokens in steps:
        out.append(paged.step([(i, [tok], lengths[i]) for i, tok in enumerate(tokens)]))
        lengths = [x + 1 for x in lengths]
    return out


def probe_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """A model of `cfg`'s shapes with one decoder layer, random weights, batch-invariant, in `dtype`."""
    model = CausalLM(dataclasses.replace(cfg, num_hidden_layers=1))
    init_weights(model, seed=0, std=0.3)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.batch_invariant = True
    return model


def first_difference(model: CausalLM, threads: Iterable[int], seed: int = 0) -> str | None:
    """-> None when one sequence's logits are bit-identical through every path, at every batch size
    of BATCH_SIZES and every thread count of `threads` (against itself alone, on one thread); else
    where they first differed and by how much."""
    rng = random.Random(seed)
    vocab = model.cfg.vocab_size
    target = [rng.randrange(vocab) for _ in range(20)]
    prompt = 8
    before = torch.get_num_threads()
    # torch's own setter: vLLM's CPU worker replaces torch.set_num_threads with a no-op in the
    # process it ran in, and the test would then run every "thread count" on the same threads.
    set_threads = torch._C.set_num_threads
    try:
        set_threads(1)
        with torch.no_grad():
            ref = padded_logits(model, [target])[0]
            for count in sorted(set(threads)):
                set_threads(count)
                for n in BATCH_SIZES:
                    for path, got in _paths(model, target, prompt, n, rng):
                        if not torch.equal(got, ref[-got.shape[0] :]):
                            gap = float((got - ref[-got.shape[0] :]).abs().max())
                            return f"{path}, batch of {n}, {count} thread(s): max |Δlogit| {gap:.3g}"
    finally:
        set_threads(before)
    return None


def _paths(model: CausalLM, target: list[int], prompt: int, n: int, rng: random.Random):
    """-> (path name, the target's logits by that path) for a batch of n with the target at a random row."""
    vocab = model.cfg.vocab_size

    def others(longest: int) -> list[list[int]]:
        return [[rng.randrange(vocab) for _ in range(rng.randint(1, longest))] for _ in range(n)]

    at = rng.randrange(n)
    rows = others(40)
    rows[at] = target
    yield "the trainer's padded forward", padded_logits(model, rows)[at, : len(target)]
    start = sum(map(len, rows[:at]))
    yield "the trainer's packed forward", packed_logits(model, rows)[start : start + len(target)]
    prompts = others(20)
    prompts[at] = target[:prompt]
    steps = [[rng.randrange(vocab) for _ in range(n)] for _ in range(len(target) - prompt)]
    for j, tokens in enumerate(steps):
        tokens[at] = target[prompt + j]
    yield (
        "prefill and decode on the KV cache",
        torch.stack([x[at] for x in kv_cache_logits(model, prompts, steps)]),
    )
    for block_size in (4, 16):
        logits = paged_logits(model, prompts, steps, block_size, rng)
        yield (
            f"chunked prefill and decode on the paged cache (blocks of {block_size})",
            torch.stack([x[at] for x in logits]),
        )
