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
next. A generate call runs under `reusing()`: a decode step makes and frees the same tensors as
the last (the logits, the paged engine's gathered KV blocks), so there both thresholds are raised
and the step reuses the heap, trimmed at the call's end. With the built-in engine the recipe's
first 4 steps peaked at 4.93 GB in bf16 and 4.94 GB in fp32 this way, against 4.71 / 4.40 at 128
KiB, and 5.11 / 5.11 at 4 MiB with a trim after generate calls alone; the train step took 5.9 s
with its trim and without (same machine). Not glibc (musl, macOS): nothing; MALLOC_MMAP_THRESHOLD_
or MALLOC_TRIM_THRESHOLD_ in the environment keeps the user's own thresholds.
"""

import ctypes
import ctypes.util
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

THRESHOLD = 4 * 2**20
# While an engine generates (`reusing`): what a decode step allocates and frees again, its (rows,
# vocabulary) logits and probabilities and the paged engine's gathered KV blocks, stays in the heap
GENERATE_THRESHOLD = 256 * 2**20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers
DEFAULT_TRIM = 128 * 2**10  # glibc's M_TRIM_THRESHOLD, which a fixed mmap threshold leaves fixed


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


_lock = threading.Lock()
_generating = 0  # `reusing` blocks open in this process


def _ours() -> bool:
    """Whether tandem sets the thresholds: glibc, and none chosen in the environment."""
    chosen = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    return _LIBC is not None and not any(os.environ.get(name) for name in chosen)


def bound() -> None:
    """Fix glibc's mmap threshold at THRESHOLD, unless the environment chose one."""
    if _ours():
        _LIBC.mallopt(M_MMAP_THRESHOLD, THRESHOLD)


@contextmanager
def reusing() -> Iterator[None]:
    """Within the block (an engine's generate call), tensors up to GENERATE_THRESHOLD come from the
    heap and the heap keeps what is freed at its top (glibc's trim threshold, else 128 KiB, raised
    with it): a decode step's tensors reuse the last step's memory instead of being mapped and
    zero-filled afresh. The paged engine decoding 64 sequences of SmolLM2-135M: ~350 -> ~480
    tokens/s (one process, alternating, 2 Zen 4 cores). At the block's end both thresholds are
    back and the heap trimmed (the last of several threads' blocks to end does it)."""
    global _generating
    if not _ours():
        yield
        return
    with _lock:
        _generating += 1
        if _generating == 1:
            _LIBC.mallopt(M_MMAP_THRESHOLD, GENERATE_THRESHOLD)
            _LIBC.mallopt(M_TRIM_THRESHOLD, 2 * GENERATE_THRESHOLD)
    try:
        yield
    finally:
        with _lock:
            _generating -= 1
            if _generating == 0:
                _LIBC.mallopt(M_MMAP_THRESHOLD, THRESHOLD)
                _LIBC.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM)
                trim()


def trim() -> None:
    """Hand the heap's free pages back to the system (after a phase that freed its working set)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
