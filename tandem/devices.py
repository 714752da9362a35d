"""Which device and dtypes a run uses: `run.device`, `train.dtype` and `rollout.dtype` made concrete
once, in the driver, before any actor starts (so every role agrees, and bad input fails in seconds).
"""

import os
from dataclasses import replace
from pathlib import Path

import torch

from tandem.config import Config
from tandem.errors import TandemError


def cpu_flags() -> set[str]:
    """The flags /proc/cpuinfo lists (none where there is no such file)."""
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


# oneDNN's instruction sets without bf16 dot products, as ONEDNN_MAX_CPU_ISA names them
NO_BF16_ISAS = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


def cpu_has_native_bf16() -> bool:
    """True on x86 CPUs with AVX512-BF16 or AMX-BF16, where a bf16 matmul runs ~4x an fp32 one,
    unless this process holds PyTorch's kernels below AVX-512 (ATEN_CPU_CAPABILITY=avx2) or oneDNN's
    below its bf16 instructions (ONEDNN_MAX_CPU_ISA): there bf16 is emulated, as on a CPU without
    it, and such a process is how an AVX2-only CPU is tried on a newer one (docs/training.md)."""
    flags = cpu_flags()
    if "avx512_bf16" not in flags and "amx_bf16" not in flags:
        return False
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL"
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and onednn.upper() not in NO_BF16_ISAS


def resolve(cfg: Config, gpus: float, where: str = "the Ray cluster") -> Config:
    """cfg with run.device, train.dtype and rollout.dtype concrete; `gpus`: what `where` (the Ray
    cluster, or this machine for a run in one process) has.

    auto device: cuda when there are GPUs. auto train dtype: bfloat16 on cuda and on a CPU with
    native bf16 matmuls (it learns the default task as well as fp32: docs/training.md), else
    float32. auto rollout dtype: the train dtype, so the engine samples what the trainer computes.
    auto rollout.free_memory_during_train: on for a sync run on cuda whose engines share the
    trainers' GPUs, where the trainer needs the memory the engine holds.
    """
    device = cfg.run.device
    if device == "auto":
        device = "cuda" if gpus > 0 else "cpu"
    if device == "cuda" and gpus <= 0:
        raise TandemError(
            f"Config 'run.device' is 'cuda', but {where} has no GPU (torch sees "
            f"{torch.cuda.device_count()} here). Use run.device=cpu (or auto), or start Ray on a "
            "machine with GPUs (ray start --head, then ray.address=auto)."
        )
    train = cfg.train.dtype
    if train == "auto":
        train = "bfloat16" if device == "cuda" or cpu_has_native_bf16() else "float32"
    rollout = cfg.rollout.dtype if cfg.rollout.dtype != "auto" else train
    free = cfg.rollout.free_memory_during_train
    if free is None:
        free = device == "cuda" and cfg.run.mode == "sync" and shares_gpus(cfg)
    if device == "cuda" and torch.cuda.is_available():  # this process sees a GPU: check it now
        for dtype in {train, rollout}:
            check_runnable(device, dtype)
    return replace(
        cfg,
        run=replace(cfg.run, device=device),
        train=replace(cfg.train, dtype=train),
        rollout=replace(cfg.rollout, dtype=rollout, free_memory_during_train=free),
    )


def shares_gpus(cfg: Config) -> bool:
    """Rollout workers and train workers are placed on the same GPUs: no task groups (everything
    colocated), or one group holding both."""
    groups = [[g] if isinstance(g, str) else g for g in cfg.placement.groups]
    return not groups or any("generate" in g and "actor_train" in g for g in groups)


def check_runnable(device: str, dtype: str) -> torch.device:
    """In the process that computes: the device exists and runs the dtype -> torch.device."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise TandemError(
                "run.device=cuda, but this process sees no CUDA device (a Ray worker without a GPU, "
                "or a CPU-only PyTorch build)."
            )
        if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
            raise TandemError(
                f"{torch.cuda.get_device_name()} has no bfloat16 support (it needs compute capability "
                "8.0, Ampere, or newer): set train.dtype=float32 and rollout.dtype=float16 or float32."
            )
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
