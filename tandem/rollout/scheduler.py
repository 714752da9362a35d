"""Scheduler: continuous batching over a waiting and a running queue, within three budgets.

Each step is a prefill or a decode (nano-vllm's split). A prefill admits waiting sequences while
the sequence budget (`max_num_seqs`), the token budget (`max_num_batched_tokens`) and the KV budget
(`BlockManager.can_allocate`) allow; otherwise every running sequence decodes one token. When a
decode finds no free block, the most recently admitted running sequence is preempted: its blocks
are freed and it goes back to the front of the waiting queue, to be recomputed from its prompt and
the tokens it has so far (never an out-of-memory error). A sequence leaves as soon as it ends.

Waiting sequences with the same tokens next to each other in the queue (the samples of one GRPO
group, as `make_groups` lays them out) are admitted together: the first is allocated and
prefilled, the others `fork` its blocks, so the prompt is prefilled once for the group
(`group_sharing=False` turns this off, for benchmarks: each sample then prefills its own copy).
"""

from collections import deque
from dataclasses import dataclass, field

from tandem.rollout.block_manager import BlockCopy, BlockManager
from tandem.rollout.sequence import SeqState, Sequence


@dataclass
class Step:
    """One forward's worth of work: prefill groups (the first of each is computed, the rest share
    its blocks and logits), or decode rows with the block copies to make before it."""

    prefill: list[list[Sequence]] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)

    @property
    def rows(self) -> list[Sequence]:
        """The sequences that sample a token from this step's logits."""
        return [s for group in self.prefill for s in group] if self.prefill else list(self.decode)


class Scheduler:
    """Decides each step's sequences; the `BlockManager` (which outlives it) holds their blocks."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        group_sharing: bool = True,
    ):
        self.bm = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.group_sharing = group_sharing
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0

    @property
    def is_done(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if self.bm.blocks_for(seq.max_tokens - 1) > self.bm.num_blocks:
                raise ValueError(
                    f"a sequence of up to {seq.max_tokens} tokens needs more than all "
                    f"{self.bm.num_blocks} KV blocks of {self.bm.block_size}: raise num_kv_blocks"
                )
            self.waiting.append(seq)

    def schedule(self) -> Step:
        """The next step: admit what fits (prefill), else decode every running sequence."""
        if groups := self._admit():
            return Step(prefill=groups)
        decode, copies = self._reserve_decode()
        if decode:
            return Step(decode=decode, copies=copies)
        if groups := self._admit():  # every running sequence was preempted: recompute them
            return Step(prefill=groups)
        raise RuntimeError("the scheduler found nothing to run")  # add() rules this out

    def computed(self, step: Step) -> None:
        """After the forward: the keys of every row's tokens are in the cache."""
        for seq in step.rows:
            self.bm.mark_computed(seq.seq_id, self.bm.num_tokens(seq.seq_id))

    def finish(self, seq: Sequence) -> None:
        """The sequence ended: free its blocks now."""
        self.bm.free(seq.seq_id)
        self.running.remove(seq)
        seq.state = SeqState.FINISHED

    def clear(self) -> None:
        """End of the call: free every running sequence's blocks, forget the waiting ones."""
        for seq in self.running:
            self.bm.free(seq.seq_id)
        self.running.clear()
        self.waiting.clear()

    def _admit(self) -> list[list[Sequence]]:
        groups: list[list[Sequence]] = []
        tokens = 0  # counts whole prefixes: an upper bound, prefix-cache hits are known only later
        while self.waiting and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            if groups and tokens + len(head) > self.max_num_batched_tokens:
                break
            if not self.bm.can_allocate(len(head)):
                break
            self.waiting.popleft()
            self.bm.allocate(head.seq_id, head.token_ids)
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
            for seq in group:
                seq.state = SeqState.RUNNING
            self.running.extend(group)
            groups.append(group)
            tokens += len(head)
        return groups

    def _reserve_decode(self) -> tuple[list[Sequence], list[BlockCopy]]:
        """Reserve each running sequence's next slot, preempting the newest when blocks run out."""
        queue, scheduled, copies = list(self.running), [], []
        while queue:
            seq = queue.pop(0)
            while not self.bm.can_append(seq.seq_id):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                copy = self.bm.append(seq.seq_id, seq.token_ids[-1])
                if copy is not None:
                    copies.append(copy)
                scheduled.append(seq)
        self.running = scheduled
        return scheduled, copies

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq.seq_id)
        seq.state = SeqState.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
