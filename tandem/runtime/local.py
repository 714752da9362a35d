"""The loop's cluster in the driver's own process: the same workers as `RayCluster`'s actors, built
here and called one after another (`tandem.controller.protocol.Cluster`), with no Ray to start.

A `run.mode=sync` run on one machine, one worker per role, never overlaps two calls: the loop
generates, scores, trains and pushes in turn, each call waiting for the one before. Ray gives that
run nothing it uses, and costs it the start-up that dominates a short run: Ray's own processes,
then a Python process per actor that imports torch and tandem again before it builds its role
(docs/results.md#start-up has the measured split). `run.cluster=auto` picks this cluster where
`tandem.runtime.checks.one_process_refusal` finds nothing against it and Ray is not running in
the process already (a caller that started Ray meant the run to use it).

The calls run one after another, in the order submitted, on one thread of their own, on the
worker objects `RayCluster` would have made actors of (`tandem.runtime.actors`); the loop waits on
them as it waits on Ray, so a stop signal is seen within `STOP_POLL_S` while a call hangs (a
reward function that never returns), and `close` ends such a call by stopping what it waits on.
Whatever a call raises ends that call with the error and the thread goes on to the next, a
`BaseException` that is no stop request included (torch's `CheckpointException` is one: a damaged
checkpoint's load, a save on a full disk); a thread that died of it would leave its call and every
later one waiting `run.timeout_s`. A stop request (`STOP_REQUESTS`) ends its call, then the thread.
Arguments and results cross by pickle, as they cross Ray, so no call shares a mutable object with
the loop (numpy arrays travel out of band, not copied, as Ray's object store hands them to a
reader on the same node). Weight pushes take the object-store
transport, which hands its buckets over in memory when Ray is not running. Every role gets all of
the process's CPU threads: in sync mode only one computes at a time.
"""

import os
import pickle
import queue
import threading
import time
import traceback
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.config import Config
from tandem.controller.protocol import CallFailed, Done
from tandem.controller.timeline import Span
from tandem.errors import TandemError
from tandem.runtime import placement
from tandem.runtime.role_table import in_run

STOP_REQUESTS = (KeyboardInterrupt, SystemExit)  # raised by a call, they end the calls' thread too


class CallStopped(CallFailed):
    """The call raised a stop request (`STOP_REQUESTS`): it ended, and so did the calls' thread."""


def cpu_threads() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _crossed(obj: Any) -> Any:
    """`obj` as a call on another process would see it: pickled and read back, numpy arrays out of
    band (shared, as Ray's object store shares them with a reader on its node)."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=buffers)


@dataclass(eq=False)
class LocalCall:
    """A call's handle: what to run, and once `ended` is set, how it ended (its result or error).
    It holds no `Done`, which points back at it: the cycle kept each call's result (a weight push's
    buckets, a step's samples) alive until the garbage collector ran, 0.27 GB at a time for
    SmolLM2-135M's pushes."""

    worker: str
    method: str
    args: tuple
    result: Any = None
    error: Exception | None = None
    ended: threading.Event = field(default_factory=threading.Event)


class LocalCluster:
    restarts_workers = False  # a worker's death is the process's

    def __init__(self, workers: dict[str, Any], names: dict[str, list[str]], threads: int = 0, spans=()):
        """workers: "<role>/<rank>" -> the worker object; names: role -> its workers' names;
        threads: torch threads of the calls' thread (0: as torch has them); spans: each worker's
        start-up."""
        self.workers, self.names, self.spans = workers, names, list(spans)
        self.pending: list[LocalCall] = []  # submitted, result not taken yet, in submission order
        self.calls: queue.SimpleQueue[LocalCall | None] = queue.SimpleQueue()
        # A daemon thread: a call that never ends must not keep the process from exiting.
        self.thread = threading.Thread(target=self._serve, args=(threads,), name="tandem-calls", daemon=True)
        self.thread.start()

    @classmethod
    def start(
        cls, cfg: Config, classes: dict[str, type] | None = None, only: Collection[str] | None = None
    ) -> "LocalCluster":
        """Build the run's workers here, one per role the run has (the roles table), in the table's
        order: as `RayCluster.start` would place them, with every role on all of this process's
        threads. `classes`: role -> a worker class to build instead of its row's, as
        `RayCluster.start` takes them; `only`: the roles to build (`tandem serve` gives its trainer
        and its engine a cluster each, so that a sample runs while a train call does)."""
        placement.check_resolved(cfg)
        have = {"CPU": cpu_threads(), "GPU": torch.cuda.device_count()}
        placement.check_resources(cfg, have, "this machine")
        cpus = int(cfg.placement.num_cpus) or have["CPU"]  # every role takes them all, in turn
        threads = cfg.run.threads or cpus
        workers, spans, names = {}, [], {}
        for role in in_run(cfg):
            if only is not None and role.name not in only:
                continue
            make = (classes or {}).get(role.name) or role.worker_class()
            for name in role.workers(cfg):  # one: `one_process_refusal` let the run in
                start = time.time()
                workers[name] = make(cfg, int(name.split("/")[1]), threads)
                spans.append(Span("startup", name, start, time.time()))
                names.setdefault(role.name, []).append(name)
        return cls(workers, names, threads, spans)

    def _serve(self, threads: int) -> None:
        """Run the calls in order, each ended with its result or error, until `close`'s None or a
        call's stop request."""
        if threads:
            torch.set_num_threads(threads)  # a thread's OpenMP team size is its own
        while (call := self.calls.get()) is not None:
            call.result, call.error = self._run(call)
            call.ended.set()
            if isinstance(call.error, CallStopped):
                return
            del call  # not held here until the next call comes: the loop frees it when done

    def _run(self, call: LocalCall) -> tuple[Any, Exception | None]:
        """`worker.method(*args)` -> (its result, None) or (None, the error that ended it: a
        TandemError as raised; anything else, BaseException included, as a CallFailed with its
        traceback, a CallStopped for a stop request). A handle among the args gives its call's
        result (it ran before: calls run in order), or fails this call with its error, as Ray fails
        a call whose argument failed."""
        try:
            args = [_result(a) if isinstance(a, LocalCall) else a for a in call.args]
            return _crossed(getattr(self.workers[call.worker], call.method)(*_crossed(args))), None
        except TandemError as e:
            return None, e
        except BaseException as e:  # torch's CheckpointException is one, not an Exception
            failed = CallStopped if isinstance(e, STOP_REQUESTS) else CallFailed
            return None, failed(f"{call.worker}.{call.method}: {traceback.format_exc()}")

    def submit(self, worker: str, method: str, *args: Any, until_restarted: bool = False) -> LocalCall:
        call = LocalCall(worker, method, args)
        self.pending.append(call)
        self.calls.put(call)
        return call

    def share(self, obj: Any) -> Any:
        return obj

    def wait_next(self, handles: Collection[LocalCall], timeout_s: float) -> Done | None:
        """The first of `handles` submitted, once it ends (calls end in the order submitted)."""
        call = next((c for c in self.pending if c in handles), None)
        if call is None or not call.ended.wait(timeout_s):
            if call is None:  # none of them is ours to end: wait as for a call that never ends
                time.sleep(timeout_s)
            return None
        self.pending.remove(call)
        return Done(call, call.result, call.error)

    def get(self, handles: list[LocalCall], timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        for call in handles:
            if not call.ended.wait(max(deadline - time.monotonic(), 0.0)):
                raise TimeoutError(f"{call.worker}.{call.method} did not end within {timeout_s:g} s")
        self.pending = [c for c in self.pending if c not in handles]
        return [_result(call) for call in handles]

    def now(self) -> float:
        return time.time()

    def startup(self) -> list[Span]:
        return self.spans

    def close(self) -> None:
        """No more calls; stop the reward pool's processes and an agent's endpoint (what the end of
        an actor's process stops on Ray), which ends a call still waiting on them."""
        self.calls.put(None)
        for worker in self.workers.values():
            if hasattr(worker, "close"):
                worker.close()


def _result(call: LocalCall) -> Any:
    """An ended call's result, or its error raised."""
    if call.error is not None:
        raise call.error
    return call.result
