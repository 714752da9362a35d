"""`tandem` as a user runs it, with methods that raise a BaseException the first time they are
called (`helpers.Crash`: neither an Exception nor a stop request, as torch's CheckpointException
from a damaged load or a save on a full disk), then run as they are:

    python tests/crash_once.py MODULE:CLASS.METHOD[,MODULE:CLASS.METHOD...] TANDEM-ARGUMENTS...

e.g. `python tests/crash_once.py tandem.serve.workers:ServeTrainer.save serve --port 8001`.
"""

import os
import pkgutil
import sys

# As `tandem serve` sets it before torch is imported (the helpers import torch).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from helpers import Crash  # noqa: E402  (this file's folder is on sys.path: python runs it)


def crash_once(target: str) -> None:
    """Replace MODULE:CLASS.METHOD with one that raises Crash naming it on its first call."""
    owner_name, method = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_name)
    real = getattr(owner, method)
    calls = 0

    def once(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise Crash(f"{target}, first call")
        return real(*args, **kwargs)

    setattr(owner, method, once)


if __name__ == "__main__":
    for target in sys.argv[1].split(","):
        crash_once(target)
    from tandem.cli.main import main

    sys.exit(main(sys.argv[2:]))
