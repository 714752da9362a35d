"""AdamW and its learning-rate schedule: linear warmup, then constant, linear or cosine decay."""

import math

import torch
from torch import nn


def make_optimizer(model: nn.Module, lr: float, betas: list[float], weight_decay: float) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=(betas[0], betas[1]), weight_decay=weight_decay)


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the base LR at optimizer step `step` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    if schedule == "linear":
        decay = 1.0 - progress
    else:  # cosine
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


def make_scheduler(
    optimizer: torch.optim.Optimizer, warmup: int, total: int, schedule: str, min_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup, total, schedule, min_ratio)
    )
