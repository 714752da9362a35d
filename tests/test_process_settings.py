"""What `import tandem` sets for every process it runs: memory that a run holds stays bounded when
the shapes it computes on keep changing, and threads that wait do not spin. Each check runs in a
fresh interpreter, since the settings act at a process's first matmul."""

import subprocess
import sys
import textwrap

import pytest

# The start of each check: tandem imported, and glibc's malloc counters (mallinfo2) readable
MALLINFO = textwrap.dedent(
    """
    import ctypes
    import tandem, torch

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    """
)

GROWTH = MALLINFO + textwrap.dedent(
    """

    def held():
        m = libc.mallinfo2()
        return m.hblkhd + m.uordblks  # mmapped blocks and heap in use

    w = torch.randn(1536, 576, dtype=torch.bfloat16, requires_grad=True)

    def step(rows):
        x = torch.randn(rows, 576, dtype=torch.bfloat16, requires_grad=True)
        torch.nn.functional.linear(x, w).sum().backward()
        w.grad = None

    for rows in range(64, 96):  # fill the caches
        step(rows)
    before = held()
    for rows in range(100, 356, 2):  # 128 new shapes, as a run's micro-batches bring them
        step(rows)
    print((held() - before) / 1e6)
    """
)


@pytest.mark.integration  # seconds of CPU: out of the unit tier (< 2 minutes)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads glibc's mallinfo2")
def test_bf16_matmuls_of_ever_new_shapes_hold_bounded_memory():
    # oneDNN keeps every bf16 matmul primitive it builds (with its JIT'd kernel) in caches of 1024
    # entries: 128 new shapes held +227 MB (AMD EPYC, AVX512-BF16) before tandem bounded them, and a
    # real model's run grew ~70 MB a step. A CPU without oneDNN's bf16 path holds little either way.
    done = subprocess.run([sys.executable, "-c", GROWTH], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    grown_mb = float(done.stdout.split()[-1])
    assert grown_mb < 50, f"{grown_mb:.0f} MB held after 128 new matmul shapes"


def test_a_setting_the_user_made_is_kept():
    keys = "'ONEDNN_PRIMITIVE_CACHE_CAPACITY', 'OMP_WAIT_POLICY'"
    code = f"import os, tandem; print(*(os.environ[k] for k in ({keys})))"
    env = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "512", "OMP_WAIT_POLICY": "ACTIVE", "PATH": ""}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.split() == ["512", "ACTIVE"], done.stderr


MAPPED = MALLINFO + textwrap.dedent(
    """
    mapped = []
    for mib in (1, 16):
        before = libc.mallinfo2().hblks  # blocks mapped apart from the heap
        x = torch.empty(mib << 20, dtype=torch.uint8)
        mapped.append(libc.mallinfo2().hblks - before)
        del x
    tandem.heap.trim()  # and handing free pages back runs
    print(*mapped)
    """
)


@pytest.mark.integration  # two fresh interpreters: out of the unit tier
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads glibc's mallinfo2")
@pytest.mark.parametrize(
    "environment, mapped", [({}, ["0", "1"]), ({"MALLOC_MMAP_THRESHOLD_": "131072"}, ["1", "1"])]
)
def test_activation_sized_tensors_come_from_the_heap_and_weight_sized_ones_are_mapped(environment, mapped):
    # tandem/heap.py: a 1 MiB tensor (a layer's activations for a micro-batch) from the heap, not
    # mapped and zero-filled afresh each time as under the 128 KiB threshold tandem set before (the
    # train step 1.6x slower); a 16 MiB one mapped; a threshold in the environment is the user's.
    env = {"PATH": "", **environment}
    done = subprocess.run(
        [sys.executable, "-c", MAPPED], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == mapped


REUSED = MALLINFO + textwrap.dedent(
    """
    def step():  # a decode step's (rows, vocabulary) tensor, made and freed again: -> blocks it mapped
        before = libc.mallinfo2().hblks
        x = torch.ones(16 << 20, dtype=torch.uint8)
        mapped = libc.mallinfo2().hblks - before
        del x
        return mapped

    def resident():
        return int(open("/proc/self/statm").read().split()[1]) * 4096

    with tandem.heap.reusing():
        inside = [step(), step()]
        held = libc.mallinfo2().fordblks >= 16 << 20  # freed into the heap, kept for the next step
        before = resident()
    returned = before - resident() >= 15 << 20  # and handed back when the call ends
    print(*inside, int(held), int(returned), step())
    """
)


@pytest.mark.integration  # a fresh interpreter: out of the unit tier
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads glibc's mallinfo2")
def test_a_generate_call_reuses_its_steps_memory_and_hands_it_back_at_its_end():
    # tandem/heap.py `reusing`, around every engine's generate call: a 16 MiB tensor, made and freed
    # each step, comes from the heap and stays there between steps (mapped and zero-filled afresh at
    # every step before: the paged engine ~25% slower at 64 sequences); after the call the heap's
    # free memory is handed back and the threshold is the 4 MiB one again (the last figure: mapped).
    done = subprocess.run(
        [sys.executable, "-c", REUSED], capture_output=True, text=True, env={"PATH": ""}, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "0", "1", "1", "1"]
