"""tandem: asynchronous RL post-training for language models."""

import os

__version__ = "0.1.0"

# Every process tandem runs (the CLI's, Ray's workers, the reward pool's), before torch starts its
# OpenMP runtime: a thread that waits for its team sleeps instead of spinning (libgomp's default),
# which burns the core that the thread it waits for, or another process, needs. Beside one busy
# process on two cores, a one-process countdown eval took 377 s spinning and 24 s passive (an Intel
# Xeon, 2 cores), and a 10-step default run on Ray 2.8x its idle time against 1.57x (docs/results.md).
# Set to ACTIVE (or anything) before tandem is imported to keep another choice.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# oneDNN (torch's bf16 matmuls on a CPU) keeps every matmul primitive it builds, with its JIT'd
# kernel (~0.26 MB), in two caches of 1024 entries each: oneDNN's own and ideep's. A training step
# meets new shapes in every micro-batch (its packed token count), so on SmolLM2-135M's recipe the
# process grew ~70 MB a step until the caches were full, ~1 GB over 20 steps (AMD EPYC,
# AVX512-BF16). 64 entries hold every shape of one micro-batch's forward and backward, or of an
# engine's few decode widths; a shape met again later is rebuilt (a millisecond or so). Read at the
# first primitive, so this holds when tandem is imported before any bf16 matmul runs; set either
# variable to keep another size.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
os.environ.setdefault("LRU_CACHE_CAPACITY", "64")


def _bounded_heap() -> None:
    """glibc's malloc serves a request of under M_MMAP_THRESHOLD bytes from its heap, and raises that
    threshold (up to 32 MiB) each time a larger block is freed. A training step frees tensors of
    every size, so after the first the heap serves them all and fragments: freed memory stays in
    the process. Measured on SmolLM2-135M-Instruct's recipe (5 steps, AMD EPYC): peak 7.27 GB with
    the moving threshold, 6.24 GB with it fixed at 128 KiB. Fixed here, once, for every process
    tandem runs (what MALLOC_MMAP_THRESHOLD_=131072 in the environment does); not glibc: nothing."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux") or os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # musl and others: no mallopt, their own policy
        pass


_bounded_heap()
