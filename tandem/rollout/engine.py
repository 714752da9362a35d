"""The built-in engine: static batches with a KV cache on the one tandem decoder. Each prompt (and
partial response) is left-padded so every row decodes at the same cache slot; finished rows leave
the batch (the cache is compacted) once enough have, so short answers stop costing compute."""

from typing import Any

import torch
from torch import Tensor

from tandem.model import CausalLM, KVCache
from tandem.rollout.base import Generation
from tandem.rollout.call import GenerateCall
from tandem.rollout.decoder_engine import DecoderEngine
from tandem.rollout.sampler import exponential_noise, sample_next, seen_tokens
from tandem.sample import Sample

COMPACT_FRACTION = 0.25  # compact the cache once this share of the live rows has finished


class BuiltinEngine(DecoderEngine):
    """Generates on `model` in batches of `max_batch_size` samples, one after another.

    options: `DecoderEngine`'s (seed, version, on_update, on_step, compile, quantization,
    fp8_scale, record_routing); a step is a prefill or a decode step of the current batch.
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
    def _prefill(
        self, samples: list[Sample], max_new_tokens: int
    ) -> tuple[Tensor, Tensor, KVCache, list[Tensor] | None]:
        """One left-padded prefill per distinct prompt + partial response, its cache rows copied to
        every sample that shares it (a GRPO group) -> last logits (B, V), next positions (B,), a
        cache of B rows with room for `max_new_tokens` more, and (recording routing) each sample's
        routing table, its prefilled tokens' rows filled."""
        unique: dict[tuple[int, ...], int] = {}
        owner = [unique.setdefault((*s.prompt_ids, *s.response_ids), len(unique)) for s in samples]
        u, width = len(unique), max(map(len, unique))
        ids = torch.full((u, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(u, width, dtype=torch.bool)
        for i, p in enumerate(unique):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        dtype = self.model.lm_head.weight.dtype
        cache = KVCache(self.model.cfg, u, width + max_new_tokens, dtype, self.device)
        logits, routes = self.forward(ids, positions, mask, cache)
        expand = torch.tensor(owner, device=self.device)
        cache.keep(expand)
        tables = None
        if routes is not None:
            tables = []
            for s, o in zip(samples, owner, strict=True):
                n = len(s.prompt_ids) + len(s.response_ids)
                tables.append(self.route_table(n + max_new_tokens))
                tables[-1][:n] = routes[o, width - n :]
        return logits[:, -1][expand], mask.sum(-1)[expand], cache, tables


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
        if self.batch.done.all():
            self.batch.write_back()
            self.batch = None


class _Batch:
    """One batch of B samples: its cache, the logits of its next token, the new tokens so far.
    `rows` and `done` cover the L rows left in the cache; the rest is per sample."""

    def __init__(self, engine: BuiltinEngine, samples: list[Sample], call: GenerateCall):
        self.engine, self.samples, self.call = engine, samples, call
        self.budget = torch.tensor([call.cap(s) - len(s.response_ids) for s in samples])  # (B,) new tokens
        b, s = len(samples), int(self.budget.max())
        self.tokens = torch.zeros(b, s, dtype=torch.long)  # (B, S) the new tokens
        self.logprobs = torch.zeros(b, s)  # (B, S) their behaviour logprobs
        self.lengths = torch.zeros(b, dtype=torch.long)  # (B,) new tokens so far
        self.stopped = torch.zeros(b, dtype=torch.bool)  # (B,) ended on a stop token or string
        self.rows = torch.arange(b)  # (L,) sample index of each cache row
        self.done = torch.zeros(b, dtype=torch.bool)  # (L,) the row's sample has ended
        self.step_versions: list[int] = []  # the weights behind step k's logits
        self.stop_ids = torch.tensor(call.stop_ids, dtype=torch.long)
        self.version = engine.version  # of the weights behind `logits`: the prefill's, then each step's
        self.logits, self.next_pos, self.cache, self.routes = engine._prefill(samples, s)
        self.last: Tensor | None = None  # (L,) the tokens sampled last
        self.seen: Tensor | None = None  # (B, V) bool tokens in each prompt + response (penalty)
        if call.params.repetition_penalty != 1.0:
            ids = [s.prompt_ids + s.response_ids for s in samples]
            self.seen = seen_tokens(ids, self.logits.shape[-1], self.logits.device)

    @torch.inference_mode()
    def sample(self) -> None:
        """Sample each row's next token from `logits`; keep those of live rows."""
        params = self.call.params
        noise = self._noise() if params.temperature > 0 else None
        seen = self.seen[self.rows.to(self.logits.device)] if self.seen is not None else None
        tokens, logprobs = sample_next(self.logits, params, noise, seen)
        self.last, logprobs = tokens.cpu(), logprobs.cpu()
        step, live = len(self.step_versions), ~self.done
        at = self.rows[live]
        self.tokens[at, step] = self.last[live]
        self.logprobs[at, step] = logprobs[live]
        self.lengths[at] += 1
        if self.seen is not None:
            self.seen[at.to(self.seen.device), self.last[live].to(self.seen.device)] = True
        self.stopped[self.rows[live & torch.isin(self.last, self.stop_ids)]] = True
        if self.call.text is not None:  # a stop string wins over the length limit, as a stop token does
            self.stopped[self._stop_strings(at, step + 1)] = True
        self.done |= self.stopped[self.rows] | (self.lengths[self.rows] >= self.budget[self.rows])
        self.step_versions.append(self.version)

    @torch.inference_mode()
    def decode(self) -> None:
        """Drop ended rows (when enough have), then one forward of the last tokens -> `logits`."""
        tokens = self.last
        if self.done.float().mean() >= COMPACT_FRACTION:
            keep = (~self.done).nonzero().squeeze(-1)
            self.cache.keep(keep.to(self.next_pos.device))
            self.rows, self.done, tokens = self.rows[keep], self.done[keep], tokens[keep]
            self.next_pos = self.next_pos[keep.to(self.next_pos.device)]
        self.version = self.engine.version
        device = self.engine.device
        step_mask = torch.ones(len(tokens), 1, dtype=torch.bool, device=device)
        logits, routes = self.engine.forward(
            tokens[:, None].to(device), self.next_pos[:, None], step_mask, self.cache
        )
        self.logits = logits[:, -1]
        if routes is not None:  # row r fed its sample's token at position next_pos[r]
            for r, (i, pos) in enumerate(zip(self.rows.tolist(), self.next_pos.tolist(), strict=True)):
                self.routes[i][pos] = routes[r, 0]
        self.next_pos = self.next_pos + 1

    @torch.inference_mode()
    def stop(self, keys: set[tuple[int, int]]) -> None:
        self.done |= torch.tensor([self.samples[i].key in keys for i in self.rows.tolist()])

    def write_back(self) -> None:
        """Append each sample's new tokens; one that has not ended (the call stopped) is ABORTED.
        Every sample started at step 0 and took one token a step, so its token k is from step k."""
        for i, s in enumerate(self.samples):
            n = int(self.lengths[i])
            s.extend(self.tokens[i, :n].tolist(), self.logprobs[i, :n].tolist(), self.step_versions[:n])
            s.end("stop" if self.stopped[i] else "length" if n >= int(self.budget[i]) else "abort")
            if self.routes is not None:
                s.routing = self.routes[i][: len(s.prompt_ids) + len(s.response_ids)].clone()

    def _noise(self) -> Tensor:
        """Exp(1) noise (L, V) for the L cache rows: a seeded sample's row from its own generator,
        at its response position, so its tokens do not depend on the rest of the batch."""
        shape = tuple(self.logits.shape)
        if all(s.seed is None for s in self.samples):  # one draw from the shared stream, every step
            return exponential_noise(shape, self.logits.device, self.engine.generator)
        rows, step = self.rows.tolist(), len(self.step_versions)  # each live sample has `step` new tokens
        seeds = [None if d else self.samples[i].seed for i, d in zip(rows, self.done.tolist(), strict=True)]
        positions = [len(self.samples[i].response_ids) + step for i in rows]
        return exponential_noise(shape, self.logits.device, self.engine.generator, seeds, positions)

    def _stop_strings(self, at: Tensor, n: int) -> Tensor:
        """at (L,) samples that just took their n-th new token -> those whose response (the partial
        it came with, then the new tokens) now ends on a stop string."""
        if len(at) == 0:
            return at
        new = self.tokens[at, max(0, n - self.call.text.window) : n].tolist()
        responses = [self.samples[i].response_ids + ids for i, ids in zip(at.tolist(), new, strict=True)]
        return at[torch.tensor(self.call.ends(responses), dtype=torch.bool)]
