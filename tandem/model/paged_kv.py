"""PagedKVCache: every layer's keys and values in pools of fixed-size blocks, and attention over them.

A sequence's token at position p lives in slot `table[p // block_size] * block_size + p % block_size`
of each layer's pool; `tandem.rollout.block_manager.BlockManager` decides the tables. Sequences of
any lengths then share one batch, and blocks shared by several sequences (a forked group, a cached
prompt prefix) are stored once.

Attention gathers each sequence's blocks into a padded (B, Hkv, S, D) tensor and calls
`scaled_dot_product_attention`: plain torch, readable, and exact against the contiguous `KVCache`.
A fused paged kernel can replace `paged_attention` later behind the same signature.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tandem.model.config import ModelConfig


class PagedKVCache:
    """Per layer, key and value pools of shape (Hkv, num_blocks, block_size, D): head-major, so a
    gather of each row's blocks is already the (Hkv, B, S, D) layout `decode_attention` reads."""

    def __init__(
        self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ):
        shape = (cfg.num_key_value_heads, num_blocks, block_size, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers, keys and values: size num_blocks from a budget."""
        per_layer = block_size * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
        return 2 * cfg.num_hidden_layers * per_layer

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """slots (N,), k, v (N, Hkv, D): store each token's key and value in its slot (no padding
        here: `real_tokens` picks a padded batch's real tokens once per forward)."""
        for pool, new in ((self.k[layer], k), (self.v[layer], v)):
            flat = pool.view(pool.shape[0], -1, pool.shape[3])  # (Hkv, num_blocks * block_size, D)
            flat.index_copy_(1, slots, new.transpose(0, 1).to(pool.dtype))

    def gather(self, layer: int, block_tables: Tensor, index: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """block_tables (B, M) -> k, v (B, Hkv, S, D), S = M·bs: slot s of row b holds position s of
        sequence b (`key_mask` marks which slots a row fills). index: its `block_index`, when the
        caller has it."""
        index = block_index(block_tables) if index is None else index
        b = block_tables.shape[0]
        return gather_blocks(self.k[layer], index, b), gather_blocks(self.v[layer], index, b)

    def copy_blocks(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Copy-on-write: for each (src, dst), block dst of every pool takes block src's contents."""
        pairs = list(pairs)
        if not pairs:
            return
        device = self.k[0].device
        src = torch.tensor([s for s, _ in pairs], device=device)
        dst = torch.tensor([d for _, d in pairs], device=device)
        for pool in (*self.k, *self.v):
            pool[:, dst] = pool[:, src]


def real_tokens(slot_mapping: Tensor) -> tuple[Tensor, Tensor | None]:
    """slot_mapping (B, T), -1 for padding -> the real tokens' slots (N,) and their indices among
    the B·T flattened tokens, or None when every token is real (a decode step)."""
    slots = slot_mapping.reshape(-1)
    real = slots >= 0
    if bool(real.all()):
        return slots, None
    index = real.nonzero().squeeze(1)
    return slots[index], index


def block_index(block_tables: Tensor) -> Tensor:
    """block_tables (B, M) -> (B·M,) the blocks `gather_blocks` reads, row by row. Entries below 0
    pad short rows; they read block 0, which the key mask hides."""
    return block_tables.clamp(min=0).flatten()


def gather_blocks(pool: Tensor, index: Tensor, b: int) -> Tensor:
    """pool (Hkv, N, bs, D), index (B·M,) `block_index` of B rows' tables -> (B, Hkv, M·bs, D),
    each row's blocks in order: a view of a contiguous (Hkv, B, M·bs, D) gather."""
    hkv, _, bs, d = pool.shape
    # index_select copies whole blocks (bs·D values each): several times faster than pool[:, tables].
    blocks = pool.view(hkv, -1, bs * d).index_select(1, index)
    return blocks.view(hkv, b, -1, d).transpose(0, 1)


def key_mask(context_lens: Tensor, width: int) -> Tensor:
    """context_lens (B,) -> (B, width) bool: slot s holds a key of row b iff s < context_lens[b]."""
    return torch.arange(width, device=context_lens.device)[None, :] < context_lens[:, None]


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    query_lens: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Causal attention of new tokens over the paged keys and values -> (B, H, T, D).

    q (B, H, T, D) rotated queries; k_cache, v_cache (Hkv, N, bs, D) one layer's pools, already
    holding the new tokens' keys; block_tables (B, M); context_lens (B,) tokens in the cache per row,
    at least 1; query_lens (B,) new tokens per row (default T for every row).

    Row b's queries are its last query_lens[b] tokens, right-padded to T: query t sits at position
    p = context_lens[b] - query_lens[b] + t and attends to keys 0..p. One call serves decode (T = 1),
    prefill (query_lens = context_lens) and prefill after a prefix-cache hit (in between). Padding
    queries see the whole context, so they stay finite; their outputs mean nothing. GQA: H is a
    multiple of Hkv.
    """
    index, b = block_index(block_tables), block_tables.shape[0]
    k, v = gather_blocks(k_cache, index, b), gather_blocks(v_cache, index, b)
    if query_lens is None:
        query_lens = torch.full_like(context_lens, q.shape[2])
    mask = causal_key_mask(context_lens, query_lens, q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
    )


def query_positions(context_lens: Tensor, query_lens: Tensor, t: int) -> Tensor:
    """-> (B, T): query t of row b sits at position context_lens[b] - query_lens[b] + t."""
    return (context_lens - query_lens)[:, None] + torch.arange(t, device=context_lens.device)


def causal_key_mask(context_lens: Tensor, query_lens: Tensor, t: int, s: int) -> Tensor:
    """-> (B, 1, T, S) bool: the query at position p sees its row's keys 0..p of S slots. Padding
    queries see the whole context (finite, ignored)."""
    if t == 1:  # a query sits at or past its row's last key (position context_lens - query_lens)
        return key_mask(context_lens, s)[:, None, None]
    slots = torch.arange(s, device=context_lens.device)
    causal = slots[None, None, :] <= query_positions(context_lens, query_lens, t)[:, :, None]  # (B, T, S)
    return (causal & key_mask(context_lens, s)[:, None, :])[:, None]


@dataclass
class PagedBatch:
    """One forward's view of the paged cache (a `tandem.model.kv_cache.BatchCache`)."""

    cache: PagedKVCache
    slot_mapping: Tensor  # (B, T) the slot of each new token, -1 for padding
    block_tables: Tensor  # (B, M), -1 padded
    context_lens: Tensor  # (B,) tokens of each row in the cache once this forward wrote its own
    query_lens: Tensor  # (B,) new tokens of each row
    all_real: bool = False  # no padding token in slot_mapping: skip looking (a CUDA graph cannot)

    def __post_init__(self) -> None:  # what every layer reads: once, not per layer
        self.block_index = block_index(self.block_tables)
        if self.all_real:
            self.write_slots, self.write_index = self.slot_mapping.reshape(-1), None
        else:
            self.write_slots, self.write_index = real_tokens(self.slot_mapping)

    def positions(self) -> Tensor:
        """-> (B, T), `query_positions`."""
        return query_positions(self.context_lens, self.query_lens, self.slot_mapping.shape[1])

    def attention_mask(self, token_mask: Tensor) -> Tensor:
        """-> (B, 1, T, S) bool, `causal_key_mask` over the rows' blocks."""
        s = self.block_tables.shape[1] * self.cache.block_size
        return causal_key_mask(self.context_lens, self.query_lens, self.slot_mapping.shape[1], s)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v (B, Hkv, T, D) -> every key and value of the rows' blocks (B, Hkv, S, D)."""
        hkv, d = k.shape[1], k.shape[3]
        k, v = (x.transpose(1, 2).reshape(-1, hkv, d) for x in (k, v))  # (B·T, Hkv, D)
        if self.write_index is not None:
            k, v = k.index_select(0, self.write_index), v.index_select(0, self.write_index)
        self.cache.write(layer, self.write_slots, k, v)
        keys, values = self.cache.gather(layer, self.block_tables, self.block_index)
        return keys.to(k.dtype), values.to(v.dtype)
