"""DecodeGraphs: the paged engine's decode steps replayed from CUDA graphs, one per batch-size bucket.

On a GPU a small model's decode step is launch-bound (a kernel launch from Python per operation per
layer); a CUDA graph replays the step's kernels with one launch (as nano-vllm and vLLM do). A graph
replays fixed shapes at fixed addresses, so each step's rows are copied into static buffers, padded
up to the next bucket size. Padding rows write their key into a scratch block no sequence owns and
attend to it alone. Block tables are padded to a fixed width (`max_blocks`, doubled and the graphs
recorded again when a longer sequence comes). A batch above the largest bucket runs eagerly, and
sampling stays outside the graph. capture=False runs the same padded, fixed-shape forward eagerly:
the path the CPU tests check against the eager engine.
"""

import torch
from torch import Tensor

from tandem.model.decoder import CausalLM
from tandem.model.paged_kv import PagedBatch, PagedKVCache

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
MIN_BLOCKS = 16  # the narrowest block tables recorded; they double as sequences grow


class DecodeGraphs:
    """Decode steps of `model` over `cache`, whose block `scratch_block` is reserved for padding rows."""

    def __init__(
        self, model: CausalLM, cache: PagedKVCache, scratch_block: int, max_num_seqs: int, capture: bool
    ):
        self.model, self.cache, self.capture = model, cache, capture
        self.scratch_block = scratch_block
        self.buckets = [b for b in BUCKETS if b <= max_num_seqs]  # larger batches: eager
        self.device = cache.k[0].device
        self.max_blocks = 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.pool = None  # the graphs share one memory pool: they never run at the same time
        self.rope: tuple[Tensor, Tensor] | None = None  # the RoPE table the graphs read
        self.num_steps = 0  # decode steps served here (replayed, or run eagerly without capture)

    def reset(self) -> None:
        """Forget every graph (sleep: the KV pools and weights they point at are freed)."""
        self.graphs, self.pool, self.max_blocks = {}, None, 0

    @torch.inference_mode()
    def run(
        self, ids: list[int], slots: list[int], tables: list[list[int]], context: list[int]
    ) -> Tensor | None:
        """One decode step of B rows (each row's token, its cache slot, its block table, its tokens in
        the cache counting this one) -> logits (B, V), or None when no bucket holds B rows."""
        b = len(ids)
        if b > self.buckets[-1]:
            return None
        width = max(map(len, tables))
        if self.model.rope_table is not self.rope:  # rebuilt for a longer prompt: graphs read the old
            self.reset()
        if width > self.max_blocks:
            self._allocate(max(MIN_BLOCKS, 1 << (width - 1).bit_length()))
        bucket = next(x for x in self.buckets if x >= b)
        pad = bucket - b
        rows = [t + [-1] * (self.max_blocks - len(t)) for t in tables]
        rows += [[self.scratch_block] + [-1] * (self.max_blocks - 1)] * pad
        scratch_slot = self.scratch_block * self.cache.block_size
        host = (ids + [0] * pad, slots + [scratch_slot] * pad, rows, context + [1] * pad)
        for buffer, values in zip((self.ids, self.slots, self.tables, self.context), host, strict=True):
            buffer[:bucket].copy_(torch.tensor(values, dtype=torch.long).view(buffer[:bucket].shape))
        if not self.capture:
            logits = self._forward(bucket)
        else:
            if bucket not in self.graphs:
                self.graphs[bucket] = self._record(bucket)
            graph, logits = self.graphs[bucket]
            graph.replay()
        self.num_steps += 1
        return logits[:b]

    def _allocate(self, max_blocks: int) -> None:
        """Static input buffers for the largest bucket with `max_blocks`-wide tables; graphs recorded
        for narrower tables read other buffers, so they go."""
        self.reset()
        self.max_blocks, n = max_blocks, self.buckets[-1]
        self.ids = torch.zeros(n, 1, dtype=torch.long, device=self.device)
        self.slots = torch.zeros(n, 1, dtype=torch.long, device=self.device)
        self.tables = torch.full((n, max_blocks), -1, dtype=torch.long, device=self.device)
        self.context = torch.ones(n, dtype=torch.long, device=self.device)
        # RoPE for every position the tables can hold, built now: a graph cannot build it later.
        self.model.rope(torch.tensor([[max_blocks * self.cache.block_size]], device=self.device))
        self.rope = self.model.rope_table

    def _forward(self, n: int) -> Tensor:
        """The fixed-shape decode forward of the first `n` rows of the static buffers -> (n, V)."""
        ones = torch.ones(n, dtype=torch.long, device=self.device)
        batch = PagedBatch(self.cache, self.slots[:n], self.tables[:n], self.context[:n], ones, all_real=True)
        token_mask = torch.ones(n, 1, dtype=torch.bool, device=self.device)
        return self.model(self.ids[:n], batch.positions(), token_mask, batch)[:, -1]

    def _record(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """-> (the graph, its output buffer)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm up off the capture: lazy initialisations happen here
            self._forward(bucket)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(bucket)
        self.pool = graph.pool()
        return graph, logits
