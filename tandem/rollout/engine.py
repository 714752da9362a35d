"""The built-in engine: static batches with a KV cache on the one tandem decoder. Each prompt (and
partial response) is left-padded so every row decodes at the same cache slot; finished rows leave
the batch (the cache is compacted) once enough have, so short answers stop costing compute."""

from typing import Any

import torch
from torch import Tensor

from tandem.model.batch_invariant import KEY_TILE, round_up
from tandem.model.decoder import CausalLM
from tandem.model.kv_cache import KVCache
from tandem.rollout.base import Generation
from tandem.rollout.call import GenerateCall
from tandem.rollout.decoder_engine import DecoderEngine
from tandem.rollout.sequence import Sequence, sample_tokens, take_tokens
from tandem.sample import Sample

COMPACT_FRACTION = 0.25  # compact the cache once this share of the live rows has finished


class BuiltinEngine(DecoderEngine):
    """Generates on `model` in batches of `max_batch_size` samples, one after another.

    options: `DecoderEngine`'s (seed, version, on_update, on_step, compile, quantization,
    fp8_scale, record_routing, lora); a step is a prefill or a decode step of the current batch.
    """

    def __init__(
        self,
        model: CausalLM,
        eos_token_ids: list[int],
        pad_token_id: int,
        max_batch_size: int = 512,
        **options: Any,
    ):
        super().__init__(model, eos_token_ids, pad_token_id, **options)
        self.max_batch_size = max_batch_size

    def _begin(self, samples: list[Sample], call: GenerateCall) -> "_Batches":
        return _Batches(self, samples, call)

    @torch.inference_mode()
    def _prefill(self, seqs: list[Sequence], room: int) -> tuple[Tensor, Tensor, KVCache]:
        """One left-padded prefill per distinct prompt + partial response, its cache rows copied to
        every sequence that shares it (a GRPO group) -> last logits (B, V), next positions (B,) and
        a cache of B rows with `room` more slots; a sequence that records routing gets its
        prefilled tokens' experts."""
        unique: dict[tuple[str | None, tuple[int, ...]], int] = {}  # of one adapter (rows of several)
        owner = [unique.setdefault((seq.sample.adapter, tuple(seq.token_ids)), len(unique)) for seq in seqs]
        heads = list({o: seq for o, seq in zip(owner, seqs, strict=True)}.values())  # a sequence each
        u, width = len(unique), max(len(p) for _, p in unique)
        ids = torch.full((u, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(u, width, dtype=torch.bool)
        for i, (_, p) in enumerate(unique):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        dtype = self.model.lm_head.weight.dtype
        length = round_up(width + room, KEY_TILE)  # whole tiles for the batch-invariant attention
        cache = KVCache(self.model.cfg, u, length, dtype, self.device)
        # left-padded: every row's last token is in the last column
        last = torch.full((u,), width - 1, dtype=torch.long, device=self.device)
        with self.adapter_rows([seq.sample.adapter for seq in heads]):
            logits, routes = self.forward(ids, positions, mask, cache, None, last)  # (U, 1, V)
        expand = torch.tensor(owner, device=self.device)
        cache.keep(expand)
        if routes is not None:  # recording routing: the prefilled tokens' experts
            for seq, o in zip(seqs, owner, strict=True):
                seq.routes[: len(seq)] = routes[o, width - len(seq) :]
        return logits[:, 0][expand], mask.sum(-1)[expand], cache


class _Batches(Generation):
    """The `Generation` of one call: its samples in batches of `max_batch_size`, one after another,
    each prefilled once and then decoded until every one of its samples has ended."""

    def __init__(self, engine: BuiltinEngine, samples: list[Sample], call: GenerateCall):
        self.engine, self.call, self.waiting = engine, call, samples
        self.batch: _Batch | None = None

    @property
    def done(self) -> bool:
        return self.batch is None and not self.waiting

    def step(self) -> bool:
        if self.batch is None:
            size = self.engine.max_batch_size
            self.batch = _Batch(self.engine, self.waiting[:size], self.call)
            self.waiting = self.waiting[size:]
        else:
            self.batch.decode()
        self.batch.sample()
        self._write_back_ended()
        return True

    def stop(self, keys: set[tuple[int, int]]) -> None:
        if self.batch is not None:
            self.batch.stop(keys)
            self._write_back_ended()
        for s in self.waiting:  # not started yet: returned as they came, to re-submit
            if s.key in keys:
                s.end("abort")
        self.waiting = [s for s in self.waiting if s.key not in keys]

    def close(self) -> None:
        if self.batch is not None:
            self.batch.write_back()
        for s in self.waiting:
            s.end("abort")

    def _write_back_ended(self) -> None:
        if all(self.batch.done):
            self.batch.write_back()
            self.batch = None


class _Batch:
    """One batch of samples, as `Sequence`s: its cache and the logits of its next token. `rows`
    and `done` cover the L rows left in the cache. They are Python lists: every step reads them in
    Python, and an operation on a small tensor costs more than a row's share of the forward."""

    def __init__(self, engine: BuiltinEngine, samples: list[Sample], call: GenerateCall):
        self.engine, self.call = engine, call
        self.seqs = engine.sequences(samples, call)
        self.rows = list(range(len(samples)))  # (L,) index in `seqs` of each cache row
        self.done = [False] * len(samples)  # (L,) the row's sequence has ended
        self.version = engine.version  # of the weights behind `logits`: the prefill's, then each step's
        room = max(seq.max_tokens - len(seq) for seq in self.seqs)
        self.logits, self.next_pos, self.cache = engine._prefill(self.seqs, room)
        self.last: Tensor | None = None  # (L,) the tokens sampled last

    @torch.inference_mode()
    def sample(self) -> None:
        """Sample each row's next token from `logits`; live rows' sequences take theirs."""
        rows = [self.seqs[i] for i in self.rows]
        live = [not done for done in self.done]
        tokens, logprobs = sample_tokens(self.logits, rows, self.call.params, self.engine.generator, live)
        self.last = torch.tensor(tokens, device=self.engine.device)
        take_tokens(rows, tokens, logprobs, self.version, self.call, live)
        self.done = [done or seq.ended for done, seq in zip(self.done, rows, strict=True)]  # or stop()

    @torch.inference_mode()
    def decode(self) -> None:
        """Drop ended rows (when enough have), then one forward of the last tokens -> `logits`."""
        tokens = self.last
        if sum(self.done) >= COMPACT_FRACTION * len(self.done):
            live = [r for r, done in enumerate(self.done) if not done]
            self.rows, self.done = [self.rows[r] for r in live], [False] * len(live)
            keep = torch.tensor(live, device=self.engine.device)
            self.cache.keep(keep)
            tokens, self.next_pos = tokens[keep], self.next_pos[keep]
        self.version = self.engine.version
        step_mask = torch.ones(len(tokens), 1, dtype=torch.bool, device=self.engine.device)
        with self.engine.adapter_rows([self.seqs[i].sample.adapter for i in self.rows]):
            logits, routes = self.engine.forward(
                tokens[:, None], self.next_pos[:, None], step_mask, self.cache
            )
        self.logits = logits[:, -1]
        if routes is not None:  # each live row fed its sequence's last token
            for r, (i, done) in enumerate(zip(self.rows, self.done, strict=True)):
                if not done:
                    self.seqs[i].routes[len(self.seqs[i]) - 1] = routes[r, 0]
        self.next_pos = self.next_pos + 1

    @torch.inference_mode()
    def stop(self, keys: set[tuple[int, int]]) -> None:
        self.done = [
            done or self.seqs[i].sample.key in keys for i, done in zip(self.rows, self.done, strict=True)
        ]

    def write_back(self) -> None:
        for seq in self.seqs:
            seq.write_back()
