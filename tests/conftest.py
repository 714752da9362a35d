"""Shared pytest setup."""

import os
import sys

# Test helper modules (e.g. reward_fns_example) are imported by dotted name, also inside worker
# processes, which inherit sys.path; --import-mode=importlib would not add tests/ by itself.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the tests that need it (4 logical CPUs, so split placements fit on 2 cores)."""
    import ray

    if not ray.is_initialized():
        env = {"PYTHONPATH": os.pathsep.join([_TESTS_DIR, os.getcwd()])}
        ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", runtime_env={"env_vars": env})
    yield ray
    ray.shutdown()
