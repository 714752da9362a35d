"""FP8 weights for the rollout: float8 e4m3 in 128x128 blocks, one scale per block (DeepSeek-V3's
recipe, as vLLM, SGLang and DeepGEMM run it), quantised on the receiving side of each weight push.

The engine keeps its high-precision parameters, by Hugging Face name, as the targets of every weight
push; `quantize_model` swaps the decoder's projections for `Fp8Linear` modules that adopt those very
parameters (names, shapes and the fused views of `fuse_projections` unchanged) and hold an fp8 copy
beside them; after each push the engine calls `requantize(model)`, which re-quantises every copy
from the values just received, in place. Embeddings, norms, the LM head and an MoE router stay in
the compute dtype.

Numbers: q = rne_e4m3(clamp(w / s, ±448)), w ≈ deq = q · s, s = amax(|block|) / 448 ("fp32") or
that rounded up to a power of two ("ue8m0", DeepGEMM's scale format). On the CPU the forward
dequantises to the compute dtype and runs one ordinary matmul; on an H100 it runs
`torch._scaled_mm` on fp8 operands (see `fp8_linear`).
"""

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(FP8).max: 1.75 · 2^8
SCALE_FORMATS = ("fp32", "ue8m0")
# Hugging Face's names for the attention and MLP projections (dense, shared expert or expert).
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_blockwise(w: Tensor, block: int = 128, scale: str = "fp32") -> tuple[Tensor, Tensor]:
    """w (N, K) finite -> q (N, K) float8_e4m3fn, scales (ceil(N/block), ceil(K/block)) fp32.

    Per block b: s_b = amax_b / 448 with amax_b = max |w| over the block (edge blocks cover what is
    left of the last rows / columns); "ue8m0": s_b = 2^ceil(log2(amax_b / 448)), so 448 · s_b >=
    amax_b always holds and nothing saturates. An all-zero block gets s_b = 1 (q = 0, no NaN).
    q = rne_e4m3(clamp(w / s_b, -448, 448)) in fp32 arithmetic; the clamp only catches the last-bit
    overshoot of amax_b / s_b under fp32 scales.
    """
    _check_scale(scale)
    n, k = w.shape
    rows, cols = -(-n // block), -(-k // block)
    padded = F.pad(w.float(), (0, cols * block - k, 0, rows * block - n))  # zeros leave amax alone
    blocks = padded.view(rows, block, cols, block)
    scales = block_scales(blocks.abs().amax(dim=(1, 3)), scale)  # (R, C)
    q = (blocks / scales[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.view(rows * block, cols * block)[:n, :k].contiguous(), scales


def block_scales(amax: Tensor, scale: str = "fp32") -> Tensor:
    """amax (...) >= 0 fp32 -> the blocks' scales (...): amax / 448, or for "ue8m0" the smallest
    power of two >= amax / 448; 1 where amax is 0."""
    s = amax / E4M3_MAX
    if scale == "ue8m0":
        s = torch.exp2(torch.ceil(torch.log2(s)))
        s = torch.where(amax > E4M3_MAX * s, 2 * s, s)  # log2's last bit must not let one saturate
    return torch.where(amax > 0, s, torch.ones_like(s))


def dequantize_blockwise(
    q: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32, block: int = 128
) -> Tensor:
    """q (N, K) fp8, scales (ceil(N/block), ceil(K/block)) -> w (N, K) in `dtype`:
    w[i, j] = q[i, j] · scales[i // block, j // block], the product in fp32, then rounded to `dtype`."""
    n, k = q.shape
    full = scales.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]  # (N, K)
    return (q.float() * full).to(dtype)


def fp8_linear(
    x: Tensor,
    q: Tensor,
    scales: Tensor,
    bias: Tensor | None,
    parts: Sequence[int],
    block: int = 128,
    scale: str = "fp32",
) -> Tensor:
    """x (..., K), q (N, K) fp8 whose rows are `parts` (N_i rows each, quantised separately, so
    scales are their grids stacked: (sum_i ceil(N_i/block), ceil(K/block))) -> (..., N) in x.dtype.

    y = x · deq(q, scales)^T + bias. On the CPU, and wherever `_scaled_mm_ok` says no: the weight
    is dequantised to x.dtype for this call and one F.linear runs (the numbers of
    `F.linear(x, dequantize_parts(q, scales, parts, x.dtype), bias)`, exactly); on a GPU that is
    one bf16 (x.dtype) copy of the weight per call. On an H100: x quantised in 1x128 blocks (scales
    in the `scale` format) times the fp8 weight through `torch._scaled_mm`, not the same numbers.
    """
    if _scaled_mm_ok(x, q, parts, block):
        return _scaled_mm_linear(x, q, scales, bias, block, scale)
    return F.linear(x, dequantize_parts(q, scales, parts, x.dtype, block), bias)


def dequantize_parts(
    q: Tensor, scales: Tensor, parts: Sequence[int], dtype: torch.dtype, block: int = 128
) -> Tensor:
    """`dequantize_blockwise` of each part's rows, stacked: (N, K) in `dtype`."""
    pieces = [dequantize_blockwise(q[r], scales[s], dtype, block) for r, s in part_slices(parts, block)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def part_slices(parts: Sequence[int], block: int = 128) -> Iterator[tuple[slice, slice]]:
    """-> per part, (its rows of q, its rows of scales)."""
    row = srow = 0
    for n in parts:
        nb = -(-n // block)
        yield slice(row, row + n), slice(srow, srow + nb)
        row, srow = row + n, srow + nb


class Fp8Linear(nn.Module):
    """y = x · deq(qweight, scales)^T + bias, for inference; the stand-in for an nn.Linear.

    weight (N, K): the high-precision source, kept (an nn.Parameter stays registered under its
    name, so weight pushes by Hugging Face name still land in it; a plain tensor, such as a fused
    q|k|v weight, is only referenced). parts: the row counts of the separately quantised source
    weights stacked in `weight` (default: one part), e.g. (H·D, Hkv·D, Hkv·D) for a fused q|k|v,
    so the numbers do not depend on whether the engine fuses. qweight (N, K) float8_e4m3fn and
    scales (sum ceil(N_i/128), ceil(K/128)) fp32 are non-persistent buffers: checkpoints and weight
    sync never see them. `requantize()` rewrites them in place (CUDA graphs keep their pointers).
    """

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None = None,
        scale: str = "fp32",
        block: int = 128,
        parts: Sequence[int] | None = None,
    ):
        super().__init__()
        _check_scale(scale)
        self.weight, self.bias = weight, bias
        self.scale, self.block = scale, block
        n, k = weight.shape
        self.parts = tuple(parts) if parts is not None else (n,)
        if sum(self.parts) != n:
            raise ValueError(f"Fp8Linear: parts {self.parts} do not add up to the weight's {n} rows.")
        grid = (sum(-(-p // block) for p in self.parts), -(-k // block))
        self.register_buffer("qweight", torch.empty(n, k, dtype=FP8, device=weight.device), persistent=False)
        self.register_buffer("scales", torch.empty(grid, device=weight.device), persistent=False)
        self.requantize()

    @classmethod
    def from_linear(cls, linear: nn.Linear, scale: str = "fp32", block: int = 128) -> "Fp8Linear":
        """Adopts the linear's own weight and bias parameters (the same objects)."""
        return cls(linear.weight, linear.bias, scale, block)

    @torch.no_grad()
    def requantize(self) -> None:
        """qweight, scales <- quantize_blockwise of each part of `weight`, written in place."""
        for rows, srows in part_slices(self.parts, self.block):
            q, s = quantize_blockwise(self.weight[rows], self.block, self.scale)
            self.qweight[rows].copy_(q)
            self.scales[srows].copy_(s)

    def dequantized(self, dtype: torch.dtype | None = None) -> Tensor:
        """(N, K): the weight this layer multiplies by, in `dtype` (default: the weight's)."""
        return dequantize_parts(self.qweight, self.scales, self.parts, dtype or self.weight.dtype, self.block)

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.qweight, self.scales, self.bias, self.parts, self.block, self.scale)

    def extra_repr(self) -> str:
        n, k = self.qweight.shape
        return f"in={k}, out={n}, parts={self.parts}, scale={self.scale}, block={self.block}"


def quantizable(name: str, module: nn.Module) -> bool:
    """The selection rule: an nn.Linear named one of QUANTIZED (q/k/v/o_proj, gate/up/down_proj:
    attention, dense MLP, shared expert, Qwen-MoE experts) or any nn.Linear under an `experts`
    container (Mixtral's w1/w2/w3). So never the embeddings, norms, `lm_head`, an MoE router
    (`mlp.gate`, `block_sparse_moe.gate`) or `shared_expert_gate`."""
    parts = name.split(".")
    return isinstance(module, nn.Linear) and (parts[-1] in QUANTIZED or "experts" in parts[:-1])


def quantize_model(model: nn.Module, scale: str = "fp32", block: int = 128) -> nn.Module:
    """For the engine, in place: every `quantizable` linear becomes an `Fp8Linear` over the same
    weight and bias parameters -> `model`. Names, shapes and the parameters' storage are unchanged,
    so weight pushes keep copying into them by name; call `requantize(model)` after each push.

    A fused layer (`fuse_projections`: `fused` holding the high-precision q|k|v or gate|up weight)
    is unfused (`fused = None`): the decoder would otherwise multiply by the fused high-precision
    tensor and bypass the fp8 weights. The parameters stay views of the fused storage, harmless.
    Refuses a batch-invariant model, whose forward reads `.weight` directly.
    """
    _check_scale(scale)
    _check_not_batch_invariant(model)
    chosen = [(name, m) for name, m in model.named_modules() if quantizable(name, m)]
    for name, linear in chosen:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, Fp8Linear.from_linear(linear, scale, block))
    for m in model.modules():
        if getattr(m, "fused", None) is not None and any(isinstance(c, Fp8Linear) for c in m.children()):
            m.fused = None
    return model


@torch.no_grad()
def requantize(model: nn.Module) -> int:
    """After a weight push: re-quantise every `Fp8Linear` from its high-precision weight, in place
    -> how many. Refuses a model whose forward would bypass them (batch-invariant, or re-fused)."""
    _check_not_batch_invariant(model)
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for m in model.modules():
        if getattr(m, "fused", None) is not None and any(isinstance(c, Fp8Linear) for c in m.children()):
            raise ValueError(
                f"requantize: {type(m).__name__} was fused again after quantize_model; its forward "
                "would multiply by the high-precision fused weight. Fuse first, then quantize_model."
            )
    for layer in layers:
        layer.requantize()
    return len(layers)


def _check_scale(scale: str) -> None:
    if scale not in SCALE_FORMATS:
        raise ValueError(f"fp8 scale {scale!r} is not supported. Valid scales: {', '.join(SCALE_FORMATS)}.")


def _check_not_batch_invariant(model: nn.Module) -> None:
    if getattr(model, "batch_invariant", False):
        raise ValueError(
            "fp8 weights and the batch-invariant forward do not mix: it multiplies by `.weight`, the "
            "high-precision parameters, so the fp8 copy would be silently bypassed (and the engine "
            "could not match the trainer bit for bit anyway)."
        )


# -- GPU path: torch._scaled_mm on Hopper ---------------------------------------------------------


def _scaled_mm_ok(x: Tensor, q: Tensor, parts: Sequence[int], block: int) -> bool:
    """Blockwise scales in `torch._scaled_mm` (1x128 activations x 128x128 weights, the DeepSeek
    recipe) are a cuBLAS feature of sm90 with CUDA >= 12.9 only; other FP8 GPUs (sm89, sm100) and
    edge blocks (N or K not multiples of 128, or a part that ends mid-block) take the dequantising
    path, in bf16 there. Rowwise `_scaled_mm` would need per-row weight scales: other numbers."""
    if not (x.is_cuda and block == 128 and torch.version.cuda is not None):
        return False
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        return False
    if tuple(int(v) for v in torch.version.cuda.split(".")[:2]) < (12, 9):
        return False
    # K / 128 a multiple of 4: cuBLAS reads the weight scales with their K extent padded to that
    # (L4), while torch 2.11 accepts only the unpadded layout for them, so any other K gives wrong
    # numbers without an error (cosine 0.01-0.5 on an H200; later torch releases check for the
    # padded layout). Qwen2-0.5B's K = 896 and 4864 take the dequantising path; 7B's 3584, 18944 not.
    k_blocks_ok = q.shape[1] % (4 * block) == 0
    return k_blocks_ok and all(p % block == 0 for p in parts)


def quantize_rows(x: Tensor, block: int = 128, scale: str = "fp32") -> tuple[Tensor, Tensor]:
    """x (M, K), K a multiple of `block` -> xq (M, K) fp8, scales (M, K/block) fp32: the activations'
    1 x block quantisation of the GPU path (the same rule as `quantize_blockwise`'s, per row block)."""
    m, k = x.shape
    blocks = x.float().view(m, k // block, block)
    xs = block_scales(blocks.abs().amax(dim=-1), scale)
    return (blocks / xs[..., None]).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8).view(m, k), xs


def _scaled_mm_linear(
    x: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None, block: int, scale: str
) -> Tensor:
    """x (..., K) -> (..., N) in x.dtype: x quantised per 1x128 block (`scale` format), then
    torch._scaled_mm(xq (M, K), q^T (K, N) col-major, scale_a (M, K/128) outer-dim-major,
    scale_b (K/128, N/128) K-major), which dequantises both sides on the fly; bias added after.

    cuBLAS's layout rule for the activations' 1x128 scales (its docs, "1D and 128x128 2D block
    scaling"), found by its failure on an H200 (torch 2.11 + CUDA 13.0): their leading dimension
    (M) must keep 16-byte alignment, so M is padded to a multiple of 4 with zero rows (scale 1,
    output dropped); else CUBLAS_STATUS_NOT_SUPPORTED. The weights' rule is in `_scaled_mm_ok`."""
    rows = x.reshape(-1, x.shape[-1])  # (M, K)
    m = rows.shape[0]
    xq, xs = quantize_rows(F.pad(rows, (0, 0, 0, -m % 4)), block, scale)  # (M4, K), (M4, K/128)
    ws = scales.t()  # (K/128, N/128), K-major; K/128 is a multiple of 4 (see _scaled_mm_ok)
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.bfloat16
    y = torch._scaled_mm(xq, q.t(), scale_a=xs.t().contiguous().t(), scale_b=ws, out_dtype=out_dtype)[:m]
    if bias is not None:
        y = y + bias
    return y.to(x.dtype).view(*x.shape[:-1], q.shape[0])
