"""glibc's heap in every process tandem runs: which tensors it serves, and when it hands freed
memory back.

glibc's malloc serves a request under M_MMAP_THRESHOLD bytes from its heap and maps anything
larger afresh, unmapping it again when it is freed. By default it raises that threshold (up to 32
MiB) each time a larger block is freed, so after a training step's first micro-batch the heap
serves tensors of every size and fragments: freed memory stays in the process (SmolLM2-135M's
recipe, 5 steps: peak 7.27 GB with the moving threshold, 6.24 GB with it fixed at 128 KiB, AMD
EPYC). A threshold that low costs time instead: every tensor over 128 KiB (a layer's activations
for a micro-batch, its gradients) is mapped, zero-filled page by page on first touch, and unmapped,
over and over. One train step of the recipe's batch took 9.7 s at 128 KiB, 6.0 s at 4 MiB and the
same at 32 MiB (AMD EPYC, Zen 4, bf16; `bench/train_step.py`'s batch).

So `bound()` fixes the threshold at `THRESHOLD` (4 MiB: every activation- and gradient-sized tensor
of a small model from the heap, weight-sized ones and the logits mapped), and `trim()`, called
after each generate call and each train step, hands the heap's free pages back (glibc's
`malloc_trim`: tens of milliseconds), so what one phase leaves in holes does not stay beside the
next. The recipe's first 4 steps peak at 4.93 GB in bf16 and 4.94 GB in fp32 this way, against
4.71 / 4.40 at 128 KiB, and 5.11 / 5.11 at 4 MiB with a trim after generate calls alone; the train
step took 5.9 s with its trim and without (same machine). Not glibc (musl, macOS): nothing;
MALLOC_MMAP_THRESHOLD_ in the environment keeps the user's own threshold.
"""

import ctypes
import ctypes.util
import os
import sys

THRESHOLD = 4 * 2**20
M_MMAP_THRESHOLD = -3  # mallopt's parameter number


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


def bound() -> None:
    """Fix glibc's mmap threshold at THRESHOLD, unless MALLOC_MMAP_THRESHOLD_ chose another."""
    if _LIBC is not None and not os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        _LIBC.mallopt(M_MMAP_THRESHOLD, THRESHOLD)


def trim() -> None:
    """Hand the heap's free pages back to the system (after a phase that freed its working set)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
