"""The loop's cluster on Ray: start (or join) Ray, reserve the placement, create the run's actors,
and run the loop's calls on them (`tandem.controller.protocol.Cluster`).

Ray starts locally by itself, an instance of the run's own even where `ray start` recorded a
cluster on this machine; only `ray.address` (`auto`, or host:port) joins one. Each actor gets its own
bundle of one placement group (`tandem.runtime.placement`), so roles land on the CPUs their task
group was given, across nodes when there are several. When the run needs torch.distributed (more
than one train worker, or the broadcast weight transport) every actor joins one world.

An actor's call that raises ends with Ray's RayTaskError and the actor serves the next call, a
`BaseException` raised (torch's CheckpointException) included: the loop gets a CallFailed naming
it (`tests/test_call_threads.py`). A SystemExit ends the actor's process (WorkerDied).
"""

import logging
import os
import socket
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.config import Config
from tandem.controller.protocol import CallFailed, Done, Handle, WorkerDied
from tandem.controller.timeline import Span
from tandem.errors import TandemError
from tandem.runtime import placement
from tandem.runtime.role_table import Role, in_run
from tandem.sync import TRANSPORTS, free_port

_ACTORS: dict[type, Any] = {}


def ray_actor(worker: type):
    """`worker` as a Ray actor class; methods marked with a concurrency group (a rollout worker
    receives pushes while it generates: `tandem.runtime.actors.group`) run in their group, one at a
    time each."""
    if worker not in _ACTORS:
        groups = {}
        for method in vars(worker).values():
            if hasattr(method, "concurrency_group"):
                ray.method(concurrency_group=method.concurrency_group)(method)
                groups[method.concurrency_group] = 1
        _ACTORS[worker] = ray.remote(concurrency_groups=groups)(worker) if groups else ray.remote(worker)
    return _ACTORS[worker]


RAY_CONNECT_TIMEOUT_S = 30.0  # the longest wait for ray.address to answer (or run.timeout_s if less)


def start_ray(cfg: Config) -> bool:
    """Start (or join) Ray for the run -> whether this call did (False: it was up already). With
    ray.address empty, a Ray of the run's own: `ray.init()` with no address would join the cluster
    recorded in /tmp/ray/ray_current_cluster (by `ray start`, or left by a head that died)."""
    if ray.is_initialized():
        return False
    # Actors import reward functions by dotted path from the current directory, as the driver does.
    env = {"PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    # An OpenMP thread that waits for its team spins (libgomp's default), burning the core that the
    # thread it waits for, or another process, needs: beside one busy core of two a 10-step default run
    # took 2.8x its idle time. Passive threads sleep instead: 1.57x (docs/results.md, bench/load.py).
    env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    runtime_env = None
    if cfg.ray.address:  # a running cluster's workers do not inherit this process's environment
        runtime_env = {"env_vars": env}
        check_ray_address(cfg.ray.address, min(RAY_CONNECT_TIMEOUT_S, cfg.run.timeout_s))
    else:  # local Ray's workers do; without a runtime env they also start ~2 s sooner
        os.environ.update(env)
    # Every local start logs that token authentication is on (Ray's default): no news, and a line
    # in front of the one paragraph an error after it should be.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    try:
        ray.init(
            address=cfg.ray.address or "local",
            num_cpus=(cfg.ray.num_cpus or None) if not cfg.ray.address else None,
            include_dashboard=False,
            logging_level=logging.WARNING,
            runtime_env=runtime_env,
        )
    except ConnectionError as e:  # e.g. "auto" with no cluster recorded on this machine
        raise TandemError(f"ray.address={cfg.ray.address!r}: {e}") from None
    return True


def check_ray_address(address: str, timeout: float) -> None:
    """Return once a Ray head answers at `address`, or raise a TandemError naming it within `timeout` s.

    ray.init retries an address where no Ray head answers without end (Ray 2.60: a 5 s connect, a
    30 s wait for the cluster id, again and again), so the driver asks first: the TCP port, then a
    GCS client built in a thread it can stop waiting for. The client releases the GIL while it
    waits, and the daemon thread it is left in does not hold up the process's exit.
    """
    from ray._private.services import canonicalize_bootstrap_address

    advice = "Start the head there (ray start --head), fix ray.address, or leave it empty to start Ray here."
    client = address.startswith("ray://")  # Ray Client: only its port can be asked without connecting
    try:
        target = address.removeprefix("ray://") if client else canonicalize_bootstrap_address(address)
    except (ConnectionError, ValueError) as e:  # "auto" with no cluster recorded; not host:port
        raise TandemError(f"ray.address={address!r}: {e} {advice}") from None
    host, _, port = (target or "").rpartition(":")
    if not host or not port.isdigit():
        raise TandemError(f"ray.address={address!r} is not host:port (or auto, or ray://host:port). {advice}")
    deadline = time.monotonic() + timeout
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise TandemError(
            f"ray.address={address!r}: nothing answers at {host}:{port} ({e}). {advice}"
        ) from None
    if client:
        return
    if address == "auto":  # as ray.init does for a cluster it finds itself: use the token on file
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    answered: list[BaseException | None] = []

    def probe() -> None:
        try:
            ray._raylet.GcsClient(address=target)
            answered.append(None)
        except Exception as e:  # Ray's own timeout ran out first
            answered.append(e)

    thread = threading.Thread(target=probe, name="tandem-ray-address-probe", daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), 0.0))
    if not answered or answered[0] is not None:
        raise TandemError(
            f"ray.address={address!r}: {host}:{port} accepts connections, but no Ray head (GCS) answered "
            f"there within {timeout:g} s{f' ({answered[0]})' if answered else ''}. A head with token "
            f"authentication answers only a driver with RAY_AUTH_MODE=token and its token. {advice}"
        )


def plan_slots(cfg: Config, have: dict[str, float]) -> list[placement.Slot]:
    """The run's placement over what the cluster has (`have`: ray.cluster_resources()), or over
    placement.num_cpus / num_gpus where set."""
    cpus = cfg.placement.num_cpus or have.get("CPU", 1)
    gpus = cfg.placement.num_gpus or have.get("GPU", 0)
    return placement.plan(cfg, cpus, gpus)


def _failed(e: "ray.exceptions.RayTaskError") -> CallFailed | TandemError:
    """A call's error: a worker's TandemError as it was raised (one paragraph for the user, where
    Ray's text would wrap it in a traceback), anything else with the worker's traceback."""
    return e.cause if isinstance(e.cause, TandemError) else CallFailed(str(e))


@dataclass
class RayCluster:
    """The run's actors, by role, and the loop's calls on them (`tandem.controller.protocol.Cluster`)."""

    actors: dict[str, list]  # role -> its actor handles, rank 0 first (the roles table's order)
    slots: list[placement.Slot]
    pg: object = None
    outstanding: set = field(default_factory=set)  # submitted calls whose result was not taken yet
    built: tuple = (0.0, [])  # when the actors were asked for, and a `ready` call's handle per actor
    restarts_workers = True  # Ray restarts a killed rollout worker, re-synced from the last push

    @property
    def names(self) -> dict[str, list[str]]:
        """role -> its workers' names, "<role>/<rank>"."""
        return {role: [f"{role}/{i}" for i in range(len(a))] for role, a in self.actors.items()}

    @property
    def rollouts(self) -> list:
        return self.actors["rollout"]

    @property
    def trainers(self) -> list:
        return self.actors["train"]

    @property
    def reward(self):
        return self.actors["reward"][0]

    @classmethod
    def start(cls, cfg: Config, classes: dict[str, type] | None = None) -> "RayCluster":
        """The run's actors, placed. `classes`: role -> a worker class to build instead of its row's
        (a subclass with calls of its own: `tandem serve`'s trainer and engine)."""
        placement.check_resolved(cfg)
        start_ray(cfg)
        have = ray.cluster_resources()
        placement.check_resources(cfg, have, "the Ray cluster")
        slots = plan_slots(cfg, have)
        placement.check_fits(slots, have.get("CPU", 0), have.get("GPU", 0))  # fail now, not in 600 s
        pg = placement_group(placement.bundles(slots), strategy="PACK")
        try:
            ray.get(pg.ready(), timeout=cfg.run.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TandemError(
                f"Ray could not reserve {placement.describe(slots)} within {cfg.run.timeout_s:g} s; "
                f"the cluster has {ray.cluster_resources().get('CPU', 0):g} CPUs and "
                f"{ray.cluster_resources().get('GPU', 0):g} GPUs."
            ) from None
        created = time.time()
        strategy = {
            s.bundle: PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=s.bundle)
            for s in slots
        }

        def build(role: Role) -> list:
            """The role's actors: each placed role's on its slots' bundles, with their CPUs and GPUs;
            a role placement leaves out (the reward actor: light) beside them, on no CPU of its own."""
            actor, restarts = (
                ray_actor((classes or {}).get(role.name) or role.worker_class()),
                role.restarts(cfg),
            )
            retries = dict(max_restarts=restarts, max_task_retries=restarts if role.retry_calls else 0)
            if not role.task:
                return [
                    actor.options(num_cpus=0, **retries).remote(cfg, r, 0) for r in range(role.count(cfg))
                ]
            return [
                actor.options(
                    num_cpus=s.cpus, num_gpus=s.gpus, scheduling_strategy=strategy[s.bundle], **retries
                ).remote(cfg, s.rank, s.threads)
                for s in slots
                if s.role == role.name
            ]

        cluster = cls({role.name: build(role) for role in in_run(cfg)}, slots, pg)
        actors = [a for role in cluster.actors.values() for a in role]
        cluster.built = (created, [a.ready.remote() for a in actors])  # runs once each is built
        cluster._join_world(cfg)
        return cluster

    def _join_world(self, cfg: Config) -> None:
        """The trainers' torch.distributed world, the critic's ranks' world of their own, and under
        the broadcast transport the weight-sync group (the trainer's rank 0 and the rollout workers,
        outside both worlds: tandem.sync.dist); each only where it is needed."""
        broadcast = TRANSPORTS.get(cfg.sync.transport).collective
        sharded = cfg.train.strategy == "fsdp2"
        critics = self.actors.get("critic", [])
        groups = []  # (members, the method each calls)
        if len(self.trainers) > 1 or sharded:
            groups.append((self.trainers, "join"))
        if len(critics) > 1 or (critics and sharded):
            groups.append((critics, "join"))
        if broadcast:
            groups.append(([self.trainers[0], *self.rollouts], "join_sync"))
        addr = ray.util.get_node_ip_address()
        refs, ports = [], set()
        for members, method in groups:
            port = free_port()
            while port in ports:  # two groups must not meet at one address
                port = free_port()
            ports.add(port)
            refs += [
                getattr(m, method).remote(rank, len(members), addr, port) for rank, m in enumerate(members)
            ]
        try:
            ray.get(refs, timeout=cfg.sync.timeout_s + 30)
        except ray.exceptions.GetTimeoutError:
            raise TandemError(
                f"The workers did not join their torch.distributed world within sync.timeout_s + 30 = "
                f"{cfg.sync.timeout_s + 30:g} s (the trainers{' and rollout workers' if broadcast else ''}"
                f" meet at {addr}). A worker that is still starting on a busy machine needs more: raise "
                "sync.timeout_s."
            ) from None
        except ray.exceptions.RayActorError as e:
            raise TandemError(f"A worker died while joining the torch.distributed world: {e}") from None
        except ray.exceptions.RayTaskError as e:
            raise (
                _failed(e)
                if isinstance(e.cause, TandemError)
                else TandemError(f"Joining the torch.distributed world failed: {e}")
            ) from None

    # -- the loop's calls: the one place that waits on Ray ------------------------------------------
    def actor(self, worker: str):
        """The actor named "<role>/<rank>"."""
        role, rank = worker.split("/")
        return self.actors[role][int(rank)]

    def submit(self, worker: str, method: str, *args: Any, until_restarted: bool = False) -> Handle:
        call = getattr(self.actor(worker), method)
        if until_restarted:  # Ray answers "unavailable" while the actor restarts; retry until it is back
            call = call.options(max_task_retries=-1)
        handle = call.remote(*args)
        self.outstanding.add(handle)
        return handle

    def share(self, obj: Any) -> Any:
        return ray.put(obj)

    def wait_next(self, handles: Collection[Handle], timeout_s: float) -> Done | None:
        ready, _ = ray.wait(list(handles), num_returns=1, timeout=timeout_s)
        if not ready:
            return None
        self.outstanding.discard(ready[0])
        try:
            return Done(ready[0], ray.get(ready[0]))
        except ray.exceptions.RayActorError as e:
            return Done(ready[0], error=WorkerDied(str(e)))
        except ray.exceptions.RayTaskError as e:
            return Done(ready[0], error=_failed(e))

    def get(self, handles: list[Handle], timeout_s: float) -> list[Any]:
        self.outstanding.difference_update(handles)
        try:
            return ray.get(handles, timeout=timeout_s)
        except ray.exceptions.RayActorError as e:
            raise WorkerDied(str(e)) from None
        except ray.exceptions.RayTaskError as e:
            raise _failed(e) from None
        except ray.exceptions.GetTimeoutError as e:
            raise TimeoutError(str(e)) from None

    def now(self) -> float:
        return time.time()

    def startup(self) -> list[Span]:
        """Each worker's start-up: from the driver's asking for its actor to the actor built (its
        process started, its imports, its role built); the actors that never were are left out."""
        created, handles = self.built
        names = [name for workers in self.names.values() for name in workers]
        spans = []
        for name, handle in zip(names, handles, strict=True):
            try:
                spans.append(Span("startup", name, created, ray.get(handle, timeout=1)))
            except Exception:  # died, or never built: no span, the run's error says why
                pass
        return spans

    def close(self) -> None:
        # Calls still queued or running (a run that failed or was stopped) are cancelled, so that Ray
        # does not retry them on the actors killed below and say so after the run's last word. The
        # reward pool then dies with its actor (Ray kills a killed worker's child processes); a
        # finished run's pool stops its workers itself.
        for handle in self.outstanding:
            ray.cancel(handle)
        if not self.outstanding:
            try:
                ray.get(self.reward.close.remote(), timeout=5)
            except Exception:  # the run is ending either way; a dead pool must not mask the real error
                pass
        for actor in (a for role in self.actors.values() for a in role):
            ray.kill(actor)
        if self.pg is not None:
            remove_placement_group(self.pg)
