"""The built-in engine: batched generation with a KV cache on the one tandem decoder.

Each sample's prompt and any partial response it already has are left-padded so every row decodes
at the same cache slot; rows that finish leave the batch (the cache is compacted) once enough of
them have, so short answers stop costing compute. The generate call itself, and what happens
between two steps (`abort()`, a pending weight update under `on_update`), is `Engine`'s skeleton.
docs/rollout.md states which weight version every token records, and how sampling works.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tandem.model import CausalLM, KVCache
from tandem.rollout.base import Engine, Storages
from tandem.rollout.call import GenerateCall
from tandem.rollout.inference_model import inference_model, model_tensors
from tandem.rollout.sampler import exponential_noise, sample_next
from tandem.sample import Sample

COMPACT_FRACTION = 0.25  # compact the cache once this share of the live rows has finished


class BuiltinEngine(Engine):
    """Generates on `model`; thread-safe `abort`, `set_pending_update`; the rest from one thread.

    on_update, on_step: see `UpdateGate`; a step is a prefill or a decode step of the current batch,
        and under "continue" an update is swapped in between two of them, keeping the cached keys.
    max_batch_size: samples decoded together; a larger call runs in batches, one after another.
    compile: run decode steps through torch.compile (`CausalLM.compile_decode`); the first calls
        compile for tens of seconds, later steps run faster (docs/rollout.md, "Speed").
    """

    def __init__(
        self,
        model: CausalLM,
        eos_token_ids: list[int],
        pad_token_id: int,
        max_batch_size: int = 512,
        seed: int = 0,
        version: int = 0,
        on_update: str = "drain",
        on_step: Callable[[int], None] | None = None,
        compile: bool = False,
    ):
        super().__init__(eos_token_ids, version, on_update, on_step)
        self.model = inference_model(model, compile)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        # On the model's device: a sampling draw must come from a generator of the noise's device.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.memory = Storages(model_tensors(self.model))  # the KV cache lives per call

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    def named_weights(self) -> dict[str, Tensor]:
        """The tensors (Hugging Face names) a weight update writes into: the live parameters."""
        return dict(self.model.named_parameters())

    def _begin(self, samples: list[Sample], call: GenerateCall) -> "_Batches":
        return _Batches(self, samples, call)

    @torch.inference_mode()
    def _prefill(self, prefixes: list[list[int]], max_new_tokens: int) -> tuple[Tensor, Tensor, KVCache]:
        """Left-pad and prefill the prefixes -> last logits (U, V), next positions (U,), the cache."""
        u, width = len(prefixes), max(map(len, prefixes))
        ids = torch.full((u, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(u, width, dtype=torch.bool)
        for i, p in enumerate(prefixes):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        dtype = self.model.lm_head.weight.dtype
        cache = KVCache(self.model.cfg, u, width + max_new_tokens, dtype, self.device)
        logits = self.model(ids, positions, mask, cache)[:, -1]
        return logits, mask.sum(-1), cache

    def _shared_prefill(self, samples: list[Sample], max_new_tokens: int) -> tuple[Tensor, Tensor, KVCache]:
        """One prefill per distinct prompt + partial response, its cache rows copied to every sample
        that shares it (a GRPO group) -> logits (B, V), next positions (B,), a cache of B rows."""
        unique: dict[tuple[int, ...], int] = {}
        owner = [unique.setdefault((*s.prompt_ids, *s.response_ids), len(unique)) for s in samples]
        logits, next_pos, cache = self._prefill([list(p) for p in unique], max_new_tokens)
        expand = torch.tensor(owner, device=self.device)
        cache.keep(expand)
        return logits[expand], next_pos[expand], cache


class _Batches:
    """The `Generation` of one call: its samples in batches of `max_batch_size`, one after another,
    each prefilled once and then decoded until every one of its samples has ended."""

    def __init__(self, engine: BuiltinEngine, samples: list[Sample], call: GenerateCall):
        self.engine, self.call = engine, call
        size = engine.max_batch_size
        self.waiting = [samples[i : i + size] for i in range(0, len(samples), size)]
        self.batch: _Batch | None = None
        self.stop_ids = torch.tensor(call.stop_ids, dtype=torch.long)

    @property
    def done(self) -> bool:
        return self.batch is None and not self.waiting

    def step(self) -> bool:
        if self.batch is None:
            self.batch = _Batch(self.engine, self.waiting.pop(0), self.call)
        else:
            self.batch.decode()
        self.batch.sample(self.stop_ids)
        if self.batch.run.all_done:
            self._write_back()
        return True

    def stop(self, keys: set[tuple[int, int]]) -> None:
        if self.batch is not None:
            self.batch.stop(keys)
            if self.batch.run.all_done:
                self._write_back()
        for chunk in self.waiting:  # not started yet: returned as they came, to re-submit
            for s in chunk:
                if s.key in keys:
                    s.end("abort")
        self.waiting = [kept for c in self.waiting if (kept := [s for s in c if s.key not in keys])]

    def swap(self, apply: Callable[[], int | None]) -> None:
        apply()  # the cached keys stay as the old weights computed them

    def close(self) -> None:
        if self.batch is not None:
            self._write_back()
        for chunk in self.waiting:
            for s in chunk:
                s.end("abort")
        self.waiting = []

    def _write_back(self) -> None:
        """The current batch is over (ended, or stopped): its samples take their tokens."""
        self.batch.run.write_back(self.batch.samples)
        self.batch = None


class _Batch:
    """One batch's cache and the logits of its next token; `run` keeps its tokens."""

    def __init__(self, engine: BuiltinEngine, samples: list[Sample], call: GenerateCall):
        self.engine, self.samples, self.call = engine, samples, call
        self.run = _Decode.start(torch.tensor([call.cap(s) - len(s.response_ids) for s in samples]))
        self.version = engine.version  # of the weights behind `logits`: the prefill's, then each step's
        with torch.inference_mode():
            self.logits, self.next_pos, self.cache = engine._shared_prefill(
                samples, int(self.run.budget.max())
            )
        self.tokens: Tensor | None = None
        if call.params.repetition_penalty != 1.0:
            self.run.seen = _seen_tokens(samples, self.logits.shape[-1], self.logits.device)
        if call.text is not None:
            self.run.text = _StopText(call, [s.response_ids for s in samples])

    @torch.inference_mode()
    def sample(self, stop_ids: Tensor) -> None:
        """Sample each live row's next token from `logits` and record it."""
        params = self.call.params
        noise = self._noise() if params.temperature > 0 else None
        seen = self.run.seen[self.run.rows.to(self.logits.device)] if self.run.seen is not None else None
        tokens, logprobs = sample_next(self.logits, params, noise, seen)
        self.tokens = tokens.cpu()
        self.run.record(self.tokens, logprobs.cpu(), self.version, stop_ids)

    @torch.inference_mode()
    def decode(self) -> None:
        """Drop ended rows (when enough have), then one forward of the last tokens -> `logits`."""
        tokens, self.next_pos = self.run.compact(self.tokens, self.next_pos, self.cache)
        self.version = self.engine.version
        device = self.engine.device
        step_mask = torch.ones(len(tokens), 1, dtype=torch.bool, device=device)
        self.logits = self.engine.model(
            tokens[:, None].to(device), self.next_pos[:, None], step_mask, self.cache
        )[:, -1]
        self.next_pos = self.next_pos + 1

    @torch.inference_mode()
    def stop(self, keys: set[tuple[int, int]]) -> None:
        self.run.done |= torch.tensor([self.samples[i].key in keys for i in self.run.rows.tolist()])

    def _noise(self) -> Tensor:
        """Exp(1) noise (L, V) for the L cache rows: a seeded sample's row from its own generator,
        at its response position, so its tokens do not depend on the rest of the batch."""
        seeds = positions = None
        run, samples = self.run, self.samples
        if any(s.seed is not None for s in samples):
            step = len(run.step_versions)  # every live sample has taken this many new tokens
            rows = run.rows.tolist()
            seeds = [None if d else samples[i].seed for i, d in zip(rows, run.done.tolist(), strict=True)]
            positions = [len(samples[i].response_ids) + step for i in rows]
        shape = tuple(self.logits.shape)
        return exponential_noise(shape, self.logits.device, self.engine.generator, seeds, positions)


@dataclass
class _StopText:
    """Stop strings for one batch: the call's check, and each sample's response before the call."""

    call: GenerateCall
    prior: list[list[int]]  # (B,) each sample's partial response

    def ends(self, at: Tensor, tokens: Tensor, n: int) -> Tensor:
        """at (L,) samples that just took their n-th new token, tokens (B, S) -> those of `at` whose
        response now ends on a stop string."""
        if len(at) == 0:
            return at
        w = self.call.text.window
        responses = [
            self.prior[i] + new
            for i, new in zip(at.tolist(), tokens[at, max(0, n - w) : n].tolist(), strict=True)
        ]
        return at[torch.tensor(self.call.ends(responses), dtype=torch.bool)]


@dataclass
class _Decode:
    """The decode state of one batch of B samples; `rows` / `done` cover the L rows in the cache."""

    budget: Tensor  # (B,) new tokens each sample may take
    tokens: Tensor  # (B, S) new tokens, S = max budget
    logprobs: Tensor  # (B, S) their behaviour logprobs
    lengths: Tensor  # (B,) new tokens so far
    stopped: Tensor  # (B,) ended on a stop token
    rows: Tensor  # (L,) sample index of each cache row
    done: Tensor  # (L,) the row's sample has ended
    step_versions: list[int] = field(default_factory=list)  # weights behind step k's logits
    seen: Tensor | None = None  # (B, V) bool tokens in each prompt + response (repetition penalty)
    text: _StopText | None = None  # stop strings

    @classmethod
    def start(cls, budget: Tensor) -> "_Decode":
        b, s = len(budget), int(budget.max())
        return cls(
            budget=budget,
            tokens=torch.zeros(b, s, dtype=torch.long),
            logprobs=torch.zeros(b, s),
            lengths=torch.zeros(b, dtype=torch.long),
            stopped=torch.zeros(b, dtype=torch.bool),
            rows=torch.arange(b),
            done=torch.zeros(b, dtype=torch.bool),
        )

    @property
    def all_done(self) -> bool:
        return bool(self.done.all())

    def record(self, tokens: Tensor, logprobs: Tensor, version: int, stop: Tensor) -> None:
        """tokens, logprobs (L,) sampled from logits of weights `version`: keep those of live rows."""
        step, live = len(self.step_versions), ~self.done
        at = self.rows[live]
        self.tokens[at, step] = tokens[live]
        self.logprobs[at, step] = logprobs[live]
        self.lengths[at] += 1
        if self.seen is not None:
            self.seen[at.to(self.seen.device), tokens[live].to(self.seen.device)] = True
        self.stopped[self.rows[live & torch.isin(tokens, stop)]] = True
        if self.text is not None:  # a stop string wins over the length limit, as a stop token does
            self.stopped[self.text.ends(at, self.tokens, step + 1)] = True
        self.done |= self.stopped[self.rows] | (self.lengths[self.rows] >= self.budget[self.rows])
        self.step_versions.append(version)

    def compact(self, tokens: Tensor, next_pos: Tensor, cache: KVCache) -> tuple[Tensor, Tensor]:
        """Drop ended rows from the cache once enough have ended -> the kept tokens, positions."""
        if self.done.float().mean() < COMPACT_FRACTION:
            return tokens, next_pos
        keep = (~self.done).nonzero().squeeze(-1)
        cache.keep(keep.to(next_pos.device))
        self.rows, self.done = self.rows[keep], self.done[keep]
        return tokens[keep], next_pos[keep.to(next_pos.device)]

    def write_back(self, samples: list[Sample]) -> None:
        """Append each sample's new tokens; one that has not ended (the call stopped) is ABORTED.
        Every sample started at step 0 and took one token a step, so its token k is from step k."""
        for i, s in enumerate(samples):
            n = int(self.lengths[i])
            s.extend(self.tokens[i, :n].tolist(), self.logprobs[i, :n].tolist(), self.step_versions[:n])
            if self.stopped[i]:
                s.end("stop")
            else:
                s.end("length" if n >= int(self.budget[i]) else "abort")


def _seen_tokens(samples: list[Sample], vocab: int, device: torch.device) -> Tensor:
    """-> (B, V) bool: the tokens of each sample's prompt and partial response."""
    ids = [s.prompt_ids + s.response_ids for s in samples]
    rows = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor([len(x) for x in ids]))
    cols = torch.tensor([t for x in ids for t in x], dtype=torch.long)
    seen = torch.zeros(len(ids), vocab, dtype=torch.bool, device=device)
    seen[rows.to(device), cols.to(device)] = True
    return seen
