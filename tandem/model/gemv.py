"""Which library multiplies a decode step's one or two rows by a bf16 weight on this CPU.

PyTorch sends a bf16 matmul on the CPU to oneDNN, whose kernel for one row streams the weights at
~12 GB/s on 2 Zen 4 cores; PyTorch's own reduced-precision matrix-vector kernel (taken with oneDNN
off) streams them at ~23 GB/s, twice as fast, but loses from 4 rows on (measured 2026-11-28, the
decode weights of SmolLM2-135M, cold: 11.6 ms against 22 ms a step at 1 row, 15 against 22 at 2,
29 against 24 at 4). A CPU is not the next one, so the choice is measured once per process
(`native_gemv_faster`), not assumed, and the engines ask `gemv_backend` before each forward.
"""

import functools
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.nn.functional as F

GEMV_ROWS = 2  # at most this many rows a forward: a matrix-vector product, not a matrix product


def gemv_backend(rows: int, dtype: torch.dtype, device: torch.device) -> AbstractContextManager:
    """The context a forward of `rows` token rows runs in: oneDNN off for a bf16 or fp16 forward of
    at most GEMV_ROWS rows on a CPU where PyTorch's own kernel is the faster, else nothing. Not for
    the batch-invariant forward, whose matmuls must keep one kernel whatever the batch."""
    if rows > GEMV_ROWS or device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return nullcontext()
    if not native_gemv_faster(dtype):
        return nullcontext()
    return onednn(False)


@contextmanager
def onednn(enabled: bool) -> Iterator[None]:
    """Within the block PyTorch sends matmuls to oneDNN or not; nothing else of its settings changes
    (`torch.backends.mkldnn.flags` would also reset its tf32 and determinism flags)."""
    saved = torch.backends.mkldnn.set_flags(enabled, _fp32_precision=None)[0]
    try:
        yield
    finally:
        torch.backends.mkldnn.set_flags(saved, _fp32_precision=None)


@functools.cache
def native_gemv_faster(dtype: torch.dtype) -> bool:
    """Whether PyTorch's own kernel multiplies one row by six weights of 8 MB (48 MB: past the
    caches, as a model's weights are when a step streams them) faster than oneDNN here: the best of
    3 runs each way, once per process (0.2 s on 2 Zen 4 cores, mostly filling the weights)."""
    weights = [torch.full((2048, 2048), 0.01, dtype=dtype) for _ in range(6)]
    x = torch.full((1, 2048), 0.5, dtype=dtype)

    def best(enabled: bool) -> float:
        times = []
        with onednn(enabled):
            for _ in range(3):
                start = time.perf_counter()
                for w in weights:
                    F.linear(x, w)
                times.append(time.perf_counter() - start)
        return min(times)

    best(True), best(False)  # warm both
    return best(False) < best(True)
