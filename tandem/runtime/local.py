"""The loop's cluster in the driver's own process: the same workers as `RayCluster`'s actors, built
here and called one after another (`tandem.controller.protocol.Cluster`), with no Ray to start.

A `run.mode=sync` run on one machine, one worker per role, never overlaps two calls: the loop
generates, scores, trains and pushes in turn, each call waiting for the one before. Ray gives that
run nothing it uses, and costs it the start-up that dominates a short run: Ray's own processes,
then a Python process per actor that imports torch and tandem again before it builds its role
(docs/results.md#start-up has the measured split). `run.cluster=auto` picks this cluster where
`tandem.config.validate.one_process_refusal` finds nothing against it and Ray is not running in
the process already (a caller that started Ray meant the run to use it).

Each call runs at `submit`, on the worker objects `RayCluster` would have made actors of
(`tandem.runtime.actors`); arguments and results cross by pickle, as they cross Ray, so no call
shares a mutable object with the loop (numpy arrays travel out of band, not copied, as Ray's
object store hands them to a reader on the same node). Weight pushes take the object-store
transport, which hands its buckets over in memory when Ray is not running. Every role gets all of
the process's CPU threads: in sync mode only one computes at a time.
"""

import os
import pickle
import time
import traceback
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem import devices
from tandem.config import Config
from tandem.controller.protocol import CallFailed, Done
from tandem.controller.timeline import Span
from tandem.errors import TandemError
from tandem.runtime import placement
from tandem.runtime.actors import CriticActor, RefActor, RewardActor, RolloutActor, TrainActor


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
    """A call's handle: its worker, its method and how it ended."""

    worker: str
    method: str
    done: Done | None = None


@dataclass
class LocalCluster:
    workers: dict[str, Any]  # "<role>/<rank>" -> the worker object
    names: dict[str, list[str]] = field(default_factory=dict)
    ended: list[LocalCall] = field(default_factory=list)  # ended, result not taken yet
    spans: list[Span] = field(default_factory=list)  # each worker's start-up: building it here

    @classmethod
    def start(cls, cfg: Config) -> "LocalCluster":
        """Build the run's workers here, as `RayCluster.start` would place them: a rollout worker, a
        train worker, the reward pool, and a ref or critic worker where the run has one."""
        cfg = devices.resolve(cfg, torch.cuda.device_count())
        threads = cfg.run.threads or cpu_threads()
        roles = {s.role for s in placement.plan(cfg, cpu_threads(), torch.cuda.device_count())}
        build = {
            "reward/0": lambda: RewardActor(cfg),
            "rollout/0": lambda: RolloutActor(cfg, 0, threads),
            "train/0": lambda: TrainActor(cfg, 0, threads, "ref_logp" not in roles),
        }
        if "ref_logp" in roles:
            build["ref/0"] = lambda: RefActor(cfg, threads)
        if "critic" in roles:
            build["critic/0"] = lambda: CriticActor(cfg, 0, threads)
        workers, spans, names = {}, [], {}
        for name, make in build.items():
            start = time.time()
            workers[name] = make()
            spans.append(Span("startup", name, start, time.time()))
            names.setdefault(name.split("/")[0], []).append(name)
        return cls(workers, names, spans=spans)

    def submit(self, worker: str, method: str, *args: Any, until_restarted: bool = False) -> LocalCall:
        """Run `worker.method(*args)` now; a handle among `args` gives its call's result (or fails
        this call with its error, as Ray fails a call whose argument failed)."""
        call = LocalCall(worker, method)
        try:
            given = _crossed([a.done.result if isinstance(a, LocalCall) else a for a in _check(args)])
            call.done = Done(call, _crossed(getattr(self.workers[worker], method)(*given)))
        except TandemError as e:
            call.done = Done(call, error=e)
        except Exception:
            call.done = Done(call, error=CallFailed(f"{worker}.{method}: {traceback.format_exc()}"))
        self.ended.append(call)
        return call

    def share(self, obj: Any) -> Any:
        return obj

    def wait_next(self, handles: Collection[LocalCall], timeout_s: float) -> Done | None:
        """The first of `handles` submitted (every call has ended by the time it is submitted)."""
        call = next((c for c in self.ended if c in handles), None)
        if call is None:  # none of them is ours to end: wait as a call that never ends would
            time.sleep(timeout_s)
            return None
        self.ended.remove(call)
        return call.done

    def get(self, handles: list[LocalCall], timeout_s: float) -> list[Any]:
        self.ended = [c for c in self.ended if c not in handles]
        for call in handles:
            if call.done.error is not None:
                raise call.done.error
        return [call.done.result for call in handles]

    def now(self) -> float:
        return time.time()

    def startup(self) -> list[Span]:
        return self.spans

    def close(self) -> None:
        """Stop the reward pool's processes and an agent's endpoint (what Ray's end of an actor's
        process would stop)."""
        self.workers["reward/0"].close()
        close_agent = getattr(self.workers["rollout/0"].worker.agent, "close", None)
        if close_agent is not None:
            close_agent()


def _check(args: tuple) -> tuple:
    """A handle whose call failed fails the call it is passed to, with its error."""
    for a in args:
        if isinstance(a, LocalCall) and a.done.error is not None:
            raise a.done.error
    return args
