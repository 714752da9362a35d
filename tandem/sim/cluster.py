"""A cluster on a virtual clock: the loop's calls run on simulated workers, in discrete events.

It implements `tandem.controller.protocol.Cluster` as Ray would run the same calls, with time
instead of work. A call starts once its worker has a free place in the call's lane (Ray's
concurrency groups: a lane runs as many calls at once as the worker says) and once the calls among
its arguments have ended (it then gets their results, as Ray resolves an ObjectRef argument); it
ends when its worker says so, with a result, or with a `WorkerDied` / `CallFailed` as its result to
fail. Workers count their work in *full-speed seconds*: workers that share a device pool (CPU
cores, GPUs time-shared by colocated roles) beyond its capacity progress proportionally slower.
The clock jumps from one event (a call or a sequence ending) to the next; `wait_next` returns the
first of the handles to end and never times out: it returns None only when nothing in flight can
ever end.
"""

import itertools
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.controller.protocol import CallFailed, Done, WorkerDied

INF = float("inf")


@dataclass(eq=False)
class Job:
    """One call on a simulated worker; it is also the call's handle."""

    worker: str
    method: str
    args: tuple
    start: float = -1.0  # virtual seconds; -1 while it waits for its lane or an argument
    end: float = -1.0  # -1 until it ends
    result: Any = None
    state: dict = field(default_factory=dict)  # the worker's own bookkeeping

    @property
    def done(self) -> bool:
        return self.end >= 0


class SimWorker(Protocol):
    """A simulated worker: the lanes of its methods, and its running jobs' progress."""

    pool: str  # the device pool it computes on; "" = devices of its own
    demand: float  # cores or devices of the pool it occupies while computing

    def lane(self, method: str) -> tuple[str, int]:
        """-> (lane name, calls the lane runs at once)."""
        ...

    def begin(self, job: Job, now: float) -> None:
        """`job` starts at virtual time `now`, its arguments resolved."""
        ...

    def until_next(self) -> float:
        """Full-speed seconds until its next event (a job ends, or its own state changes); INF if none."""
        ...

    def advance(self, dt: float, now: float) -> list[Job]:
        """Progress by `dt` full-speed seconds, reaching virtual time `now` -> the jobs that ended,
        their `result` set."""
        ...

    def computing(self) -> bool:
        """Whether it occupies its pool now."""
        ...


class SimCluster:
    restarts_workers = True  # as on Ray

    def __init__(
        self,
        workers: dict[str, SimWorker],
        names: dict[str, list[str]],
        pools: dict[str, float],
        oversubscription_exponent: float = 1.0,
    ):
        """workers by name; names: role -> worker names (the loop's view); pools: the capacity of
        each device pool a worker names. A pool's workers asking for more than it has run at
        (capacity / demand)^oversubscription_exponent of their speed."""
        self.workers, self.names, self.pools = workers, names, pools
        self.exponent = oversubscription_exponent
        self.clock = 0.0
        self._order = itertools.count()
        self.ended: list[tuple[float, int, Job]] = []  # (end, order, job): ended, not yet handed back
        self.blocked: list[Job] = []  # waiting for an argument's call to end
        self.queues: dict[tuple[str, str], deque[Job]] = {}  # (worker, lane) -> jobs waiting for it
        self.running: dict[tuple[str, str], int] = {}  # (worker, lane) -> jobs running in it

    # -- the protocol ------------------------------------------------------------------------------
    def submit(self, worker: str, method: str, *args: Any, until_restarted: bool = False) -> Job:
        job = Job(worker, method, args)
        self._place(job)
        return job

    def share(self, obj: Any) -> Any:
        return obj

    def wait_next(self, handles: Collection[Job], timeout_s: float) -> Done | None:
        while True:
            first = min((e for e in self.ended if e[2] in handles), default=None, key=lambda e: e[:2])
            if first is not None:
                self.ended.remove(first)
                job = first[2]
                if isinstance(job.result, (WorkerDied, CallFailed)):  # a worker may end a call so
                    return Done(job, error=job.result)
                return Done(job, job.result)
            if not self._step():  # nothing can end: the clock runs on to the timeout
                self.clock += timeout_s
                return None

    def get(self, handles: list[Job], timeout_s: float) -> list[Any]:
        while not all(h.done for h in handles):
            if not self._step():
                raise TimeoutError(f"{len(handles)} simulated calls can never end")
        self.ended = [e for e in self.ended if e[2] not in handles]
        for h in handles:
            if isinstance(h.result, (WorkerDied, CallFailed)):
                raise h.result
        return [h.result for h in handles]

    def now(self) -> float:
        return self.clock

    def close(self) -> None:
        pass

    # -- the events --------------------------------------------------------------------------------
    def _place(self, job: Job) -> None:
        """Queue `job` on its lane once its arguments have ended, and start what can start."""
        if any(isinstance(a, Job) and not a.done for a in job.args):
            self.blocked.append(job)
            return
        job.args = tuple(a.result if isinstance(a, Job) else a for a in job.args)
        name, _ = self.workers[job.worker].lane(job.method)
        self.queues.setdefault((job.worker, name), deque()).append(job)
        self._start_queued(job.worker, job.method)

    def _start_queued(self, worker: str, method: str) -> None:
        name, width = self.workers[worker].lane(method)
        queue = self.queues.get((worker, name))
        while queue and self.running.get((worker, name), 0) < width:
            job = queue.popleft()
            self.running[(worker, name)] = self.running.get((worker, name), 0) + 1
            job.start = self.clock
            self.workers[worker].begin(job, self.clock)

    def _speeds(self) -> dict[str, float]:
        """Each worker's speed: 1, or for one computing in an over-full pool, capacity / demand."""
        demand: dict[str, float] = {}
        computing = {n for n, w in self.workers.items() if w.pool and w.computing()}
        for n in computing:
            w = self.workers[n]
            demand[w.pool] = demand.get(w.pool, 0.0) + w.demand
        return {
            n: min(1.0, self.pools[w.pool] / demand[w.pool]) ** self.exponent if n in computing else 1.0
            for n, w in self.workers.items()
        }

    def _step(self) -> bool:
        """Advance the clock to the next event; False when nothing in flight can ever end."""
        speeds = self._speeds()
        waits = {n: w.until_next() for n, w in self.workers.items()}
        dt = min((t / speeds[n] for n, t in waits.items() if t < INF), default=INF)
        if dt == INF:
            return False
        self.clock += dt
        ended: list[Job] = []
        for n, t in waits.items():
            if t < INF:
                ended += self.workers[n].advance(dt * speeds[n], self.clock)
        for job in ended:
            job.end = self.clock
            self.ended.append((job.end, next(self._order), job))
            self.running[(job.worker, self.workers[job.worker].lane(job.method)[0])] -= 1
        for job in ended:
            self._start_queued(job.worker, job.method)
        if ended and self.blocked:
            blocked, self.blocked = self.blocked, []
            for job in blocked:
                self._place(job)
        return True
