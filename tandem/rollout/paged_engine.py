"""PagedEngine: `BuiltinEngine`'s contract with continuous batching over a paged KV cache.

Sequences join and leave the batch at every step (`Scheduler`); their keys live in fixed-size
blocks (`BlockManager`, `PagedKVCache`) shared by a group's samples and, through the prefix cache,
by requests with the same leading tokens; a sequence that finds no memory is preempted and
recomputed later instead of failing.
"""

from typing import Any

from torch import Tensor

from tandem.model.decoder import CausalLM
from tandem.model.paged_kv import PagedKVCache
from tandem.rollout.base import Generation, Storages
from tandem.rollout.block_manager import BlockManager
from tandem.rollout.call import GenerateCall
from tandem.rollout.decoder_engine import DecoderEngine
from tandem.rollout.model_runner import ModelRunner
from tandem.rollout.scheduler import Scheduler, Step
from tandem.rollout.sequence import sample_tokens, take_tokens
from tandem.sample import Sample


class PagedEngine(DecoderEngine):
    """Continuous batching on `model` over `num_kv_blocks` blocks of `block_size` tokens (or as
    many as `kv_budget_mb` holds); `num_preemptions` counts preemptions.

    max_num_seqs: sequences in the running batch; max_num_batched_tokens: prompt tokens one prefill
    step may compute (a longer prompt is prefilled in chunks, between decode steps).
    group_sharing / prefix_caching: prefill a group's prompt once / reuse computed prompt blocks
    across requests; off only to measure what they buy (bench/engine.py).
    cuda_graphs: decode steps through `DecodeGraphs` (on the CPU, its fixed-shape forward eagerly).
    options: `DecoderEngine`'s, as `BuiltinEngine` takes them.
    """

    def __init__(
        self,
        model: CausalLM,
        eos_token_ids: list[int],
        pad_token_id: int,
        num_kv_blocks: int = 1024,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        kv_budget_mb: float | None = None,
        prefix_caching: bool = True,
        group_sharing: bool = True,
        cuda_graphs: bool = False,
        **options: Any,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs}, max_num_batched_tokens={max_num_batched_tokens}")
        super().__init__(model, eos_token_ids, pad_token_id, **options)
        if kv_budget_mb is not None:
            block_bytes = PagedKVCache.block_bytes(model.cfg, block_size, self.model.lm_head.weight.dtype)
            num_kv_blocks = int(kv_budget_mb * 2**20) // block_bytes
            if num_kv_blocks < 1:
                raise ValueError(f"kv_budget_mb={kv_budget_mb} holds no block of {block_size} tokens")
        # Recording routing: every token's experts come from a forward of this request (no cached
        # prefix), run eagerly (a graph's replay would not record).
        record = bool(self.moe_layers)
        self.block_manager = BlockManager(num_kv_blocks, block_size, prefix_caching and not record)
        self.runner = ModelRunner(
            self.model, self.block_manager, cuda_graphs and not record, max_num_seqs, self.forward
        )
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.group_sharing = group_sharing
        self.num_preemptions = 0
        self.memory = Storages([*self.weight_tensors(), *self.runner.cache.k, *self.runner.cache.v])

    def _on_sleep(self) -> None:
        super()._on_sleep()
        self.block_manager.reset_prefix_cache()  # the cached keys are gone with the pools
        if self.runner.graphs is not None:  # they point at the memory freed now
            self.runner.graphs.reset()

    def _on_wake(self) -> None:
        # Attention reads whole blocks, masked slots included, and a masked NaN still poisons the
        # softmax (0 x NaN): the pools come back zeroed, as they were built.
        for pool in (*self.runner.cache.k, *self.runner.cache.v):
            pool.zero_()

    def _after_update(self) -> None:
        super()._after_update()
        self.block_manager.reset_prefix_cache()  # keys of the old weights serve no new request

    def _begin(self, samples: list[Sample], call: GenerateCall) -> "_Continuous":
        if any(s.adapter is not None for s in samples):  # its prefix cache and groups know no adapter
            raise ValueError(
                "The paged engine runs one adapter a call; rows of several adapters need "
                "rollout.engine=builtin."
            )
        return _Continuous(self, samples, call)


class _Continuous(Generation):
    """The `Generation` of one call: the scheduler's steps until every sequence has ended. A token
    records the version of the weights whose forward gave its logits."""

    def __init__(self, engine: PagedEngine, samples: list[Sample], call: GenerateCall):
        self.engine, self.call = engine, call
        self.seqs = engine.sequences(samples, call)
        self.scheduler = Scheduler(
            engine.block_manager, engine.max_num_seqs, engine.max_num_batched_tokens, engine.group_sharing
        )
        self.scheduler.add(self.seqs)

    @property
    def done(self) -> bool:
        return self.scheduler.is_done

    def step(self) -> bool:
        engine, scheduler = self.engine, self.scheduler
        step = scheduler.schedule()
        version = engine.version
        logits = engine.runner.run(step)
        if engine.runner.routes is not None:
            self._record(step, engine.runner.routes)
        scheduler.computed(step)
        rows = step.rows  # none after a chunk that leaves its prompt unfinished
        if not rows:
            return False
        tokens, logprobs = sample_tokens(logits, rows, self.call.params, engine.generator)
        take_tokens(rows, tokens, logprobs, version, self.call)
        for seq in rows:
            if seq.ended:
                scheduler.finish(seq)
        return True

    def _record(self, step: Step, routes: Tensor) -> None:
        """routes (B, T, L, k): the experts of the tokens each row computed, to their sequences (a
        prefill group's members share its head's)."""
        if step.decode:
            for b, seq in enumerate(step.decode):
                seq.routes[len(seq) - 1] = routes[b, 0]
        for b, (group, (start, end)) in enumerate(zip(step.prefill, step.spans, strict=True)):
            for seq in group:
                seq.routes[start:end] = routes[b, : end - start]

    def stop(self, keys: set[tuple[int, int]]) -> None:
        self.scheduler.abort(keys)

    def close(self) -> None:
        self.scheduler.clear()
        self.engine.num_preemptions += self.scheduler.num_preemptions
        for seq in self.seqs:
            seq.write_back()
