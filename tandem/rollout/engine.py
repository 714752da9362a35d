"""The built-in engine: batched generation with a KV cache on the one tandem decoder.

Each sample's prompt and any partial response it already has are left-padded so every row decodes
at the same cache slot; rows that finish leave the batch (the cache is compacted) once enough of
them have, so short answers stop costing compute. Between two decode steps the engine honours what
another thread asked for: `abort()`, or a pending weight update under the `on_update` policy.
docs/rollout.md states which weight version every token records, and how sampling works.
"""

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tandem.errors import TandemError
from tandem.model import CausalLM, KVCache, fuse_projections
from tandem.rollout.gate import UpdateGate
from tandem.rollout.protocol import SamplingParams, StopCheck
from tandem.rollout.sampler import exponential_noise, sample_next
from tandem.sample import Sample, Status

COMPACT_FRACTION = 0.25  # compact the cache once this share of the live rows has finished


class BuiltinEngine(UpdateGate):
    """Generates on `model`; thread-safe `abort`, `set_pending_update`; the rest from one thread.

    on_update, on_step: see `UpdateGate`; a step is a decode step of the current batch, and under
        "continue" an update is swapped in between two of them, keeping the cached keys.
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
        super().__init__(version, on_update, on_step)
        # One matmul for q/k/v and one for gate/up per layer; parameters keep their names.
        self.model = fuse_projections(model.eval().requires_grad_(False))
        if compile:
            _check_compiler(self.model)
            self.model.compile_decode()
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.device = next(model.parameters()).device
        # On the model's device: a sampling draw must come from a generator of the noise's device.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def named_weights(self) -> dict[str, Tensor]:
        """The tensors (Hugging Face names) a weight update writes into: the live parameters."""
        return dict(self.model.named_parameters())

    def generate(
        self, samples: list[Sample], params: SamplingParams, stop_check: StopCheck | None = None
    ) -> list[Sample]:
        """Extend each sample's response (empty, or a partial from an aborted call) to its end.

        Appends to response_ids, logprobs, versions and loss_mask, and sets status and
        finish_reason: FINISHED "stop" / "length", or ABORTED "abort" when the call was stopped.
        `stop_check` is required with `params.stop` (this engine has no tokenizer): it runs after
        every decode step on the live responses, which end at the token that completes a stop
        string, so none decodes past it.
        """
        past_eos, text = checked_request(samples, params, stop_check)
        self._enter()
        try:
            self._apply_pending()  # a new call always starts on the newest weights
            stop_ids = [] if past_eos else self.eos_token_ids + params.stop_token_ids
            stop = torch.tensor(stop_ids, dtype=torch.long)
            todo = [s for s in samples if not finish_if_complete(s, params, stop_ids, text)]
            for start in range(0, len(todo), self.max_batch_size):
                chunk = todo[start : start + self.max_batch_size]
                if self._between_steps():  # stopped in an earlier chunk, or just now
                    _mark_aborted(chunk)
                    continue
                aborted = self._aborted_samples()
                _mark_aborted([s for s in chunk if s.key in aborted])
                chunk = [s for s in chunk if s.key not in aborted]
                if chunk:
                    self._generate_batch(chunk, params, stop, text)
        finally:
            self._leave()
        return samples

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
        dtype = next(self.model.parameters()).dtype
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

    @torch.inference_mode()
    def _generate_batch(
        self, samples: list[Sample], params: SamplingParams, stop: Tensor, text: StopCheck | None
    ) -> None:
        budget = torch.tensor([response_cap(s, params) - len(s.response_ids) for s in samples])
        version = self._version  # of the weights behind `logits`: the prefill's, then each step's
        logits, next_pos, cache = self._shared_prefill(samples, int(budget.max()))
        run = _Decode.start(budget)
        if params.repetition_penalty != 1.0:
            run.seen = _seen_tokens(samples, logits.shape[-1], logits.device)
        if text is not None:
            run.text = _StopText(text, [tail_tokens(s.response_ids, text.window) for s in samples])
        while True:
            noise = self._noise(logits, samples, run) if params.temperature > 0 else None
            seen = run.seen[run.rows.to(logits.device)] if run.seen is not None else None
            tokens, logprobs = sample_next(logits, params, noise, seen)
            tokens = tokens.cpu()
            run.record(tokens, logprobs.cpu(), version, stop)
            if run.all_done:
                break
            if self.on_step is not None:
                self.on_step(len(run.step_versions))
            # An update applied here ("continue") is used by the forward of the token just sampled,
            # so the NEXT token is the first of the new version; the cached keys stay as computed.
            if self._between_steps():
                break
            if aborted := self._aborted_samples():  # abort(samples): only they stop
                run.done |= torch.tensor([samples[i].key in aborted for i in run.rows.tolist()])
                if run.all_done:
                    break
            tokens, next_pos = run.compact(tokens, next_pos, cache)
            version = self._version
            step_mask = torch.ones(len(tokens), 1, dtype=torch.bool, device=self.device)
            logits = self.model(tokens[:, None].to(self.device), next_pos[:, None], step_mask, cache)[:, -1]
            next_pos = next_pos + 1
        run.write_back(samples)

    def _noise(self, logits: Tensor, samples: list[Sample], run: "_Decode") -> Tensor:
        """Exp(1) noise (L, V) for the L cache rows: a seeded sample's row from its own generator,
        at its response position, so its tokens do not depend on the rest of the batch."""
        seeds = positions = None
        if any(s.seed is not None for s in samples):
            step = len(run.step_versions)  # every live sample has taken this many new tokens
            rows = run.rows.tolist()
            seeds = [None if d else samples[i].seed for i, d in zip(rows, run.done.tolist(), strict=True)]
            positions = [len(samples[i].response_ids) + step for i in rows]
        return exponential_noise(tuple(logits.shape), logits.device, self.generator, seeds, positions)


@dataclass
class _StopText:
    """Stop strings for one batch: the worker's check, and each sample's response before the call."""

    check: StopCheck
    prior: list[list[int]]  # (B,) the last `check.window` tokens of each sample's partial response

    def ends(self, at: Tensor, tokens: Tensor, n: int) -> Tensor:
        """at (L,) samples that just took their n-th new token, tokens (B, S) -> those of `at` whose
        response now ends on a stop string."""
        if len(at) == 0:
            return at
        w = self.check.window
        tails = []
        for i, new in zip(at.tolist(), tokens[at, max(0, n - w) : n].tolist(), strict=True):
            short = w - len(new)
            tails.append((self.prior[i][-short:] if short > 0 else []) + new)
        return at[torch.tensor(self.check(tails), dtype=torch.bool)]


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
            s.response_ids = s.response_ids + self.tokens[i, :n].tolist()
            s.logprobs = s.logprobs + self.logprobs[i, :n].tolist()
            s.versions = s.versions + self.step_versions[:n]
            s.loss_mask = s.loss_mask + [1] * n
            if self.stopped[i]:
                s.status, s.finish_reason = Status.FINISHED, "stop"
            elif n >= int(self.budget[i]):
                s.status, s.finish_reason = Status.FINISHED, "length"
            else:
                s.status, s.finish_reason = Status.ABORTED, "abort"


def _check_compiler(model: CausalLM) -> None:
    """torch.compile builds C++ for the CPU: fail now, clearly, rather than at the first decode."""
    if next(model.parameters()).device.type != "cpu":
        return
    names = [os.environ.get("CXX"), "g++", "c++", "clang++"]
    if not any(name and shutil.which(name) for name in names):
        raise TandemError(
            "rollout.compile=true needs a C++ compiler on the CPU (torch.compile builds its kernels "
            "with one) and none was found (tried $CXX, g++, c++, clang++). Install one (Debian: "
            "apt install g++) or set rollout.compile=false."
        )


def tail_tokens(ids: list[int], n: int) -> list[int]:
    return ids[max(0, len(ids) - n) :]


def _seen_tokens(samples: list[Sample], vocab: int, device: torch.device) -> Tensor:
    """-> (B, V) bool: the tokens of each sample's prompt and partial response."""
    ids = [s.prompt_ids + s.response_ids for s in samples]
    rows = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor([len(x) for x in ids]))
    cols = torch.tensor([t for x in ids for t in x], dtype=torch.long)
    seen = torch.zeros(len(ids), vocab, dtype=torch.bool, device=device)
    seen[rows.to(device), cols.to(device)] = True
    return seen


def check_aligned(s: Sample) -> None:
    lists = {"logprobs": s.logprobs, "versions": s.versions, "loss_mask": s.loss_mask}
    for name, values in lists.items():
        if len(values) != len(s.response_ids):
            raise ValueError(
                f"Sample (group {s.group_id}, index {s.index}) has {len(s.response_ids)} response_ids "
                f"but {len(values)} {name}; a partial response must keep its per-token lists aligned."
            )


def response_cap(s: Sample, params: SamplingParams) -> int:
    """The most response tokens this sample may have: its own cap, within the call's."""
    return min(s.max_new_tokens or params.max_new_tokens, params.max_new_tokens)


def checked_request(
    samples: list[Sample], params: SamplingParams, stop_check: StopCheck | None
) -> tuple[bool, StopCheck | None]:
    """Check a generate call's input (both engines) -> (decode past EOS?, the stop-string check to run)."""
    for s in samples:
        check_aligned(s)
    past_eos = params.ignore_eos or params.decode_past_eos
    if params.stop and not past_eos and stop_check is None:
        raise ValueError(
            "SamplingParams.stop needs a stop_check (the engine has no tokenizer): "
            "generate through RolloutWorker, which builds one."
        )
    return past_eos, (stop_check if params.stop and not past_eos else None)


def finish_if_complete(
    s: Sample, params: SamplingParams, stop_ids: list[int], text: StopCheck | None
) -> bool:
    """Finish a sample whose response needs no new token (ends on a stop token or stop string, or
    is at the length limit) -> whether it did."""
    ids = s.response_ids
    if ids and (ids[-1] in stop_ids or (text is not None and text([tail_tokens(ids, text.window)])[0])):
        s.status, s.finish_reason = Status.FINISHED, "stop"
    elif len(s.response_ids) >= response_cap(s, params):
        s.status, s.finish_reason = Status.FINISHED, "length"
    else:
        return False
    return True


def _mark_aborted(samples: list[Sample]) -> None:
    """Samples the call stopped before it reached them: returned as they came, to re-submit."""
    for s in samples:
        s.status, s.finish_reason = Status.ABORTED, "abort"
