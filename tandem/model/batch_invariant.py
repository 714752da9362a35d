"""Batch-invariant kernels: a token's result does not depend on what else is in the batch.

`CausalLM.batch_invariant = True` routes the decoder's matmuls, its MLP activation and its
attention through these functions, so the trainer's full-sequence forward (padded or packed),
prefill, chunked prefill and one-token decode against either KV cache give a token bit-identical
logits, and so bit-identical logprobs (the engine's and the trainer's log_softmax are the same
row-wise kernel). The rest of the forward already is row-wise: embedding, RoPE, residual adds,
RMSNorm (one row per reduction) and softmax / log_softmax over the last dim.

What the CPU kernels do, measured (torch 2.13, MKL sgemm and oneDNN bf16 gemm, AVX512, 1 to 16
threads; tests/test_batch_invariant.py re-checks it on the machine it runs on):

- A GEMM's row depends on the number of rows M unless M is a multiple of 4: M = 1 is a GEMV, and
  the remainder of M mod 4 rows (per thread) takes other micro-kernels. Hence `ROW_TILE`: rows are
  padded with zeros to a multiple of it. Columns (N >= 16) and zero-padded trailing terms of the
  reduction (K >= 16) change nothing.
- An element-wise op over a contiguous range runs the vectorized loop and then a scalar tail, and a
  multi-threaded one splits its range at `ceil(numel / threads)`. SiLU's vector and scalar exp
  differ in the last bit, so a row cut by a thread's chunk, or ending a range, could differ from
  itself elsewhere. `padded_rows` picks a row count whose chunks end on row boundaries, and the
  activation reads a strided view (the gate half of gate|up), which the loop walks row by row.
- softmax's sum over keys keeps 16 lane accumulators (AVX512 fp32) and reduces them in a fixed tree;
  masked keys add exact zeros. So keys sit at their positions (key s is position s, from 0), the
  masked ones trail, and every row has at least `MIN_KEYS` keys (a shorter row takes another path).
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

ROW_TILE = 4  # GEMM rows come in multiples of this (see the module docstring)
MIN_KEYS = 16  # attention sees at least this many (masked, trailing) keys
GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: element-wise ops under it run on one thread


def padded_rows(m: int, width: int) -> int:
    """-> the row count >= m, a multiple of ROW_TILE, at which an element-wise op over (rows, width)
    splits between threads at row boundaries (at::parallel_for gives each of its
    min(threads, ceil(numel / GRAIN_SIZE)) threads ceil(numel / threads) elements)."""
    rows = max(ROW_TILE, -(-m // ROW_TILE) * ROW_TILE)
    threads = torch.get_num_threads()
    while True:
        used = 1 if rows * width < GRAIN_SIZE else min(threads, -(-rows * width // GRAIN_SIZE))
        if rows % used == 0:
            return rows
        rows += ROW_TILE


def pad_rows(x: Tensor, rows: int) -> Tensor:
    """x (M, K) -> (rows, K), zero rows appended (x itself when M == rows)."""
    return x if x.shape[0] == rows else F.pad(x, (0, 0, 0, rows - x.shape[0]))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., K), weight (N, K) -> (..., N): x @ weight.T + bias over rows padded to a multiple of
    ROW_TILE, so each row's reduction order is the same at any batch size."""
    rows = x.reshape(-1, x.shape[-1])  # (M, K)
    m = rows.shape[0]
    out = F.linear(pad_rows(rows, max(ROW_TILE, -(-m // ROW_TILE) * ROW_TILE)), weight, bias)
    return out[:m].view(*x.shape[:-1], weight.shape[0])


def mlp(
    x: Tensor, gate_up: Tensor, gate_up_bias: Tensor | None, down: Tensor, down_bias: Tensor | None
) -> Tensor:
    """x (..., E), gate_up (2I, E) the gate and up weights stacked, down (E, I) -> (..., E):
    down(silu(gate(x)) * up(x)) over `padded_rows` rows, SiLU reading the gate half in place."""
    rows = x.reshape(-1, x.shape[-1])  # (M, E)
    m, width = rows.shape[0], down.shape[1]
    h = F.linear(pad_rows(rows, padded_rows(m, width)), gate_up, gate_up_bias)  # (M', 2I)
    gate, up = h.chunk(2, dim=-1)  # strided views: the activation loops row by row
    out = F.linear(F.silu(gate) * up, down, down_bias)
    return out[:m].view(*x.shape[:-1], down.shape[0])


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """q (B, H, T, D), k, v (B, Hkv, S, D) with key s at position s, mask (B, 1, T, S) additive
    (0 or -inf; masked keys must trail each query's visible ones) -> (B, H, T, D).

    softmax(q·kᵀ/√D + mask) · v, the H/Hkv query heads of a key head as the rows of one matmul
    (padded to a multiple of ROW_TILE), softmax in fp32 over at least MIN_KEYS keys. Batched over
    (Hkv, B), the caches' head-major layout, so their keys and values are read in place.
    """
    b, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if s < MIN_KEYS:  # zero keys, masked: their exp is 0 and their values are multiplied by it
        k, v = (F.pad(x, (0, 0, 0, MIN_KEYS - s)) for x in (k, v))
        mask = F.pad(mask, (0, MIN_KEYS - s), value=float("-inf"))
    g = h // hkv  # query heads per key head, in Hugging Face's order (head i reads key head i // G)
    n = g * t
    rows = -(-n // ROW_TILE) * ROW_TILE
    queries = q.reshape(b, hkv, n, d).transpose(0, 1)  # (Hkv, B, G·T, D)
    if rows != n:
        queries = F.pad(queries, (0, 0, 0, rows - n))
    keys, values = k.transpose(0, 1), v.transpose(0, 1)  # (Hkv, B, S, D)
    scores = torch.matmul(queries, keys.transpose(-1, -2))[:, :, :n]  # (Hkv, B, G·T, S)
    scores = scores.unflatten(2, (g, t)).float() * (1 / math.sqrt(d)) + mask.transpose(0, 1)[:, :, None]
    probs = scores.softmax(-1).to(v.dtype).flatten(2, 3)  # (Hkv, B, G·T, S)
    if rows != n:
        probs = F.pad(probs, (0, 0, 0, rows - n))
    out = torch.matmul(probs, values)[:, :, :n]  # (Hkv, B, G·T, D)
    return out.unflatten(2, (g, t)).permute(1, 0, 2, 3, 4).reshape(b, h, t, d)
