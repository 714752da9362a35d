"""Shared pytest setup."""

import os
import sys

# Test helper modules (e.g. reward_fns_example) are imported by dotted name, also inside worker
# processes, which inherit sys.path; --import-mode=importlib would not add tests/ by itself.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)
