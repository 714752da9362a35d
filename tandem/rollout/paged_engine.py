"""PagedEngine: the built-in engine with continuous batching over a paged KV cache.

Same `RolloutEngine` contract and semantics as `BuiltinEngine` (docs/rollout.md): the same
`generate`, per-token versions, `on_update` policies, abort and partial continuation. What differs
is inside: sequences join and leave the batch at every step (`Scheduler`), their keys live in
fixed-size blocks (`BlockManager`, `PagedKVCache`) shared by the samples of a group and, through
the prefix cache, by requests with the same leading tokens, and a sequence that finds no memory is
preempted and recomputed later instead of failing.

The update / abort gate (set_pending_update, apply_pending, abort, load_weights, version) is
BuiltinEngine's own, inherited so the two cannot drift; every applied update also resets the
prefix cache, so keys computed on old weights are never handed to a new sequence.
"""

import itertools
from collections.abc import Callable

from tandem.model import CausalLM
from tandem.model.paged_kv import PagedKVCache
from tandem.rollout.block_manager import BlockManager
from tandem.rollout.engine import (
    BuiltinEngine,
    checked_request,
    finish_if_complete,
    response_cap,
    tail_tokens,
)
from tandem.rollout.model_runner import ModelRunner
from tandem.rollout.protocol import SamplingParams, StopCheck
from tandem.rollout.scheduler import Scheduler
from tandem.rollout.sequence import Sequence
from tandem.sample import Sample


class PagedEngine(BuiltinEngine):
    """Continuous batching on `model` over `num_kv_blocks` blocks of `block_size` tokens.

    kv_budget_mb: size the blocks from a memory budget instead (overrides num_kv_blocks).
    max_num_seqs: sequences in the running batch; max_num_batched_tokens: prompt tokens one prefill
    step may compute (a longer prompt is prefilled in chunks, between decode steps).
    `num_preemptions` counts preemptions.
    group_sharing / prefix_caching: prefill a group's prompt once / reuse computed prompt blocks
    across requests; both on by default, off only to measure what they buy (bench/engine.py).
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
        seed: int = 0,
        version: int = 0,
        on_update: str = "drain",
        on_step: Callable[[int], None] | None = None,
        kv_budget_mb: float | None = None,
        prefix_caching: bool = True,
        group_sharing: bool = True,
        compile: bool = False,
    ):
        super().__init__(
            model,
            eos_token_ids,
            pad_token_id,
            seed=seed,
            version=version,
            on_update=on_update,
            on_step=on_step,
            compile=compile,
        )
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs}, max_num_batched_tokens={max_num_batched_tokens}")
        if kv_budget_mb is not None:
            dtype = next(model.parameters()).dtype
            num_kv_blocks = int(kv_budget_mb * 2**20) // PagedKVCache.block_bytes(
                model.cfg, block_size, dtype
            )
            if num_kv_blocks < 1:
                raise ValueError(f"kv_budget_mb={kv_budget_mb} holds no block of {block_size} tokens")
        self.block_manager = BlockManager(num_kv_blocks, block_size, prefix_caching)
        self.runner = ModelRunner(self.model, self.block_manager)
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.group_sharing = group_sharing
        self.num_preemptions = 0
        self._ids = itertools.count()

    def _after_update(self) -> None:
        self.block_manager.reset_prefix_cache()  # keys of the old weights serve no new request

    def generate(
        self, samples: list[Sample], params: SamplingParams, stop_check: StopCheck | None = None
    ) -> list[Sample]:
        """As `BuiltinEngine.generate`: extend each sample's response (empty or partial) to its end."""
        past_eos, text = checked_request(samples, params, stop_check)
        self._enter()
        try:
            self._apply_pending()  # a new call always starts on the newest weights
            stop_ids = set() if past_eos else {*self.eos_token_ids, *params.stop_token_ids}
            todo = [s for s in samples if not finish_if_complete(s, params, list(stop_ids), text)]
            seqs = [Sequence.start(next(self._ids), s, response_cap(s, params)) for s in todo]
            scheduler = Scheduler(
                self.block_manager, self.max_num_seqs, self.max_num_batched_tokens, self.group_sharing
            )
            try:
                scheduler.add(seqs)
                self._run(scheduler, params, stop_ids, text)
            finally:
                scheduler.clear()
                self.num_preemptions += scheduler.num_preemptions
            for seq in seqs:
                seq.write_back()
        finally:
            self._leave()
        return samples

    def _run(
        self, scheduler: Scheduler, params: SamplingParams, stop_ids: set[int], text: StopCheck | None
    ) -> None:
        """Step until every sequence has ended, or the call must stop (abort, or an update under
        "abort"). An update applied between steps ("continue") serves the next step's forward, so
        a token records the version of the weights whose forward gave its logits."""
        steps = 0
        while not scheduler.is_done:
            step = scheduler.schedule()
            version = self._version
            logits = self.runner.run(step)
            scheduler.computed(step)
            rows = step.rows  # none after a chunk that leaves its prompt unfinished
            tokens, logprobs = self.runner.sample(logits, rows, params, self.generator) if rows else ([], [])
            for seq, token, logprob in zip(rows, tokens, logprobs, strict=True):
                seq.record(token, logprob, version)
                seq.stopped = token in stop_ids
            if text is not None:
                self._check_text(rows, text)
            for seq in rows:
                if seq.stopped or seq.at_cap:
                    scheduler.finish(seq)
            if scheduler.is_done:
                break
            steps += 1
            if self.on_step is not None:
                self.on_step(steps)
            if self._between_steps():
                break
            if aborted := self._aborted_samples():  # abort(samples): only they stop
                scheduler.abort(aborted)
                if scheduler.is_done:
                    break

    @staticmethod
    def _check_text(rows: list[Sequence], text: StopCheck) -> None:
        live = [seq for seq in rows if not seq.stopped]
        if live:
            ends = text([tail_tokens(seq.response_ids, text.window) for seq in live])
            for seq, end in zip(live, ends, strict=True):
                seq.stopped = bool(end)
