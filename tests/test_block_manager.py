"""BlockManager: accounting, fork and copy-on-write, prefix-cache hits, LRU eviction, errors, and a
random operation sequence (hypothesis) that simulates the KV memory and checks the invariants."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.rollout.block_manager import BlockCopy, BlockManager, OutOfBlocks, UnknownSequence


def counts(bm: BlockManager) -> tuple[int, int, int]:
    return bm.num_free_blocks, bm.num_used_blocks, bm.num_cached_blocks


# ---------------------------------------------------------------- accounting


def test_allocate_append_free_accounting():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", list(range(6))) == [0, 1]
    assert bm.num_tokens("a") == 6 and counts(bm) == (6, 2, 0) and bm.usage == 2 / 8
    assert bm.slots("a", 3, 6) == [3, 4, 5] and bm.slots("a") == list(range(6))
    assert bm.append("a", 6) is None and bm.append("a", 7) is None
    assert bm.block_table("a") == [0, 1]  # the last block filled up, no new one yet
    assert bm.append("a", 8) is None
    assert bm.block_table("a") == [0, 1, 2] and bm.slots("a", 8) == [8]
    bm.free("a")
    assert counts(bm) == (8, 0, 0) and "a" not in bm


def test_empty_sequence_gets_its_first_block_on_append():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.allocate(0, []) == []
    assert bm.can_append(0)
    bm.append(0, 5)
    assert bm.block_table(0) == [0] and bm.num_used_blocks == 1


def test_errors_are_clear_and_leave_state_unchanged():
    bm = BlockManager(num_blocks=3, block_size=2)
    assert not bm.can_allocate(7) and bm.can_allocate(6)
    with pytest.raises(OutOfBlocks, match="needs 4 blocks for 7 tokens; 3 of 3"):
        bm.allocate("big", list(range(7)))
    assert counts(bm) == (3, 0, 0) and "big" not in bm
    bm.allocate("a", list(range(6)))
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate("a", [1])
    assert not bm.can_append("a")
    with pytest.raises(OutOfBlocks):
        bm.append("a", 9)
    assert bm.num_tokens("a") == 6 and counts(bm) == (0, 3, 0)
    for call in (lambda: bm.free("nope"), lambda: bm.append("nope", 1), lambda: bm.fork("nope", "b")):
        with pytest.raises(UnknownSequence, match="'nope' holds no blocks"):
            call()
    with pytest.raises(ValueError, match="outside"):
        bm.slots("a", 2, 9)
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockManager(0, 4)


# ---------------------------------------------------------------- fork and copy-on-write


def test_fork_shares_blocks_and_copies_a_shared_partial_block_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("p", list(range(6)))  # blocks 0 (full), 1 (2 of 4 slots)
    assert bm.fork("p", "c1") == [0, 1] and bm.fork("p", "c2") == [0, 1]
    assert [bm.ref_count(b) for b in (0, 1)] == [3, 3] and bm.num_used_blocks == 2
    assert bm.append("c1", 6) == BlockCopy(src=1, dst=2)  # c1 writes into a copy of block 1
    assert bm.block_table("c1") == [0, 2] and bm.ref_count(1) == 2 and bm.ref_count(2) == 1
    assert bm.append("c1", 7) is None  # its own block now
    assert bm.append("p", 6) == BlockCopy(src=1, dst=3)
    assert bm.append("c2", 6) is None  # the last holder of block 1 writes in place
    assert bm.block_table("c2") == [0, 1] and bm.ref_count(1) == 1
    bm.free("p")
    assert bm.ref_count(0) == 2 and bm.ref_count(3) == 0
    bm.free("c1")
    bm.free("c2")
    assert counts(bm) == (8, 0, 0)


def test_fork_of_a_full_last_block_needs_no_copy():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("p", [1, 2])
    bm.fork("p", "c")
    assert bm.append("p", 3) is None and bm.append("c", 4) is None
    assert bm.block_table("p") == [0, 1] and bm.block_table("c") == [0, 2]


def test_copy_on_write_needs_a_block():
    bm = BlockManager(num_blocks=1, block_size=4)
    bm.allocate("p", [1, 2])
    bm.fork("p", "c")
    assert not bm.can_append("c")
    with pytest.raises(OutOfBlocks):
        bm.append("c", 3)
    assert bm.block_table("c") == [0] and bm.ref_count(0) == 2 and bm.num_tokens("c") == 2


# ---------------------------------------------------------------- prefix cache


def test_second_sequence_with_the_same_prompt_reuses_its_full_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(10))  # 2 full blocks and a tail of 2
    first = bm.allocate("a", prompt)
    bm.mark_computed("a", 10)
    second = bm.allocate("b", prompt)
    assert second[:2] == first[:2] and second[2] != first[2]  # the partial tail is never shared
    assert bm.num_cached_tokens("b") == 8 and bm.num_cached_tokens("a") == 0
    assert bm.hit_blocks == 2 and bm.queried_blocks == 4
    assert [bm.ref_count(b) for b in second] == [2, 2, 1]
    # A prompt diverging inside block 1 shares block 0 only.
    third = bm.allocate("c", [0, 1, 2, 3, 4, 99, 6, 7, 8])
    assert third[0] == first[0] and third[1] not in first and bm.num_cached_tokens("c") == 4


def test_keys_not_yet_computed_are_never_shared():
    bm = BlockManager(num_blocks=16, block_size=4)
    bm.allocate("a", list(range(9)))
    bm.mark_computed("a", 5)  # block 0 written, block 1 not yet
    bm.allocate("b", list(range(9)))
    assert bm.num_cached_tokens("b") == 4


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    bm.allocate("a", list(range(8)))
    bm.mark_computed("a", 8)
    table = bm.allocate("b", list(range(8)))
    assert bm.num_cached_tokens("b") == 4 and table[1] != bm.block_table("a")[1]
    bm.mark_computed("b", 8)  # b's copy of block 1 duplicates a's: it stays out of the cache
    bm.free("a")
    bm.free("b")
    assert counts(bm) == (14, 0, 2)


def test_prefix_cache_can_be_turned_off():
    bm = BlockManager(num_blocks=8, block_size=2, prefix_caching=False)
    bm.allocate("a", [1, 2, 3])
    bm.mark_computed("a", 3)
    bm.free("a")
    assert counts(bm) == (8, 0, 0)
    bm.allocate("b", [1, 2, 3])
    assert bm.num_cached_tokens("b") == 0 and bm.queried_blocks == 0


def test_reset_forgets_cached_keys_and_names_no_old_block_again():
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.allocate("done", [1, 2, 3])
    bm.mark_computed("done", 3)
    bm.free("done")
    bm.allocate("running", [1, 2, 3])
    assert bm.num_cached_tokens("running") == 2
    bm.reset_prefix_cache()  # new weights
    assert counts(bm) == (6, 2, 0)
    bm.append("running", 4)
    bm.mark_computed("running", 4)  # its keys mix old and new weights: not offered
    assert bm.allocate("new", [1, 2, 3, 4, 5]) and bm.num_cached_tokens("new") == 0
    bm.free("running")
    assert bm.num_cached_blocks == 0


# ---------------------------------------------------------------- eviction


def test_cached_blocks_are_evicted_only_when_no_free_block_is_left():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = bm.allocate("a", [1, 2, 3, 4, 5])  # blocks 0, 1 full, block 2 partial
    bm.mark_computed("a", 5)
    bm.free("a")
    assert counts(bm) == (2, 0, 2)  # the partial block is free, the full ones stay cached
    bm.allocate("b", [7, 7, 7, 7])  # takes the two free blocks
    assert counts(bm) == (0, 2, 2)
    assert bm.allocate("c", [8]) == [a[1]]  # evicts a's tail block, least recently released
    assert counts(bm) == (0, 3, 1)
    bm.free("c")
    bm.allocate("d", [1, 2, 3])  # a's head block is still cached
    assert bm.block_table("d")[0] == a[0] and bm.num_cached_tokens("d") == 2


def test_lru_order_of_cached_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    heads = {}
    for name, token in (("x", 10), ("y", 20)):
        heads[name] = bm.allocate(name, [token, token, 0])[0]
        bm.mark_computed(name, 3)
    bm.free("x")
    bm.free("y")  # cached: x's head, then y's; the partial tails are free
    assert counts(bm) == (2, 0, 2)
    bm.allocate("x again", [10, 10, 1])  # a hit: x's head is used, then cached again after y's
    assert bm.block_table("x again")[0] == heads["x"]
    bm.free("x again")
    bm.allocate("fill", [5, 6, 7, 8])  # the two free blocks
    assert bm.allocate("evict", [7]) == [heads["y"]]  # y's head was released longer ago
    bm.free("evict")
    assert bm.allocate("x", [10, 10, 2])[0] == heads["x"] and bm.num_cached_tokens("x") == 2


# ---------------------------------------------------------------- random operation sequences

BLOCK_SIZE, NUM_BLOCKS = 3, 12


class BlockMachine(RuleBasedStateMachine):
    """Drives a BlockManager as a scheduler would and keeps a stand-in for the KV memory: each slot
    holds the token whose keys were written there. Every sequence must read back its own tokens."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.tokens: dict[int, list[int]] = {}
        self.memory: dict[int, list[int | None]] = {b: [None] * BLOCK_SIZE for b in range(NUM_BLOCKS)}
        self.next_id = 0

    def write(self, seq: int, start: int) -> None:
        table = self.bm.block_table(seq)
        for p in range(start, len(self.tokens[seq])):
            block = table[p // BLOCK_SIZE]
            assert self.bm.ref_count(block) == 1, "a write to a shared block corrupts its other holders"
            self.memory[block][p % BLOCK_SIZE] = self.tokens[seq][p]

    @rule(prompt=st.lists(st.integers(0, 2), max_size=11))  # a small alphabet, so prefixes repeat
    def allocate(self, prompt):
        seq, before = self.next_id, counts(self.bm)
        self.next_id += 1
        try:
            self.bm.allocate(seq, prompt)
        except OutOfBlocks:
            assert not self.bm.can_allocate(len(prompt)) and counts(self.bm) == before
            return
        cached = self.bm.num_cached_tokens(seq)
        assert cached % BLOCK_SIZE == 0 and cached < max(len(prompt), 1)
        self.tokens[seq] = list(prompt)
        self.write(seq, cached)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if not self.bm.can_append(seq):
            with pytest.raises(OutOfBlocks):
                self.bm.append(seq, token)
            return
        copy = self.bm.append(seq, token)
        if copy is not None:
            self.memory[copy.dst] = list(self.memory[copy.src])
        self.tokens[seq].append(token)
        self.write(seq, len(self.tokens[seq]) - 1)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.fork(parent, self.next_id)
        self.tokens[self.next_id] = list(self.tokens[parent])
        self.next_id += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def mark_computed(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.mark_computed(seq, data.draw(st.integers(0, len(self.tokens[seq]))))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq)
        del self.tokens[seq]

    @rule()
    def reset_prefix_cache(self):
        self.bm.reset_prefix_cache()

    @invariant()
    def blocks_are_accounted_for(self):
        free, used, cached = counts(self.bm)
        assert free + used + cached == NUM_BLOCKS
        holders = [0] * NUM_BLOCKS
        for seq, tokens in self.tokens.items():
            table = self.bm.block_table(seq)
            assert len(table) == -(-len(tokens) // BLOCK_SIZE)
            for b in table:
                holders[b] += 1
        assert [self.bm.ref_count(b) for b in range(NUM_BLOCKS)] == holders
        assert sum(h > 0 for h in holders) == used

    @invariant()
    def every_sequence_reads_back_its_own_tokens(self):
        # Sharing through fork or the prefix cache is right exactly when the shared slots hold the
        # same tokens for every holder; a missed copy-on-write or a wrong hit breaks this.
        for seq, tokens in self.tokens.items():
            table = self.bm.block_table(seq)
            held = [self.memory[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(len(tokens))]
            assert held == tokens


BlockMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockMachine = BlockMachine.TestCase
