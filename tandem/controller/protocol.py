"""The cluster the controller loop talks to: submit a call to a worker, wait for the next to finish.

Two implementations: `tandem.runtime.cluster.RayCluster` (Ray actors, wall-clock time) and
`tandem.sim.cluster.SimCluster` (simulated workers on a virtual clock, for `tandem simulate`).
Neither the loop nor this module imports Ray.

Workers are named "<role>/<rank>": rollout/0.., train/0.. (rank 0 first), critic/0.., ref/0,
reward/0. A call's arguments may hold the handle of an earlier call: the worker then gets that
call's result, once it is done (as Ray resolves an ObjectRef passed as an argument).
"""

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

Handle = Any  # what `submit` returns: a Ray ObjectRef, or a call number on the virtual clock


class WorkerDied(Exception):
    """The worker's process died during the call (Ray restarts a rollout worker; nothing else)."""


class CallFailed(Exception):
    """The call raised; the message carries the worker's own error and traceback."""


@dataclass
class Done:
    """A finished call: its result, or the error that ended it."""

    handle: Handle
    result: Any = None
    error: Exception | None = None  # WorkerDied, CallFailed, or a TandemError the worker raised


class Cluster(Protocol):
    names: dict[str, list[str]]  # role -> its workers' names, e.g. {"rollout": ["rollout/0", ...]}
    # Whether a dead worker can come back (Ray restarts it) and need the last push again; where
    # none can (one process), the loop lets go of a push once every engine has it.
    restarts_workers: bool

    def submit(self, worker: str, method: str, *args: Any, until_restarted: bool = False) -> Handle:
        """Start `worker.method(*args)` -> its handle. `until_restarted`: retry the call while the
        worker restarts (a dead rollout worker's re-sync), instead of failing with WorkerDied."""
        ...

    def share(self, obj: Any) -> Any:
        """One copy of `obj` for many calls (Ray's object store); pass the result as an argument."""
        ...

    def wait_next(self, handles: Collection[Handle], timeout_s: float) -> Done | None:
        """The first of `handles` to finish (result or error); None if none did within timeout_s."""
        ...

    def get(self, handles: list[Handle], timeout_s: float) -> list[Any]:
        """Every result, in order, once all are done; raises WorkerDied / CallFailed for the first
        that failed, TimeoutError past timeout_s."""
        ...

    def now(self) -> float:
        """Seconds on this cluster's clock (time.time() on Ray; virtual seconds in the simulator)."""
        ...

    def close(self) -> None: ...
