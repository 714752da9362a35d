"""Output paths checked before the work that fills them: an unwritable directory fails in seconds."""

import tempfile
from pathlib import Path

from tandem.errors import TandemError


def check_writable(path: Path, key: str) -> None:
    """Make the directory `path` (as the run will) and write a file in it, or raise a TandemError
    naming the path and the config key that set it. A read-only mount, a missing permission or a
    file in the way would otherwise surface at the first save, after the work it was to keep."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".tandem-write-check-") as probe:
            probe.write(b"x")
            probe.flush()
    except OSError as e:
        where = f" at {e.filename}" if e.filename and str(e.filename) != str(path) else ""
        raise TandemError(
            f"Cannot write to {path}, the directory {key} sets: {e.strerror or e}{where}. "
            f"Set {key} to a directory you can write to."
        ) from None
