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
