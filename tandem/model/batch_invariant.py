"""Batch-invariant kernels: a token's result does not depend on what else is in the batch.

`CausalLM.batch_invariant = True` routes the decoder's matmuls, its MLP activation and its
attention through these functions, so the trainer's full-sequence forward (padded or packed),
prefill, chunked prefill and one-token decode against either KV cache give a token bit-identical
logits, and so bit-identical logprobs (the engine's and the trainer's log_softmax are the same
row-wise kernel).

How: every reduction runs in an order tandem fixes, never one a library picks for the batch at
hand. A BLAS (MKL, oneDNN, cuBLAS) chooses its kernel, its blocking and how it splits the work
between threads by the shape of the call, so each call here has ONE shape whatever the batch:

- Matmuls (`linear`): the rows are padded with zeros to a multiple of the dtype's row tile
  (`row_tile`) and multiplied a tile at a time, every call (tile, K) x (K, N'), or whole tiles up to
  MERGED_TILES a call where a probe finds that gives each tile a call of its own's bits (`tiles_free`),
  N' the weight's rows padded to a multiple
  of COL_TILE (on an AMD EPYC with MKL, a weight of 261 rows split between 16 threads gave its last
  columns another kernel; one of 272 did not). The layout this replaces, one GEMM over all rows
  padded to a multiple of 4, rested on what one CPU's BLAS was seen to do; on an Intel Xeon with
  AMX the engine and the trainer then differed by 0.030 in a logprob.
- Attention (`attention`): each (key head, sequence)'s query rows in tiles of QUERY_TILE and its
  keys in tiles of KEY_TILE; every matmul call multiplies one key tile of every entry by its query
  tiles, each tile's rows as by a call of its own (checked on the machine: `rows_free`), so its
  reductions (over the head dim, over KEY_TILE keys) are short and of one length. The partial sums
  over key tiles are added in fp32 by tandem, in key order, and a key a row cannot see (another
  row's longer context, a cache's free slots, padding) adds exact zeros, so it changes nothing.
- Element-wise ops are exactly rounded except the transcendental ones, whose vectorised and scalar
  loops can differ in the last bit (ATen runs the last elements of a thread's range, under two
  vectors, scalar). The attention's exp runs on a tensor padded (`_entries`) so that every
  thread's range is a multiple of 64 elements; SiLU over `padded_rows` rows, whose thread ranges
  end on row boundaries. These follow ATen's code (at::parallel_for's split), not a BLAS.
- Row-wise reductions of a fixed length (RMSNorm over the hidden size, log_softmax over the
  vocabulary) reduce each row alone: ATen parallelises them over rows.

What remains the library's: that a row's result does not depend on its place within a call, that
a batched matmul computes each entry the same whatever the number of entries, and that the kernel
a shape gets does not change with the thread count. `tandem.model.invariance` checks all three on
the machine at hand, in the run's dtype and shapes, before a deterministic run starts.

Cost (docs/results.md#determinism): a batch of fewer rows than a tile pays for a tile of them,
unless a smaller call gives its rows a tile's bits on the machine (`calls`: on 2 Zen 4 cores a
decode step of 64 sequences then multiplies 64 rows, not 128). The whole tile trades the engine
against the trainer: on SmolLM2-135M in bf16 (2 Zen 4 cores, 64 sequences decoding), tiles of 64 /
128 / 256 rows cost the engine 1.09x / 1.71x / 2.7x and the train step 1.56x / 1.24x / 1.24x (before
the smaller last calls); fp32 matmuls lose more at small tiles (a train step's matmuls 1.3x slower
at 128 rows than at 256), so fp32 keeps 256.
"""

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from tandem.model import packed as packing

ROW_TILE = 256  # rows per matmul call (fp32 and fp16; `row_tile`)
ROW_TILES = {torch.bfloat16: 128}  # dtypes whose matmuls lose little at fewer rows a call
SUB_TILES = (16, 32, 64)  # smaller calls for the rows after the last whole tile (`calls`)
COL_TILE = 64  # a weight's rows are padded to a multiple of this
QUERY_TILE = 4  # attention: query rows (query heads x tokens) per matmul entry
KEY_TILE = 32  # attention: keys per matmul entry
MERGED_TILES = 8  # a training micro-batch's whole row tiles per call, at most (`tiles_free`)
GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: element-wise ops under it run on one thread


def round_up(n: int, tile: int) -> int:
    """-> the multiple of `tile` >= n, at least one tile."""
    return max(tile, -(-n // tile) * tile)


def _threads_used(numel: int) -> int:
    """How many threads at::parallel_for splits an element-wise op over `numel` elements between:
    min(threads, ceil(numel / GRAIN_SIZE)), each given ceil(numel / used) elements."""
    return 1 if numel < GRAIN_SIZE else min(torch.get_num_threads(), -(-numel // GRAIN_SIZE))


def row_tile(dtype: torch.dtype) -> int:
    """Rows per matmul call in `dtype`: one number per dtype, so the engine and the trainer (which
    compute in the same dtype in a deterministic run) multiply a row by the same kernel."""
    return ROW_TILES.get(dtype, ROW_TILE)


def padded_rows(m: int, width: int) -> int:
    """-> the row count >= m, a multiple of SUB_TILES[0], at which an element-wise op over
    (rows, width) splits between threads at row boundaries (`_threads_used`)."""
    rows = round_up(m, SUB_TILES[0])
    while rows % _threads_used(rows * width):
        rows += SUB_TILES[0]
    return rows


def pad_rows(x: Tensor, rows: int) -> Tensor:
    """x (M, ...) -> (rows, ...), zeros appended (x itself when M == rows)."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def tiled_mm(x: Tensor, weight: Tensor, packed: Tensor | None = None) -> Tensor:
    """x (M, K), weight (N, K) -> x @ weight.T (M, N), as (rows, K) x (K, N') calls (`calls`: whole
    tiles, then a smaller call for the last rows where that gives the same bits; no autograd).
    packed: the weight packed for oneDNN (an engine's `tandem.model.packed` copy), multiplied by
    instead where that gives `torch.mm`'s result bit for bit (`packed.same_as_mm`): a fifth less
    time for a decode step's tiles, which need not re-lay the weight out at every call."""
    m, (n, k) = x.shape[0], weight.shape
    cols = round_up(n, COL_TILE)
    sizes = calls(m, cols, k, x.dtype, x.device)
    x = x.contiguous()
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    # A call's rows: x's own where they are all real (a view, in the layout a copy would have),
    # the last call's padded with zeros
    parts = [x[i : i + r] if i + r <= m else pad_rows(x[i:], r) for i, r in zip(starts, sizes, strict=True)]
    if packed is not None and n == cols and all(_packed_exact(n, k, x.dtype, r) for r in set(sizes)):
        tiles = [packing.multiply(part, packed) for part in parts]
        return (tiles[0] if len(tiles) == 1 else torch.cat(tiles))[:m]
    wt = pad_rows(weight, cols).t()  # (K, N')
    out = x.new_empty(sum(sizes), cols)
    # Whole tiles up to MERGED_TILES a call where that gives each tile a call of its own's bits here
    # (at most MERGED_TILES - 1 probes a weight shape, each of one such call)
    tile = row_tile(x.dtype)
    done, whole = 0, m // tile
    while (count := min(whole - done, MERGED_TILES)) > 1 and tiles_free(
        cols, k, x.dtype, count, x.device.type, torch.get_num_threads()
    ):
        rows = slice(done * tile, (done + count) * tile)
        torch.mm(x[rows], wt, out=out[rows])
        done += count
    for i, r, part in zip(starts[done:], sizes[done:], parts[done:], strict=True):
        torch.mm(part, wt, out=out[i : i + r])
    return out[:m, :n]


def calls(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> list[int]:
    """The row counts of `tiled_mm`'s calls for m rows by an (n, k) weight: whole tiles of
    `row_tile(dtype)` rows, then the rows left in the smallest of SUB_TILES whose call gives each
    row a whole tile's bits on this machine (`rows_exact`), else in a whole tile. A decode step of
    64 sequences then multiplies 64 rows, not 128, where the library's kernel allows it."""
    tile = row_tile(dtype)
    whole, rest = divmod(m, tile)
    if rest == 0 and whole:
        return [tile] * whole
    threads = torch.get_num_threads()
    fits = (r for r in SUB_TILES if rest <= r < tile and rows_exact(n, k, dtype, r, device.type, threads))
    return [tile] * whole + [next(fits, tile)]


@functools.cache
def rows_exact(n: int, k: int, dtype: torch.dtype, rows: int, device: str, threads: int) -> bool:
    """Whether a (rows, k) x (k, n) matmul gives the rows of a (row_tile, k) one bit for bit here:
    one random product each way, once per shape and thread count in a process. A library picks its
    kernel (and so a row's reduction order) by the call's shape: this checks, not assumes, that the
    smaller shape's is the same (on 2 Zen 4 cores it is, from 1 row in bf16 and from 8 in fp32)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(row_tile(dtype), k, generator=gen).to(dtype).to(device)
    weight = torch.randn(n, k, generator=gen).to(dtype).to(device).t()
    return torch.equal(torch.mm(x[:rows], weight), torch.mm(x, weight)[:rows])


@functools.cache
def tiles_free(n: int, k: int, dtype: torch.dtype, tiles: int, device: str, threads: int) -> bool:
    """Whether a (tiles x row_tile, k) x (k, n) matmul gives each tile of its rows the bits of a
    (row_tile, k) call here: one random product each way, once per shape, tile count and thread
    count in a process. Then `tiled_mm` multiplies a training micro-batch's whole tiles up to
    MERGED_TILES a call (fewer, larger calls run nearer the machine's peak), else one call a tile."""
    gen = torch.Generator().manual_seed(0)
    tile = row_tile(dtype)
    x = torch.randn(tiles * tile, k, generator=gen).to(dtype).to(device)
    weight = torch.randn(n, k, generator=gen).to(dtype).to(device).t()
    alone = torch.cat([torch.mm(x[i : i + tile], weight) for i in range(0, tiles * tile, tile)])
    return torch.equal(torch.mm(x, weight), alone)


def _packed_exact(n: int, k: int, dtype: torch.dtype, tile: int) -> bool:
    return torch.backends.mkldnn.enabled and packing.same_as_mm(n, k, dtype, tile, torch.get_num_threads())


class _TiledLinear(torch.autograd.Function):
    """x @ weight.T by `tiled_mm`; its backward is two plain matmuls (gradients need no invariance,
    only the same result for the same inputs, which a fixed shape and thread count give)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return tiled_mm(x, weight)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad.t() @ x if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def _mm(x: Tensor, weight: Tensor, packed: Tensor | None = None) -> Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _TiledLinear.apply(x, weight)
    return tiled_mm(x, weight, packed)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: Tensor | None = None) -> Tensor:
    """x (..., K), weight (N, K) -> (..., N): x @ weight.T + bias, every row reduced the same way
    at any batch size (`tiled_mm`; `packed`: the weight's packed copy, without autograd)."""
    out = _mm(x.reshape(-1, x.shape[-1]), weight, packed)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


Adapt = Callable[[Tensor, Tensor], Tensor]  # (a matmul's input rows, its output rows) -> output


def mlp(
    x: Tensor,
    gate_up: Tensor,
    gate_up_bias: Tensor | None,
    down: Tensor,
    down_bias: Tensor | None,
    adapters: tuple[Adapt, Adapt] | None = None,
    packed: tuple[Tensor | None, Tensor | None] = (None, None),
) -> Tensor:
    """x (..., E), gate_up (2I, E) the gate and up weights stacked, down (E, I) -> (..., E):
    down(silu(gate(x)) * up(x)) over `padded_rows` rows, SiLU reading the gate half in place.
    adapters: what adds LoRA deltas to the gate|up and to the down matmul's outputs (of the M real
    rows, given their inputs), after each bias. packed: the two weights' packed copies (`linear`)."""
    rows = x.reshape(-1, x.shape[-1])  # (M, E)
    m, width = rows.shape[0], down.shape[1]
    h = _mm(pad_rows(rows, padded_rows(m, width)), gate_up, packed[0])  # (M', 2I)
    if gate_up_bias is not None:
        h = h + gate_up_bias
    if adapters is not None:
        h = torch.cat([adapters[0](rows, h[:m]), h[m:]])
    gate, up = h.chunk(2, dim=-1)  # strided views: the activation loops row by row
    act = F.silu(gate) * up
    out = _mm(act, down, packed[1])[:m]
    if down_bias is not None:
        out = out + down_bias
    if adapters is not None:
        out = adapters[1](act[:m], out)
    return out.reshape(*x.shape[:-1], down.shape[0])


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """q (B, H, T, D), k, v (B, Hkv, S, D) with key s at position s, mask (B, 1, T, S) additive
    (0 or -inf; masked keys must trail each query's visible ones) -> (B, H, T, D).

    softmax(q·kᵀ/√D + mask) · v by `tiled_attention`. Under autograd its backward is that of
    `plain_attention` on the same inputs (the same function; the gradient needs no invariance).
    """
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return _Attention.apply(q, k, v, mask)
    return tiled_attention(q, k, v, mask)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        ctx.save_for_backward(q, k, v, mask)
        return tiled_attention(q, k, v, mask)

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, mask = ctx.saved_tensors
        inputs = [
            x.detach().requires_grad_(need)
            for x, need in zip((q, k, v), ctx.needs_input_grad[:3], strict=True)
        ]
        with torch.enable_grad():
            out = plain_attention(*inputs, mask)
        wanted = [x for x in inputs if x.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad))
        return *(next(grads) if x.requires_grad else None for x in inputs), None


def plain_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """`attention` with the library's kernels (batch-dependent rounding): its backward."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    g = h // hkv  # query heads per key head, in Hugging Face's order (head i reads key head i // G)
    scores = torch.matmul(q.reshape(b, hkv, g * t, d), k.transpose(-1, -2)).unflatten(2, (g, t))
    scores = scores.float() * (1 / math.sqrt(d)) + mask[:, :, None]  # (B, Hkv, G, T, S)
    probs = scores.softmax(-1).to(v.dtype).flatten(2, 3)
    return torch.matmul(probs, v).view(b, h, t, d)


def tiled_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """`attention`'s forward in fixed-shape calls (see the module docstring), no autograd.

    An entry is one (key head, sequence), in the caches' head-major order, so their keys are read
    in place. Its G·T query rows (G query heads x T tokens) come in QUERY_TILE tiles, its keys in
    KEY_TILE tiles; each matmul call takes one key tile of every entry and all its query tiles,
    where a call of many query tiles gives each the bits of a call of its own (`rows_free`), else
    one query tile a call. The element-wise steps and row sums run on all of them at once
    (`_entries` pads their count so that every element runs in the vectorised loop).
    """
    b, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = h // hkv
    n, count = g * t, hkv * b
    tiles_q, tiles_k = -(-n // QUERY_TILE), -(-s // KEY_TILE)
    total = _entries(count, tiles_q * tiles_k)
    keys, values = (x.transpose(0, 1).reshape(count, s, d) for x in (k, v))  # views of a cache
    # Queries scaled by 1/√D before the matmul (exact for D a power of 4), padding rows zero.
    queries = q.new_zeros(total, tiles_q * QUERY_TILE, d)
    rows = q.reshape(b, hkv, n, d).transpose(0, 1).reshape(count, n, d)
    torch.mul(rows, 1 / math.sqrt(d), out=queries[:count, :n])

    def tile(x: Tensor, j: int) -> Tensor:
        """x (count, S, D) -> key tile j of every entry (total, KEY_TILE, D): a view where whole (a copy
        in bf16 on the CPU, whose `bmm` copies views more slowly), else zero-padded (0 · value is 0)."""
        part = x[:, j * KEY_TILE : (j + 1) * KEY_TILE]
        if total == count and part.shape[1] == KEY_TILE:
            return part.contiguous() if x.dtype == torch.bfloat16 and x.device.type == "cpu" else part
        out = x.new_zeros(total, KEY_TILE, d)
        out[:count, : part.shape[1]] = part
        return out

    # Additive mask (tiles_k, total, rows, KT): the run's mask, -inf on padded keys, 0 on padding
    # rows and entries (finite, and dropped).
    rows_q = tiles_q * QUERY_TILE
    bias = torch.full((total, rows_q, tiles_k * KEY_TILE), float("-inf"), device=q.device)
    visible = mask.float()[:, 0].expand(hkv, b, t, s)[:, :, None].expand(hkv, b, g, t, s)
    bias[:count, :n, :s] = visible.reshape(count, n, s)
    bias[:, n:], bias[count:] = 0.0, 0.0
    bias = bias.view(total, rows_q, tiles_k, KEY_TILE).permute(2, 0, 1, 3).contiguous()

    threads = torch.get_num_threads()
    scores = q.new_empty(tiles_k, total, rows_q, KEY_TILE)
    whole = rows_free(rows_q, d, KEY_TILE, True, q.dtype, q.device.type, threads)
    for j in range(tiles_k):
        _query_tiles(queries, tile(keys, j).transpose(1, 2), scores[j], whole)
    x = bias.add_(scores)  # fp32
    top = x.amax(-1, keepdim=True).amax(0)  # (total, rows, 1): a max is exact in any order
    p = torch.exp(x.sub_(top))
    sums = p.sum(-1)  # (tiles_k, total, rows): each row of KEY_TILE alone
    p = p.to(v.dtype)
    weighted = v.new_empty(tiles_k, total, rows_q, d)
    whole = rows_free(rows_q, KEY_TILE, d, False, q.dtype, q.device.type, threads)
    for j in range(tiles_k):
        _query_tiles(p[j], tile(values, j), weighted[j], whole)
    norm, acc = sums[0], weighted[0].float()
    for j in range(1, tiles_k):  # in key order: a tile no row sees adds exact zeros
        norm, acc = norm + sums[j], acc + weighted[j].float()
    out = (acc / norm[..., None]).to(v.dtype)[:count, :n]  # (count, n, D)
    return out.reshape(hkv, b, g, t, d).permute(1, 0, 2, 3, 4).reshape(b, h, t, d)


def _query_tiles(a: Tensor, b: Tensor, out: Tensor, whole: bool) -> None:
    """a (E, rows, K) @ b (E, K, N) -> out (E, rows, N), each QUERY_TILE of rows as by a call of
    its own: in one call where that gives the same bits (`rows_free`), else one call a tile."""
    if whole:
        torch.bmm(a, b, out=out)
        return
    for i in range(0, a.shape[1], QUERY_TILE):
        out[:, i : i + QUERY_TILE] = torch.bmm(a[:, i : i + QUERY_TILE].contiguous(), b)


@functools.cache
def rows_free(
    rows: int, k: int, n: int, transposed: bool, dtype: torch.dtype, device: str, threads: int
) -> bool:
    """Whether an entry (rows, k) x (k, n) of a batched matmul gives each QUERY_TILE of its rows the
    bits of a (QUERY_TILE, k) entry here (transposed: the right operand is a (n, k) transposed, as
    keys are): one random product each way, once per shape and thread count in a process. Then
    `tiled_attention` multiplies all of a key tile's query tiles in one call (on 2 Zen 4 cores it
    can, in bf16 and fp32), not one call a query tile."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, rows, k, generator=gen).to(dtype).to(device)
    right = (
        torch.randn(3, n, k, generator=gen).transpose(1, 2)
        if transposed
        else torch.randn(3, k, n, generator=gen)
    )
    right = right.to(dtype).to(device)
    product = torch.bmm(a, right)
    tiles = (torch.bmm(a[:, i : i + QUERY_TILE].contiguous(), right) for i in range(0, rows, QUERY_TILE))
    return torch.equal(torch.cat(list(tiles), dim=1), product)


def _entries(count: int, tiles: int) -> int:
    """-> the entry count >= `count` at which an element-wise op over (tiles, entries, QUERY_TILE,
    KEY_TILE) runs every element in the vectorised loop: each thread's range (`_threads_used`) must
    be a multiple of 64 elements (two vectors of up to 32 lanes) to leave no scalar tail."""
    numel = tiles * QUERY_TILE * KEY_TILE  # per entry
    while (count * numel) % (64 * _threads_used(count * numel)):
        count += 1
    return count
