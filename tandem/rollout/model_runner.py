"""ModelRunner: one step's batch tensors and the forward over the paged KV cache.

The model is the one `CausalLM`; a `PagedBatch` passed as its cache writes each layer's new keys
into their slots and hands attention every key of each row's blocks (`CausalLM.forward` takes the
mask from it). Rows are right-padded: row b computes its last query_lens[b] tokens.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from tandem.model.decoder import CausalLM
from tandem.model.paged_kv import PagedBatch, PagedKVCache
from tandem.rollout.block_manager import BlockManager
from tandem.rollout.cuda_graphs import DecodeGraphs
from tandem.rollout.scheduler import Step
from tandem.rollout.sequence import Sequence


class ModelRunner:
    """Owns the KV pools; runs `model` over them for the scheduler's steps.

    num_prefill_tokens counts the tokens prefills computed (prefix-cache hits and forks excluded).
    cuda_graphs: decode steps through `DecodeGraphs` (recorded on cuda; on the CPU the same padded
    fixed-shape forward runs eagerly, for tests); the pools then hold one more block, for padding.
    """

    def __init__(
        self,
        model: CausalLM,
        block_manager: BlockManager,
        cuda_graphs: bool = False,
        max_num_seqs: int = 256,
        forward: Callable[..., tuple[Tensor, Tensor | None]] | None = None,
    ):
        self.model, self.bm = model, block_manager
        # The engine's forward (`DecoderEngine.forward`): logits, and each token's experts when it
        # records routing; `routes` keeps those of the last step's rows, (B, T, L, k) or None.
        self.forward = forward or (lambda *args: (model(*args), None))
        self.routes: Tensor | None = None
        p = next(model.parameters())
        self.device = p.device
        blocks = block_manager.num_blocks + int(cuda_graphs)
        self.cache = PagedKVCache(model.cfg, blocks, block_manager.block_size, p.dtype, p.device)
        self.graphs = None
        if cuda_graphs:
            capture = p.device.type == "cuda"
            self.graphs = DecodeGraphs(model, self.cache, block_manager.num_blocks, max_num_seqs, capture)
        self.num_prefill_tokens = 0

    @torch.inference_mode()
    def run(self, step: Step) -> Tensor:
        """-> logits (R, V) for the R = len(step.rows) sequences that sample next; a prefill group's
        members all get the logits of the one row computed for it."""
        if step.decode:
            self.cache.copy_blocks(step.copies)
            if self.graphs is not None and (logits := self._graph_decode(step.decode)) is not None:
                return logits
            new = [(seq, len(seq) - 1, len(seq)) for seq in step.decode]
        else:
            new = [(g[0], start, end) for g, (start, end) in zip(step.prefill, step.spans, strict=True)]
            self.num_prefill_tokens += sum(end - start for _, start, end in new)
        batch, ids = self._batch(new)
        # Only each row's last computed token samples: its logits alone, (B, 1, V).
        at = None if step.decode else batch.query_lens - 1
        logits, self.routes = self.forward(ids, batch.positions(), batch.slot_mapping >= 0, batch, None, at)
        if step.decode:  # one token per row
            return logits[:, 0]
        last = logits[:, 0]  # (B, V)
        # A group's members share its head's logits; a chunk short of the prompt's end gives none.
        done = zip(step.prefill, step.completes, strict=True)
        owner = [i for i, (g, completes) in enumerate(done) if completes for _ in g]
        return last[torch.tensor(owner, dtype=torch.long, device=self.device)]

    def _graph_decode(self, seqs: list[Sequence]) -> Tensor | None:
        """A decode step through the graphs -> logits (B, V), or None to run it eagerly."""
        ids = [seq.token_ids[-1] for seq in seqs]
        slots = [self.bm.slots(seq.seq_id, len(seq) - 1, len(seq))[0] for seq in seqs]
        tables = [self.bm.block_table(seq.seq_id) for seq in seqs]
        return self.graphs.run(ids, slots, tables, [len(seq) for seq in seqs])

    def _batch(self, new: list[tuple[Sequence, int, int]]) -> tuple[PagedBatch, Tensor]:
        """Rows (sequence, start, end): compute its tokens start..end-1, after the `start` whose keys
        are cached -> the batch and token ids (B, T)."""
        t = max(end - start for _, start, end in new)
        tables = [self.bm.block_table(seq.seq_id) for seq, _, _ in new]
        m = max(map(len, tables))
        # Padded Python lists, then one tensor each: a decode step has a row per running sequence,
        # and a small tensor per row costs more than the row's whole share of the forward.
        ids, slots = [], []
        for seq, start, end in new:
            pad = t - (end - start)
            ids.append(seq.token_ids[start:end] + [0] * pad)
            slots.append(self.bm.slots(seq.seq_id, start, end) + [-1] * pad)
        tables = [table + [-1] * (m - len(table)) for table in tables]
        to = self.device
        ids, slots, tables = (torch.tensor(x, dtype=torch.long, device=to) for x in (ids, slots, tables))
        context = torch.tensor([end for _, _, end in new], device=to)
        query = torch.tensor([end - start for _, start, end in new], device=to)
        return PagedBatch(self.cache, slots, tables, context, query), ids
