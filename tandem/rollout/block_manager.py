"""BlockManager: hands out fixed-size KV-cache blocks by id, shares them, and caches full blocks.

Pure bookkeeping, no tensors: the model runner owns the memory (`PagedKVCache`) and does what this
module asks (write the slots it names, copy the blocks `append` returns). A sequence's token at
position p lives in block `table[p // block_size]`, at offset `p % block_size`.

Blocks are shared two ways: `fork` gives a child every block of its parent (a GRPO group prefills
its prompt once), and the prefix cache gives a new sequence the full blocks an earlier one computed
for the same leading tokens. A full block is named by a hash of (its parent block's hash, its own
token ids), so a name stands for the whole prefix up to its end; the root of every chain is salted
with an epoch that `reset_prefix_cache` bumps, so KV of old weights never reaches a new sequence.

Invariants (tests/test_block_manager.py checks them under random operation sequences):
- Every block is free (ref 0, no hash), used (ref > 0) or cached (ref 0, hashed, evictable).
- A block's ref count is the number of block-table entries holding it; a sequence of n tokens holds
  exactly ceil(n / block_size) blocks.
- Only full blocks carry a hash, so a block shared through the prefix cache is never written again;
  a partly filled block is shared only through `fork`, and `append` copies it first (copy-on-write).
  Hence a block is written only while its ref count is 1.
- A block is hashed only after `mark_computed` says its KV is written: none is shared unwritten.
- A cached block is evicted only when no free block is left, least recently released first.
"""

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from typing import NamedTuple


class OutOfBlocks(RuntimeError):
    """No free or evictable block is left (the scheduler asks `can_allocate` / `can_append` first)."""


class UnknownSequence(LookupError):
    """The sequence id holds no blocks (never allocated, or already freed)."""


class BlockCopy(NamedTuple):
    """Copy-on-write: copy block `src`'s keys and values into block `dst` before writing to `dst`."""

    src: int
    dst: int


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The 16-byte BLAKE2b of (parent block's hash, this block's token ids). 128 bits make a
    collision (another prompt's keys) vanishingly unlikely: blocks keep no tokens to compare."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


@dataclass
class _Seq:
    table: list[int]
    token_ids: list[int]
    epoch: int  # the prefix-cache epoch its oldest keys were computed in
    hashes: list[bytes] = field(default_factory=list)  # of its first len(hashes) full blocks
    num_cached_tokens: int = 0  # leading tokens whose keys came from the prefix cache

    def copy(self) -> "_Seq":
        return replace(self, table=list(self.table), token_ids=list(self.token_ids), hashes=list(self.hashes))


class BlockManager:
    """`num_blocks` blocks of `block_size` token slots each, shared by the sequences (any hashable id).

    prefix_caching: reuse computed full blocks across sequences; off, blocks are shared only by fork.
    hit_blocks / queried_blocks count prompt blocks served from the cache / looked up in it.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size}; both must be at least 1")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, least recently released first
        self._block_of: dict[bytes, int] = {}  # the prefix cache: hash -> block
        self._hash_of: dict[int, bytes] = {}  # its inverse, for used and cached blocks alike
        self._seqs: dict[Hashable, _Seq] = {}
        self._epoch = 0
        self.hit_blocks = 0
        self.queried_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks no sequence holds that keep computed keys for the prefix cache (evictable)."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_available_blocks(self) -> int:
        return len(self._free) + len(self._evictable)  # cached blocks are taken by eviction

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks  # cached blocks count as free memory

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._seq(seq_id).table)

    def num_tokens(self, seq_id: Hashable) -> int:
        return len(self._seq(seq_id).token_ids)

    def num_cached_tokens(self, seq_id: Hashable) -> int:
        """Leading tokens whose keys the prefix cache supplied at `allocate`: skip them in prefill."""
        return self._seq(seq_id).num_cached_tokens

    def first_uncached(self, token_ids: list[int]) -> bytes | None:
        """The name of the first leading full block of `token_ids` that the prefix cache does not
        hold, which `allocate` then prefill would compute; None when there is none (or no cache).
        Two prompts get the same name only if they agree on every token up to that block's end."""
        return self._match_prefix(token_ids)[2]

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def slots(self, seq_id: Hashable, start: int = 0, end: int | None = None) -> list[int]:
        """Cache slots (block * block_size + offset) of the sequence's positions start .. end-1."""
        seq, bs = self._seq(seq_id), self.block_size
        end = len(seq.token_ids) if end is None else end
        if not 0 <= start <= end <= len(seq.token_ids):
            raise ValueError(f"positions {start}..{end} outside the sequence's {len(seq.token_ids)} tokens")
        return [seq.table[p // bs] * bs + p % bs for p in range(start, end)]

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether `allocate` of `num_tokens` tokens surely fits. Prefix-cache hits are not counted,
        so the answer never over-promises (allocate itself counts them exactly)."""
        return self.blocks_for(num_tokens) <= self.num_available_blocks

    def allocate(self, seq_id: Hashable, token_ids: list[int]) -> list[int]:
        """Blocks for a new sequence's tokens -> its block table, ceil(len / block_size) ids.

        Leading full blocks found in the prefix cache are shared, not allocated, and
        `num_cached_tokens` says how many tokens need no prefill. The last token is never taken from
        the cache, so the forward always has a position to take the next token's logits from.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already holds blocks; free it before allocating again")
        hits, hashes, _ = self._match_prefix(token_ids)
        new = self.blocks_for(len(token_ids)) - len(hits)
        revived = sum(self._ref[b] == 0 for b in hits)  # cached hits leave the available pool too
        if new + revived > self.num_available_blocks:
            raise OutOfBlocks(
                f"sequence {seq_id!r} needs {new + revived} blocks for {len(token_ids)} tokens; "
                f"{self.num_available_blocks} of {self.num_blocks} are free or evictable"
            )
        for b in hits:  # before taking new blocks, so eviction cannot take a hit
            self._evictable.pop(b, None)
            self._ref[b] += 1
        table = hits + [self._take() for _ in range(new)]
        self._seqs[seq_id] = _Seq(table, list(token_ids), self._epoch, hashes, len(hits) * self.block_size)
        self.hit_blocks += len(hits)
        self.queried_blocks += max(len(token_ids) - 1, 0) // self.block_size if self.prefix_caching else 0
        return list(table)

    def can_append(self, seq_id: Hashable) -> bool:
        """Whether `append` finds a block: it takes one when the last block is full (or there is
        none), or shared and partly filled (copy-on-write). Ask before each append of a step."""
        seq = self._seq(seq_id)
        takes = len(seq.token_ids) % self.block_size == 0 or self._ref[seq.table[-1]] > 1
        return int(takes) <= self.num_available_blocks

    def append(self, seq_id: Hashable, token_id: int) -> BlockCopy | None:
        """Reserve the slot of one more token (`slots(seq_id, n - 1)`, n the new length) -> the
        block copy to make first, if any."""
        seq, copy = self._seq(seq_id), None
        if len(seq.token_ids) % self.block_size == 0:
            seq.table.append(self._take())
        elif self._ref[seq.table[-1]] > 1:
            copy = BlockCopy(seq.table[-1], self._take())  # take first: an OutOfBlocks changes nothing
            self._ref[copy.src] -= 1
            seq.table[-1] = copy.dst
        seq.token_ids.append(token_id)
        return copy

    def mark_computed(self, seq_id: Hashable, num_tokens: int) -> None:
        """The keys of the sequence's first `num_tokens` tokens are written: its full blocks among
        them enter the prefix cache. Call after each forward (prefill or decode)."""
        seq = self._seq(seq_id)
        if not 0 <= num_tokens <= len(seq.token_ids):
            raise ValueError(f"num_tokens={num_tokens} outside the sequence's {len(seq.token_ids)} tokens")
        if not self.prefix_caching or seq.epoch != self._epoch:
            return  # keys from older weights are never offered to new sequences
        bs = self.block_size
        for i in range(len(seq.hashes), num_tokens // bs):
            parent = seq.hashes[-1] if seq.hashes else self._root()
            h = block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            seq.hashes.append(h)
            block = seq.table[i]
            # A second copy of a cached block (recomputed, e.g. a prompt's last block) stays unnamed.
            if h not in self._block_of and block not in self._hash_of:
                self._block_of[h], self._hash_of[block] = block, h

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[int]:
        """A child sharing every block (and token) of its parent -> the child's block table."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already holds blocks; cannot fork into it")
        for b in parent.table:
            self._ref[b] += 1
        self._seqs[child_id] = parent.copy()
        return list(parent.table)

    def free(self, seq_id: Hashable) -> None:
        """Release the sequence's blocks: a block no one holds becomes cached if hashed, else free."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        # Last block first, so a prompt's tail is evicted before its head, which more prompts share.
        for b in reversed(seq.table):
            self._ref[b] -= 1
            if self._ref[b] == 0 and b in self._hash_of:
                self._evictable[b] = None
            elif self._ref[b] == 0:
                self._free.append(b)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (call on a weight update): cached blocks become free, held
        blocks lose their names, and sequences allocated before now never name blocks again."""
        self._epoch += 1
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._block_of.clear()
        self._hash_of.clear()

    def _seq(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequence(f"sequence {seq_id!r} holds no blocks: never allocated, or freed") from None

    def _root(self) -> bytes:
        return block_hash(b"tandem-kv", [self._epoch])

    def _match_prefix(self, token_ids: list[int]) -> tuple[list[int], list[bytes], bytes | None]:
        """The cached blocks holding the leading full blocks of `token_ids`, their hashes, and the
        hash of the first full block past them that the cache does not hold (None: none)."""
        if not self.prefix_caching:
            return [], [], None
        bs, hits, hashes = self.block_size, [], []
        eligible = max(len(token_ids) - 1, 0) // bs  # leave at least the last token to compute
        parent = self._root()
        for i in range(eligible):
            parent = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            if parent not in self._block_of:
                return hits, hashes, parent
            hits.append(self._block_of[parent])
            hashes.append(parent)
        return hits, hashes, None

    def _take(self) -> int:
        """A block for new keys, ref count 1: a free one, else the least recently released cached one."""
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        else:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are held by sequences")
        self._ref[block] = 1
        return block
