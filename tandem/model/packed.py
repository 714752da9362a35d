"""An engine's linear weights packed for the CPU's matmul library once per update, not at every call.

PyTorch's `F.linear` on the CPU hands oneDNN a plain (N, K) weight, which oneDNN copies into its
blocked layout at every call: for a decode step's few rows that copy costs as much as the
multiplication itself. Packed once (`torch.ops.mkldnn._reorder_linear_weight`, what PyTorch's own
inference passes do for a frozen model) and multiplied by `torch.ops.mkldnn._linear_pointwise`, the
decode weights of SmolLM2-135M take 17 ms a step at 8 rows instead of 32 in bf16, 53 instead of 73
at 64, and 25 instead of 60 at 8 rows in fp32 (the decode weights alone, cold, on 2 Zen 4 cores,
2026-11-28; docs/results.md has the engines' tokens/s).

The packed copies sit beside the parameters, which stay what weight pushes copy into by name (and
what the batch-invariant forward and the one-row matrix-vector kernel multiply by): `repack` after
every update, `drop` before the parameters' memory is freed. They cost one more copy of the linear
weights (the tied `lm_head` included). A forward takes them only while oneDNN is on
(`tandem.model.gemv` turns it off for one or two rows, whose kernel reads the plain weights).
"""

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PACKABLE = (torch.bfloat16, torch.float32)


def packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this PyTorch can pack weights of `dtype` on `device`: a CPU build with oneDNN, and for
    bf16 a CPU oneDNN multiplies bf16 on natively (an AVX2-only one would emulate it)."""
    if device.type != "cpu" or dtype not in PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack(weight: Tensor) -> Tensor:
    """weight (N, K) -> the same values in oneDNN's layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


@functools.cache
def same_as_mm(n: int, k: int, dtype: torch.dtype, rows: int, threads: int) -> bool:
    """Whether a (rows, k) x packed (n, k) product equals `torch.mm`'s of the plain weight bit for
    bit here: one random product each way, once per shape and thread count in a process (oneDNN
    then runs one kernel for both; on 2 Zen 4 cores in bf16 it does). The batch-invariant mode's
    engine multiplies by its packed copies only where this holds (`batch_invariant.tiled_mm`), so
    its logits stay the trainer's, which multiplies plain weights."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    return torch.equal(torch.mm(x, weight.t()), multiply(x, pack(weight)))


def multiply(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., K) @ the packed weight's transpose (+ bias)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, packed: Tensor | None) -> Tensor:
    """`F.linear(x, weight, bias)`, multiplied by `packed` (the same weight, `pack`ed) when there is
    one and oneDNN is on."""
    if packed is not None and torch.backends.mkldnn.enabled:
        return multiply(x, packed, bias)
    return F.linear(x, weight, bias)


class PackedLinear(nn.Linear):
    """An `nn.Linear` over another one's parameters (the same objects: names, ties and fused views
    stay) whose forward multiplies by `packed` when set."""

    packed: Tensor | None

    @classmethod
    def from_linear(cls, source: nn.Linear) -> "PackedLinear":
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = source.in_features, source.out_features
        module.weight, module.bias = source.weight, source.bias
        module.packed = None
        return module

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.packed)


def pack_model(model: nn.Module) -> nn.Module:
    """For an engine, in place: every layer's fused q|k|v and gate|up weight (`fuse_projections`),
    `o_proj`, a dense MLP's `down_proj` and `lm_head` get a packed copy -> `model`. Experts, routers
    and unfused projections stay as they are."""
    model.lm_head = PackedLinear.from_linear(model.lm_head)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = PackedLinear.from_linear(attn.o_proj)
        if getattr(mlp, "fused", None) is not None:
            mlp.down_proj = PackedLinear.from_linear(mlp.down_proj)
    repack(model)
    return model


@torch.no_grad()
def repack(model: nn.Module) -> None:
    """After an update: every packed copy made again from the weights it copies."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.packed = pack(module.weight)
        elif getattr(module, "fused", None) is not None:
            module.packed = pack(module.fused[0])


def drop(model: nn.Module) -> None:
    """Free the packed copies (before the parameters sleep); `repack` makes them again."""
    for module in model.modules():
        if hasattr(module, "packed"):
            module.packed = None


def packed_bytes(model: nn.Module) -> int:
    """Bytes the packed copies hold now (0 dropped or never packed)."""
    copies = [getattr(m, "packed", None) for m in model.modules()]
    return sum(t.numel() * t.element_size() for t in copies if t is not None)
