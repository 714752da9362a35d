"""`run_python`: runs a Python program in a fresh, limited subprocess and returns its output.

Used by the code reward (`reward.fn=code`) and by agents' Python tool. Each call gets:

- a fresh interpreter, `sys.executable -I -X utf8` (isolated mode: no PYTHON* variables, no user
  site-packages, no script directory on `sys.path`), in its own session and process group;
- a fresh temporary directory as its working directory and HOME, removed after the call;
- a minimal environment: PATH, HOME, LANG=C.UTF-8, and one thread for OpenMP / BLAS;
- wall time `timeout_s`, measured from the start: then the whole process group is killed
  (SIGKILL) and `returncode` is None. Stray processes left behind by a program that exited in
  time are killed too. On Linux the child also dies with the process that started it
  (PR_SET_PDEATHSIG), e.g. a reward worker killed by its pool's timeout;
- resource limits, set in the child before exec: RLIMIT_AS = `memory_mb` MiB of address space
  (an allocation beyond it raises MemoryError), RLIMIT_CPU = ceil(`timeout_s`) + 1 CPU seconds
  (SIGKILL a second later), RLIMIT_FSIZE = 16 MiB per written file, RLIMIT_CORE = 0;
- stdout and stderr each cut to their first `max_output_bytes` bytes (read as they come, so a
  chatty program neither blocks on a full pipe nor fills memory), decoded as UTF-8, no marker;
- no network, by the first of these that works:
  1. a new network namespace (`unshare(CLONE_NEWNET)`, or `CLONE_NEWUSER | CLONE_NEWNET` where
     unprivileged user namespaces are enabled): only a loopback device that is down, so every
     connection fails with "Network is unreachable" and every DNS lookup fails;
  2. otherwise, an audit hook (`sys.addaudithook`, which the program cannot remove) installed
     before the program runs: it refuses non-Unix sockets, connect/bind/sendto to network
     addresses, name lookups, and starting other programs (os.system, exec, spawn,
     subprocess), since those would run without the hook. The refusal is a PermissionError.
  `network_isolation()` says which one this machine gets.

This is a guard against accidents and runaway code (a loop that never ends, a list that eats all
memory, a test that reaches for the network), not a security boundary against a determined
attacker: the program runs as the same user, can read and write whatever that user can, and under the
audit-hook fallback can reach the network through ctypes. It needs a POSIX system; elsewhere
`run_python` raises TandemError rather than run a program without limits. It does not limit the
number of processes: a fork bomb runs until the timeout kills its group.
"""

import ctypes
import functools
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from tandem.errors import TandemError

try:
    import resource
except ImportError:  # Windows
    resource = None

_FSIZE_BYTES = 16 << 20
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
# Tried in order in the child; the first that unshare(2) accepts gives it a network namespace.
_NETNS_FLAGS: tuple[int, ...] = (_CLONE_NEWNET, _CLONE_NEWUSER | _CLONE_NEWNET)
_PR_SET_PDEATHSIG = 1
_PROGRAM = "main.py"

# Runs in the child as its __main__ module: installs the audit hook if the child shares the
# parent's network namespace (argv[1] is the parent's namespace inode, -1 = unknown), then runs
# the program (argv[2]) in this same module, as `python main.py` would. The hook keeps its sets in
# a closure, out of the program's reach through __main__'s globals.
_BOOTSTRAP = """\
def _prepare():
    import os, socket, sys
    parent_netns, program = int(sys.argv[1]), sys.argv[2]
    try:
        own_netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        own_netns = -1
    if parent_netns < 0 or own_netns == parent_netns:
        lookups = {"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex",
                   "socket.gethostbyaddr", "socket.getnameinfo"}
        spawns = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen"}
        sends = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}
        unix = getattr(socket, "AF_UNIX", None)
        def refuse(event, args):
            if event in spawns:
                raise PermissionError(f"{event} is refused: the tandem sandbox runs no other programs")
            if (
                event in lookups
                or (event == "socket.__new__" and args[1] != unix)
                or (event in sends and getattr(args[0], "family", None) != unix)
            ):
                raise PermissionError(f"{event} is refused: the tandem sandbox has no network")
        sys.addaudithook(refuse)
    sys.argv = [program]
    globals()["__file__"] = program
    with open(program, encoding="utf-8") as f:
        return compile(f.read(), program, "exec")
exec(_prepare())
"""


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None  # None when killed for time
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def run_python(
    code: str,
    stdin: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 65536,
) -> SandboxResult:
    """Run `code` as `__main__` in a sandboxed interpreter (see the module docstring) with `stdin`.

    Raises TandemError where no sandbox can be made (no `resource` module) or its child cannot
    start; a program that fails, crashes or runs out of time is a result, not an exception.
    """
    if resource is None:
        raise TandemError(
            f"The Python sandbox needs a POSIX system (the resource module) and this is {sys.platform}: "
            "it will not run code without its limits."
        )
    if not timeout_s > 0 or memory_mb < 1 or max_output_bytes < 0:
        raise ValueError(
            f"run_python: timeout_s={timeout_s}, memory_mb={memory_mb}, max_output_bytes="
            f"{max_output_bytes}; need timeout_s > 0, memory_mb >= 1, max_output_bytes >= 0"
        )
    workdir = tempfile.mkdtemp(prefix="tandem-sandbox-")
    try:
        with open(os.path.join(workdir, _PROGRAM), "w", encoding="utf-8") as f:
            f.write(code)
        with open(os.path.join(workdir, "stdin.txt"), "w+", encoding="utf-8") as stdin_file:
            stdin_file.write(stdin)
            stdin_file.seek(0)
            return _run(workdir, stdin_file, timeout_s, memory_mb, max_output_bytes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(workdir: str, stdin_file: IO[str], timeout_s: float, memory_mb: int, cap: int) -> SandboxResult:
    argv = [sys.executable, "-I", "-X", "utf8", "-c", _BOOTSTRAP, str(_own_netns()), _PROGRAM]
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    try:
        proc = subprocess.Popen(
            argv,
            stdin=stdin_file,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=env,
            start_new_session=True,
            preexec_fn=_child_setup(timeout_s, memory_mb),
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise TandemError(f"The Python sandbox could not start its child process: {e}") from e
    deadline = time.monotonic() + timeout_s
    try:
        stdout, stderr, finished = _read(proc, deadline, cap)
        if finished:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                finished = False
    finally:
        _kill_group(proc.pid)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return SandboxResult(
        stdout=stdout.decode("utf-8", errors="replace"),
        stderr=stderr.decode("utf-8", errors="replace"),
        returncode=proc.returncode if finished else None,
        timed_out=not finished,
    )


def _read(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, bool]:
    """Read stdout and stderr until both close or the deadline: (first `cap` bytes of each, closed)."""
    out, err = proc.stdout.fileno(), proc.stderr.fileno()
    kept = {out: bytearray(), err: bytearray()}
    with selectors.DefaultSelector() as selector:
        for fd in kept:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(kept[out]), bytes(kept[err]), False
            for key, _ in selector.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                kept[key.fd] += chunk[: max(0, cap - len(kept[key.fd]))]  # the rest is read and dropped
    return bytes(kept[out]), bytes(kept[err]), True


def _child_setup(timeout_s: float, memory_mb: int) -> Callable[[], None]:
    """The function subprocess runs in the child between fork and exec.

    Everything it needs is computed here, in the parent: the child of a threaded process may only
    make system calls, not import or load libraries.
    """
    cpu_s = math.ceil(timeout_s) + 1  # SIGXCPU at the soft limit, SIGKILL a second later
    settings = [
        _clamped(resource.RLIMIT_AS, memory_mb << 20, memory_mb << 20),
        _clamped(resource.RLIMIT_CPU, cpu_s, cpu_s + 1),
        _clamped(resource.RLIMIT_FSIZE, _FSIZE_BYTES, _FSIZE_BYTES),
        _clamped(resource.RLIMIT_CORE, 0, 0),
    ]
    libc = _libc()
    parent = os.getpid()

    def setup() -> None:
        for which, pair in settings:
            resource.setrlimit(which, pair)
        if libc is not None:
            for flags in _NETNS_FLAGS:
                if libc.unshare(flags) == 0:
                    break
            # After unshare: a change of credentials clears the parent-death signal.
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)

    return setup


def die_with_parent() -> None:
    """This process gets SIGKILL when its parent dies (Linux; elsewhere nothing): a reward pool's
    fork server and workers must not outlive the reward actor that Ray kills at a run's end."""
    libc = _libc()
    if libc is not None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _clamped(which: int, soft: int, hard: int) -> tuple[int, tuple[int, int]]:
    """(which, (soft, hard)) lowered to the inherited hard limit: raising it would fail in the
    child, where the reason is lost."""
    inherited = resource.getrlimit(which)[1]
    if inherited != resource.RLIM_INFINITY:
        soft, hard = min(soft, inherited), min(hard, inherited)
    return which, (soft, hard)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, for unshare(2) and prctl(2) (Linux); None where it lacks them."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.unshare, libc.prctl  # noqa: B018  # both present, or None
    except (OSError, AttributeError):
        return None
    return libc


@functools.cache
def _own_netns() -> int:
    """This process's network namespace inode; -1 where there is no /proc (the hook then always runs)."""
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return -1


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


@functools.cache
def network_isolation() -> str:
    """ "namespace" or "audit-hook": which of the two network guards a sandboxed program gets here."""
    probe = run_python("import os\nprint(os.stat('/proc/self/ns/net').st_ino)", timeout_s=10)
    return "namespace" if probe.ok and probe.stdout.strip() != str(_own_netns()) else "audit-hook"
