"""AdamW and its learning-rate schedule: linear warmup, then one of SCHEDULES (constant, linear or
cosine decay toward `min_ratio` of the base LR)."""

import math
from collections.abc import Callable

import torch
from torch import nn

from tandem.registry import Registry

# progress in [0, 1] after warmup, min_ratio -> the multiplier of the base LR
ScheduleFn = Callable[[float, float], float]
SCHEDULES: Registry[ScheduleFn] = Registry("LR schedule")


@SCHEDULES.register("constant")
def constant(progress: float, min_ratio: float) -> float:
    """1 throughout: min_ratio is never approached."""
    return 1.0


@SCHEDULES.register("linear")
def linear(progress: float, min_ratio: float) -> float:
    """min_ratio + (1 - min_ratio) · (1 - progress)."""
    return min_ratio + (1.0 - min_ratio) * (1.0 - progress)


@SCHEDULES.register("cosine")
def cosine(progress: float, min_ratio: float) -> float:
    """min_ratio + (1 - min_ratio) · (1 + cos(π · progress)) / 2."""
    return min_ratio + (1.0 - min_ratio) * (0.5 * (1.0 + math.cos(math.pi * progress)))


def make_optimizer(model: nn.Module, lr: float, betas: list[float], weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the parameters that train, in PyTorch's fused kernel (one pass over each tensor)
    where every parameter is a plain tensor, else (FSDP2's DTensor shards) its foreach kernels. The
    default per-tensor loop makes ~8 passes: 0.58 s of a 10 s train step of SmolLM2-135M on 2 Zen 4
    cores, where the fused step takes ~0.1 s. The updates agree to float rounding (~1 ulp)."""
    params = [p for p in model.parameters() if p.requires_grad]
    plain = all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda") for p in params)
    kernel = {"fused": True} if plain and params else {"foreach": True}
    return torch.optim.AdamW(params, lr=lr, betas=(betas[0], betas[1]), weight_decay=weight_decay, **kernel)


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the base LR at optimizer step `step` (0-based). TandemError for a schedule not in
    SCHEDULES (its message lists them)."""
    decay = SCHEDULES.get(schedule)
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if total <= warmup:
        return 1.0
    return decay(min((step - warmup) / max(total - warmup, 1), 1.0), min_ratio)


def make_scheduler(
    optimizer: torch.optim.Optimizer, warmup: int, total: int, schedule: str, min_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    SCHEDULES.get(schedule)  # an unknown name fails here, not at the first step past warmup
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup, total, schedule, min_ratio)
    )
