"""The built-in engine: batched generation with a KV cache on the one tandem decoder.

Prompts are left-padded so every row decodes at the same cache slot; rows that finish leave the
batch (the cache is compacted) once enough of them have, so short answers stop costing compute.
"""

from collections.abc import Iterable

import torch
from torch import Tensor

from tandem.model import CausalLM, KVCache
from tandem.rollout.protocol import SamplingParams
from tandem.rollout.sampler import sample_next
from tandem.sample import Sample, Status

COMPACT_FRACTION = 0.25  # compact the cache once this share of the live rows has finished


class BuiltinEngine:
    def __init__(
        self,
        model: CausalLM,
        eos_token_ids: list[int],
        pad_token_id: int,
        max_batch_size: int = 512,
        seed: int = 0,
        version: int = 0,
    ):
        self.model = model.eval().requires_grad_(False)
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.version = version
        self.device = next(model.parameters()).device

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor)
        self.version = version

    def generate(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        for start in range(0, len(samples), self.max_batch_size):
            self._generate_batch(samples[start : start + self.max_batch_size], params)
        return samples

    @torch.inference_mode()
    def _prefill(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[Tensor, Tensor, KVCache]:
        """Left-pad and prefill the prompts -> last logits (U, V), next positions (U,), the cache."""
        u, width = len(prompts), max(map(len, prompts))
        ids = torch.full((u, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(u, width, dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        dtype = next(self.model.parameters()).dtype
        cache = KVCache(self.model.cfg, u, width + max_new_tokens, dtype, self.device)
        logits = self.model(ids, positions, mask, cache)[:, -1]
        return logits, mask.sum(-1), cache

    @torch.inference_mode()
    def _generate_batch(self, samples: list[Sample], params: SamplingParams) -> None:
        b = len(samples)
        # The n samples of a prompt (a GRPO group) share one prefill: its cache rows are copied.
        unique: dict[tuple[int, ...], int] = {}
        owner = [unique.setdefault(tuple(s.prompt_ids), len(unique)) for s in samples]
        logits, next_pos, cache = self._prefill([list(p) for p in unique], params.max_new_tokens)
        expand = torch.tensor(owner, device=self.device)
        cache.keep(expand)
        logits, next_pos = logits[expand], next_pos[expand]  # (B, V), (B,)
        stop = torch.tensor([] if params.ignore_eos else self.eos_token_ids + params.stop_token_ids)
        rows = torch.arange(b)  # sample index of each live batch row
        out_tokens = torch.zeros(b, params.max_new_tokens, dtype=torch.long)
        out_logprobs = torch.zeros(b, params.max_new_tokens)
        lengths = torch.zeros(b, dtype=torch.long)
        stopped = torch.zeros(b, dtype=torch.bool)
        done = torch.zeros(b, dtype=torch.bool)  # per live row
        for step in range(params.max_new_tokens):
            tokens, logprobs = sample_next(
                logits, params.temperature, params.top_k, params.top_p, self.generator
            )
            tokens, logprobs = tokens.cpu(), logprobs.cpu()
            live = ~done
            out_tokens[rows[live], step] = tokens[live]
            out_logprobs[rows[live], step] = logprobs[live]
            lengths[rows[live]] += 1
            hit = live & torch.isin(tokens, stop)
            stopped[rows[hit]] = True
            done |= hit
            if step == params.max_new_tokens - 1 or bool(done.all()):
                break
            if done.float().mean() >= COMPACT_FRACTION:
                keep = (~done).nonzero().squeeze(-1)
                cache.keep(keep.to(self.device))
                rows, tokens, next_pos, done = rows[keep], tokens[keep], next_pos[keep], done[keep]
            step_mask = torch.ones(len(rows), 1, dtype=torch.bool, device=self.device)
            logits = self.model(tokens[:, None].to(self.device), next_pos[:, None], step_mask, cache)[:, -1]
            next_pos = next_pos + 1
        for i, s in enumerate(samples):
            n = int(lengths[i])
            s.response_ids = out_tokens[i, :n].tolist()
            s.logprobs = out_logprobs[i, :n].tolist()
            s.versions = [self.version] * n
            s.loss_mask = [1] * n
            s.status = Status.FINISHED
            s.finish_reason = "stop" if stopped[i] else "length"
