"""Output paths checked before the work that fills them: an unwritable directory fails in seconds,
and a directory another run is writing into is refused at once."""

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX (Windows): no flock
    fcntl = None

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


LOCK = "run.lock"


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `run_dir/run.lock` (which records the holder's pid) while the
    block runs, or raise a TandemError at once when another process holds it: two runs writing one
    directory would interleave their metrics and checkpoints. The OS releases the lock when its
    holder exits, however it exits (SIGKILL included), so a crash never leaves it stuck; the file
    stays. Without fcntl (Windows) nothing is locked: keeping one run per directory is then the
    user's to do."""
    if fcntl is None:
        yield
        return
    path = run_dir / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
            raise TandemError(
                f"Another run is using {run_dir} ({f'pid {pid} holds ' if pid.isdigit() else ''}{path}); "
                "two runs in one directory would interleave their metrics and checkpoints. Wait for it "
                "to end or stop it, or give this run another run.name or run.out_dir."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def fsync(path: Path) -> None:
    """Flush a file's or a directory's entry to disk (a directory: so a rename in it survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(tmp: Path, final: Path, old: Path) -> None:
    """`tmp`, every file in it fsynced, renamed to `final`: a directory already there is renamed to
    `old` first, and deleted only once the new one is in place and that rename is on disk. A crash
    between any two steps leaves a whole directory at `final` or at `old` (the caller's clean-up
    finishes or undoes it)."""
    for path in sorted(tmp.rglob("*"), reverse=True):  # files before the directories holding them
        fsync(path)
    fsync(tmp)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        fsync(final.parent)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    fsync(final.parent)
