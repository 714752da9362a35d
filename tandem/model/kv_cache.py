"""KVCache: per-layer key/value tensors for a batch of sequences that advance together; BatchCache:
the contract of a cache that lays out its own keys (the paged one, `PositionedCache`)."""

from typing import Protocol

import torch
from torch import Tensor

from tandem.model.batch_invariant import KEY_TILE, round_up
from tandem.model.config import ModelConfig


class BatchCache(Protocol):
    """A cache that lays out its own keys, as the paged batch of `tandem.rollout.model_runner` does:
    the forward takes the attention mask from it, and it writes each layer's new keys where it wants.
    """

    def attention_mask(self, token_mask: Tensor) -> Tensor:
        """token_mask (B, T) -> (B, 1, T, S) bool over the keys `update` returns."""
        ...

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v (B, Hkv, T, D) of the new tokens -> every key and value they attend to (B, Hkv, S, D)."""
        ...


class KVCache:
    """Keys and values per layer, filled left to right, stored head-major as (Hkv, B, S_max, D):
    a decode step's attention then reads each key head of every row as one batch of matrices
    (`decode_attention`), with no copy. `update` hands them out as (B, Hkv, S, D) views.

    All rows share one write position (`length`); rows padded on the left mark their padding with
    `key_mask` so attention skips it. `keep(rows)` drops finished rows so they stop costing compute.
    """

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device):
        shape = (cfg.num_key_value_heads, batch, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.key_mask = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.key_mask.shape[1]

    def append_mask(self, mask: Tensor) -> None:
        """mask (B, T): which of the next T slots hold real tokens. Call before the forward."""
        self.key_mask[:, self.length : self.length + mask.shape[1]] = mask

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v (B, Hkv, T, D) for the next T slots -> all keys and values so far (B, Hkv, S, D)."""
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length : end] = k.transpose(0, 1)
        self.v[layer][:, :, self.length : end] = v.transpose(0, 1)
        return self.k[layer][:, :, :end].transpose(0, 1), self.v[layer][:, :, :end].transpose(0, 1)

    def advance(self, steps: int) -> None:
        self.length += steps

    def at_positions(self, positions: Tensor, token_mask: Tensor) -> "PositionedCache":
        """This cache seen as a `BatchCache` that keeps each row's key at position p in slot p
        (the batch-invariant forward's layout: no left padding in front of a row's keys)."""
        return PositionedCache(self, positions, token_mask)

    def keep(self, rows: Tensor) -> None:
        """Keep only `rows` (1-D index tensor) of the batch."""
        self.k = [k[:, rows] for k in self.k]
        self.v = [v[:, rows] for v in self.v]
        self.key_mask = self.key_mask[rows]


class PositionedCache:
    """A `BatchCache` over a KVCache whose row b holds its token at position p
    in slot p: positions (B, T) of the forward's tokens, token_mask (B, T) which are real (only
    those are written; a padding token attends to the keys up to its clamped position)."""

    def __init__(self, cache: KVCache, positions: Tensor, token_mask: Tensor):
        self.cache, self.positions = cache, positions
        self.rows, self.cols = token_mask.nonzero(as_tuple=True)  # (N,) each: the real tokens
        self.slots = positions[self.rows, self.cols]  # (N,)
        # Whole key tiles of the batch-invariant attention, so it reads them in place; the slots
        # past a row's position are masked (zeros or an earlier row's keys: finite either way).
        self.width = min(round_up(int(positions.max()) + 1, KEY_TILE), cache.max_len)

    def attention_mask(self, token_mask: Tensor) -> Tensor:
        """-> (B, 1, T, S) bool: the token at position p sees slots 0..p."""
        slots = torch.arange(self.width, device=self.positions.device)
        return (slots[None, None, :] <= self.positions[:, :, None])[:, None]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v (B, Hkv, T, D) -> every key and value of the rows (B, Hkv, S, D), S = longest position + 1."""
        for store, new in ((self.cache.k[layer], k), (self.cache.v[layer], v)):
            store[:, self.rows, self.slots] = new[self.rows, :, self.cols].transpose(0, 1)  # (Hkv, N, D)
        keys, values = (
            store[layer][:, :, : self.width].transpose(0, 1) for store in (self.cache.k, self.cache.v)
        )
        return keys, values
