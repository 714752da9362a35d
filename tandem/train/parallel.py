"""Precision, activation checkpointing and sharding, applied to a plain CausalLM (torchtitan's way).

Each function takes the model and a setting and changes the model in place, or wraps it, in a
fixed order: `apply_ac`, then `apply_fsdp` or `apply_ddp`. The decoder itself stays plain PyTorch.

Precision: the parameters are fp32 (the master weights) and AdamW's state with them. The compute
dtype is applied by FSDP2's `MixedPrecisionPolicy` under fsdp2 (bf16 copies made at all-gather,
gradients reduced in fp32) and by `torch.autocast` otherwise (bf16 matmuls, fp32 `.grad`).
"""

import contextlib
from collections.abc import Iterator
from functools import partial

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from tandem.model import CausalLM
from tandem.sync.bucket import full_tensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def apply_ac(model: CausalLM) -> None:
    """Each decoder layer keeps only its input for backward and recomputes the rest there."""
    for layer in model.model.layers:
        layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)


def apply_fsdp(model: CausalLM, group, dtype: torch.dtype, offload: str = "none") -> None:
    """fully_shard each decoder layer, then the root (embeddings, final norm, lm_head): every rank
    keeps 1/N of each parameter, its gradient and its optimizer state."""
    device_type = next(model.parameters()).device.type
    mesh = DeviceMesh.from_group(group, device_type)
    kw = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32
        ),
        offload_policy=CPUOffloadPolicy() if offload == "optimizer" else OffloadPolicy(),
    )
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)


def apply_ddp(model: CausalLM, group) -> DistributedDataParallel:
    """A replica per rank; gradients are averaged over ranks in buckets during backward."""
    device = next(model.parameters()).device
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, process_group=group)


def precision(device: torch.device, dtype: torch.dtype, sharded: bool) -> contextlib.AbstractContextManager:
    """The forward's precision context: autocast to `dtype`, unless FSDP2's policy casts already."""
    if sharded or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def gradient_sync(module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Accumulate gradients locally (`enabled=False`) or reduce them over ranks in this backward."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)
    elif isinstance(module, DistributedDataParallel) and not enabled:
        return module.no_sync()
    return contextlib.nullcontext()


def gather(named: Iterator[tuple[str, Tensor]], device: str = "cpu") -> dict[str, Tensor]:
    """Every tensor whole, one all-gather at a time, on `device` (for checkpoints)."""
    return {n: full_tensor(t).to(device) for n, t in named}
