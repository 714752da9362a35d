"""Shared pytest setup."""

import os
import sys

# Test helper modules (e.g. reward_fns_example) are imported by dotted name, also inside worker
# processes, which inherit sys.path; --import-mode=importlib would not add tests/ by itself.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import pytest  # noqa: E402


def machine_line() -> str:
    """The machine the suite ran on (CI runs on whichever CPU the submitting session had): the CPU,
    its bf16 support, and what train.dtype=auto resolves to, so a failure that depends on the CPU is
    read beside the CPU."""
    import torch

    from tandem.determinism import machine
    from tandem.devices import cpu_flags, cpu_has_native_bf16, resolve
    from tandem.runtime.startup import load_config

    native = cpu_has_native_bf16()
    flags = cpu_flags()
    isa = "+".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags) or "unknown ISA"
    auto = resolve(load_config(None, []), torch.cuda.device_count(), "this machine").train.dtype
    return (
        f"tandem: CPU {machine('cpu')} ({isa}; PyTorch's kernels {torch.backends.cpu.get_cpu_capability()}), "
        f"{os.cpu_count()} cores, native bf16 {'yes' if native else 'no'}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads); train.dtype=auto -> {auto}"
    )


def pytest_report_header(config: pytest.Config) -> str:
    return machine_line()


def pytest_terminal_summary(terminalreporter) -> None:
    """The machine again beside the results (the header is not printed under -q, the suite's default)."""
    terminalreporter.write_line(machine_line())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked gpu where torch sees no CUDA device; refuse a test that uses the local
    Ray without the ray marker (it would slip into the unit tier, -m "not slow and not ray")."""
    unmarked = [
        item.nodeid
        for item in items
        if "ray_local" in getattr(item, "fixturenames", ()) and item.get_closest_marker("ray") is None
    ]
    if unmarked:
        raise pytest.UsageError("these tests use ray_local but are not marked ray: " + ", ".join(unmarked))
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA device, and torch sees none")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the tests that need it (`helpers.local_ray`)."""
    from helpers import local_ray

    ray = local_ray()
    yield ray
    ray.shutdown()
