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


from tandem import heap  # noqa: E402  (after the variables above: it imports no torch)

heap.bound()  # glibc's mmap threshold, fixed: tandem/heap.py
