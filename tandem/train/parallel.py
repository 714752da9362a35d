"""Precision, activation checkpointing and sharding, applied to a plain CausalLM (torchtitan's way).

Each function takes the model and a setting and changes the model in place, or wraps it, in a
fixed order: `apply_ac`, then `apply_fsdp` or `apply_ddp`. The decoder itself stays plain PyTorch.

Precision: the parameters the optimizer steps are fp32 (the master weights), and AdamW's state with
them. Under fsdp2, FSDP2's `MixedPrecisionPolicy` makes each layer's bf16 copy at its all-gather and
reduces gradients in fp32. Otherwise `MasterWeights` keeps a bf16 copy of the whole model for the
forward and backward: gradients are reduced in fp32 (`fp32_all_reduce`), summed into the fp32
masters, and the masters are copied back, rounded once, after each optimizer step. (A whole bf16
copy runs the default step ~20% faster on the CPU than `torch.autocast`, which leaves the residual
stream, norms and element-wise work in fp32.)
"""

import contextlib
import copy
from collections.abc import Iterator
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from tandem.model.decoder import CausalLM
from tandem.sync.bucket import full_tensor


def apply_ac(model: CausalLM) -> None:
    """Each decoder layer keeps only its input for backward and recomputes the rest there."""
    for layer in model.model.layers:
        layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)


def apply_fsdp(model: CausalLM, group, dtype: torch.dtype, offload: str = "none") -> None:
    """fully_shard each decoder layer, then the root (embeddings, final norm, lm_head): every rank
    keeps 1/N of each parameter, its gradient and its optimizer state."""
    # Imported here: torch.distributed.fsdp costs every process that imports tandem.train ~0.9 s.
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    device_type = next(model.parameters()).device.type
    mesh = DeviceMesh.from_group(group, device_type)
    kw = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32
        ),
        # Pinned host memory needs an accelerator; on a CPU-only run the policy moves nothing anyway.
        offload_policy=CPUOffloadPolicy(pin_memory=device_type == "cuda")
        if offload == "optimizer"
        else OffloadPolicy(),
    )
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)


def apply_ddp(model: CausalLM, group) -> DistributedDataParallel:
    """A replica per rank; gradients are averaged over ranks in buckets during backward, in fp32."""
    param = next(model.parameters())
    ids = [param.device.index] if param.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids, process_group=group)
    if param.dtype != torch.float32:
        ddp.register_comm_hook(group, fp32_all_reduce)
    return ddp


class MasterWeights:
    """fp32 master weights of a model that computes in a lower precision.

    `masters` is the fp32 model (the optimizer steps its parameters; weight pushes and checkpoints
    read them); `compute` a copy of it in `dtype` that runs forward and backward. Frozen parameters
    (a LoRA run's base) never step: one that `dtype` holds exactly (a bf16 checkpoint's weight) is
    kept in `dtype` alone, shared by the two models; one that `dtype` would round (an fp32
    checkpoint's) keeps its fp32 master beside the compute copy. So the masters are always the
    checkpoint's base bit for bit: the policy a LoRA run saves, exports and that its engines serve
    (docs/training.md, "Which base the engines serve"), whatever train.dtype and train.strategy are.
    """

    def __init__(self, masters: CausalLM, dtype: torch.dtype):
        self.masters = masters
        shared = [p for p in masters.parameters() if not p.requires_grad and _holds_exactly(p, dtype)]
        for p in shared:
            p.data = p.data.to(dtype)
        self.compute = copy.deepcopy(masters, {id(p): p for p in shared}).to(dtype)
        pairs = zip(masters.parameters(), self.compute.parameters(), strict=True)
        self.pairs = [(master, p) for master, p in pairs if master.requires_grad]

    @torch.no_grad()
    def take_grads(self) -> None:
        """After a backward: add the compute copy's gradients to the masters' in fp32, clear them."""
        for master, p in self.pairs:
            if p.grad is not None:
                if master.grad is None:
                    master.grad = p.grad.float()
                else:
                    master.grad.add_(p.grad)
                p.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """After an optimizer step: the compute copy takes the masters' values, rounded once."""
        for master, p in self.pairs:
            p.copy_(master)


def _holds_exactly(p: Tensor, dtype: torch.dtype) -> bool:
    """Whether casting `p` to `dtype` and back gives `p` bit for bit (no value rounds)."""
    with torch.no_grad():
        return torch.equal(p.to(dtype).to(p.dtype), p)


def fp32_all_reduce(group, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP communication hook: a bucket of low-precision gradients is averaged over the ranks in fp32."""
    buffer = bucket.buffer()
    grads = buffer.float().div_(dist.get_world_size(group))
    work = dist.all_reduce(grads, group=group, async_op=True)
    return work.get_future().then(lambda fut: buffer.copy_(fut.value()[0]))


def gradient_sync(module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Accumulate gradients locally (`enabled=False`) or reduce them over ranks in this backward."""
    if hasattr(module, "set_requires_gradient_sync"):  # an FSDPModule
        module.set_requires_gradient_sync(enabled)
    elif isinstance(module, DistributedDataParallel) and not enabled:
        return module.no_sync()
    return contextlib.nullcontext()


def gather(named: Iterator[tuple[str, Tensor]], device: str = "cpu") -> dict[str, Tensor]:
    """Every tensor whole, one all-gather at a time, on `device` (for checkpoints)."""
    return {n: full_tensor(t).to(device) for n, t in named}
