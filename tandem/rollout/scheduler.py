"""Scheduler: continuous batching over a waiting and a running queue, within three budgets.

Each step is a prefill or a decode (nano-vllm's split; the runner pads a step's rows to its longest,
so a decode row in a prefill step would cost a whole chunk). A prefill admits waiting sequences
while the sequence budget (`max_num_seqs`), the token budget (`max_num_batched_tokens`) and the KV
budget (`BlockManager.can_allocate`) allow; otherwise every running sequence decodes one token.

- Chunked prefill: a prompt longer than what is left of a step's token budget is computed in chunks,
  one per prefill step; its group waits in `partial` (holding its blocks), taking turns with the
  decode steps, and joins `running` once its last chunk gives it logits.
- Preemption: when a decode finds no free block, the most recently admitted running sequence is
  freed and goes back to the front of the waiting queue, to be recomputed (never an OOM error).
- Group sharing: equal waiting sequences next to each other (a GRPO group, as `make_groups` lays
  them out) are admitted together: the first is prefilled, the others `fork` its blocks.
- Shared prefixes: a prompt whose first uncached full block another prompt of the step computes
  (a system prompt and chat template common to every request) waits for the next step, where the
  prefix cache gives it those blocks: 256 held-out prompts of the recipe prefill their common
  first block once, not 256 times.
"""

from collections import deque
from dataclasses import dataclass, field

from tandem.rollout.block_manager import BlockCopy, BlockManager
from tandem.rollout.sequence import Sequence


@dataclass
class Step:
    """One forward's worth of work: prefill groups (the first of each is computed, the rest share
    its blocks and logits) with the token span [start, end) each head computes, or decode rows with
    the block copies to make before it."""

    prefill: list[list[Sequence]] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # per prefill group
    decode: list[Sequence] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)

    @property
    def completes(self) -> list[bool]:
        """Per prefill group: whether this step computes the rest of its prompt, and so gives it
        logits (a chunk short of the end gives none)."""
        return [end == len(g[0]) for g, (_, end) in zip(self.prefill, self.spans, strict=True)]

    @property
    def rows(self) -> list[Sequence]:
        """The sequences that sample a token from this step's logits."""
        if self.prefill:
            return [s for g, done in zip(self.prefill, self.completes, strict=True) if done for s in g]
        return list(self.decode)


class Scheduler:
    """Decides each step's sequences; the `BlockManager` (which outlives it) holds their blocks."""

    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, group_sharing: bool
    ):
        self.bm = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.group_sharing = group_sharing
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.partial: list[Sequence] | None = None  # a group whose prompt is being chunk-prefilled
        self._chunk_turn = True  # with a partial group, chunk and decode steps alternate
        self.num_preemptions = 0

    @property
    def is_done(self) -> bool:
        return not self.waiting and not self.running and self.partial is None

    def add(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if self.bm.blocks_for(seq.max_tokens - 1) > self.bm.num_blocks:
                raise ValueError(
                    f"a sequence of up to {seq.max_tokens} tokens needs more than all "
                    f"{self.bm.num_blocks} KV blocks of {self.bm.block_size}: raise num_kv_blocks"
                )
            self.waiting.append(seq)

    def schedule(self) -> Step:
        """The next step: the next chunk of a partial prompt or admit what fits (prefill), else
        decode every running sequence."""
        if self.partial is not None and (self._chunk_turn or not self.running):
            return self._next_chunk()
        self._chunk_turn = True
        if self.partial is None and (step := self._admit()):
            return step
        if (step := self._reserve_decode()).decode:
            return step
        # Every running sequence was preempted: finish the partial prompt, or recompute them.
        if self.partial is not None:
            return self._next_chunk()
        if step := self._admit():
            return step
        raise RuntimeError("the scheduler found nothing to run")  # add() rules this out

    def _next_chunk(self) -> Step:
        """The partial group's next chunk, up to a whole step's token budget."""
        self._chunk_turn = False
        head = self.partial[0]
        end = min(len(head), head.num_computed + self.max_num_batched_tokens)
        return Step(prefill=[self.partial], spans=[(head.num_computed, end)])

    def computed(self, step: Step) -> None:
        """After the forward: the keys of every computed token are in the cache. A partial group
        whose last chunk this was starts decoding."""
        for group, (_, end), done in zip(step.prefill, step.spans, step.completes, strict=True):
            for seq in group:
                seq.num_computed = end
                self.bm.mark_computed(seq.seq_id, end)
            if group is self.partial and done:
                self.running.extend(group)
                self.partial = None
        for seq in step.decode:
            self.bm.mark_computed(seq.seq_id, self.bm.num_tokens(seq.seq_id))

    def finish(self, seq: Sequence) -> None:
        """The sequence ended: its blocks are freed now."""
        self.bm.free(seq.seq_id)
        self.running.remove(seq)

    def abort(self, keys: set[tuple[int, int]]) -> None:
        """Drop the running and waiting sequences whose sample's `key` is in `keys`, freeing their
        blocks. A group still being prefilled in chunks is left to finish its prefill: the engine
        asks again every step."""
        for seq in [s for s in self.running if s.sample.key in keys]:
            self.finish(seq)
        self.waiting = deque(s for s in self.waiting if s.sample.key not in keys)

    def clear(self) -> None:
        """End of the call: free every running (or partly prefilled) sequence's blocks, forget the
        waiting ones."""
        for seq in self.running + (self.partial or []):
            self.bm.free(seq.seq_id)
        self.running, self.partial, self.waiting = [], None, deque()

    def _admit(self) -> Step | None:
        """Admit waiting groups into one prefill step while the budgets allow; the last may get only
        a first chunk of its prompt (it becomes `partial`) -> the step, or None if none fits."""
        step, tokens = Step(), 0  # tokens to compute: the prompt less what the prefix cache holds
        computing: set[bytes] = set()  # the first block each prompt of this step computes
        while self.waiting and len(self.running) < self.max_num_seqs and tokens < self.max_num_batched_tokens:
            head = self.waiting[0]
            if not self.bm.can_allocate(len(head)):
                break
            first = self.bm.first_uncached(head.token_ids)
            if first is not None:
                if first in computing:  # next step, from the prefix cache
                    break
                computing.add(first)
            self.waiting.popleft()
            self.bm.allocate(head.seq_id, head.token_ids)
            head.num_computed = self.bm.num_cached_tokens(head.seq_id)
            group = [head]
            while (
                self.group_sharing
                and self.waiting
                and len(self.running) + len(group) < self.max_num_seqs
                and self.waiting[0].token_ids == head.token_ids
            ):
                member = self.waiting.popleft()
                self.bm.fork(head.seq_id, member.seq_id)
                group.append(member)
            end = min(len(head), head.num_computed + self.max_num_batched_tokens - tokens)
            step.prefill.append(group)
            step.spans.append((head.num_computed, end))
            tokens += end - head.num_computed
            if end < len(head):  # the rest of its prompt comes in later chunks
                self.partial = group
                self._chunk_turn = False
                break
            self.running.extend(group)
        return step if step.prefill else None

    def _reserve_decode(self) -> Step:
        """A decode step: each running sequence's next slot reserved, the newest preempted (freed,
        back to the front of the waiting queue) while blocks run out."""
        queue, step = list(self.running), Step()
        while queue:
            seq = queue.pop(0)
            while not self.bm.can_append(seq.seq_id):
                victim = queue.pop() if queue else seq
                self.bm.free(victim.seq_id)
                self.waiting.appendleft(victim)
                self.num_preemptions += 1
                if victim is seq:
                    break
            else:
                if (copy := self.bm.append(seq.seq_id, seq.token_ids[-1])) is not None:
                    step.copies.append(copy)
                step.decode.append(seq)
        self.running = list(step.decode)
        return step
