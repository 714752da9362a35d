"""Start (or join) Ray, reserve the placement, and create the run's actors.

Ray starts locally by itself; `ray.address=auto` joins a running cluster. Each actor gets its own
bundle of one placement group (`tandem.controller.placement`), so roles land on the CPUs their task
group was given, across nodes when there are several. When the run needs torch.distributed (more
than one train worker, or the broadcast weight transport) every actor joins one world.
"""

import logging
import os
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem import devices
from tandem.config import Config
from tandem.controller import placement
from tandem.controller.actors import RefActor, RewardActor, RolloutActor, TrainActor
from tandem.errors import TandemError
from tandem.sync import TRANSPORTS, free_port


def start_ray(cfg: Config) -> None:
    if ray.is_initialized():
        return
    # Actors import reward functions by dotted path from the current directory, as the driver does.
    path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    runtime_env = None
    if cfg.ray.address:  # a running cluster's workers do not inherit this process's environment
        runtime_env = {"env_vars": {"PYTHONPATH": path}}
    else:  # local Ray's workers do; without a runtime env they also start ~2 s sooner
        os.environ["PYTHONPATH"] = path
    ray.init(
        address=cfg.ray.address or None,
        num_cpus=(cfg.ray.num_cpus or None) if not cfg.ray.address else None,
        include_dashboard=False,
        logging_level=logging.WARNING,
        runtime_env=runtime_env,
    )


@dataclass
class Cluster:
    rollouts: list  # RolloutActor handles
    trainers: list  # TrainActor handles, rank 0 first
    ref: object | None
    reward: object
    slots: list[placement.Slot]
    pg: object = None
    names: dict[str, list[str]] = field(default_factory=dict)  # role -> worker names

    @classmethod
    def start(cls, cfg: Config) -> "Cluster":
        start_ray(cfg)
        have = ray.cluster_resources()
        cfg = devices.resolve(cfg, have.get("GPU", 0))  # a no-op on a config run_training resolved
        cpus = cfg.placement.num_cpus or have.get("CPU", 1)
        gpus = cfg.placement.num_gpus or have.get("GPU", 0)
        slots = placement.plan(cfg, cpus, gpus)
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
        on = {s.role: [] for s in slots}
        for s in slots:
            on[s.role].append(s)
        strategy = {
            s.bundle: PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=s.bundle)
            for s in slots
        }
        # A killed rollout worker is restarted by Ray (and re-synced by the controller); with the
        # broadcast transport it could not rejoin the torch.distributed world, so it is not.
        restarts = 0 if TRANSPORTS.get(cfg.sync.transport).collective else 1
        rollouts = [
            RolloutActor.options(
                num_cpus=s.cpus,
                num_gpus=s.gpus,
                scheduling_strategy=strategy[s.bundle],
                max_restarts=restarts,
            ).remote(cfg, s.rank, s.threads)
            for s in on["generate"]
        ]
        keep_ref = not on.get("ref_logp")
        trainers = [
            TrainActor.options(
                num_cpus=s.cpus, num_gpus=s.gpus, scheduling_strategy=strategy[s.bundle]
            ).remote(cfg, s.rank, s.threads, keep_ref)
            for s in on["actor_train"]
        ]
        ref = None
        if on.get("ref_logp"):
            s = on["ref_logp"][0]
            ref = RefActor.options(
                num_cpus=s.cpus, num_gpus=s.gpus, scheduling_strategy=strategy[s.bundle]
            ).remote(cfg, s.threads)
        # A killed reward actor is restarted and the calls it held run again (scoring is pure).
        reward = RewardActor.options(num_cpus=0, max_restarts=3, max_task_retries=3).remote(cfg)
        names = {
            "rollout": [f"rollout/{i}" for i in range(len(rollouts))],
            "train": [f"train/{i}" for i in range(len(trainers))],
            "reward": ["reward/0"],
            **({"ref": ["ref/0"]} if ref is not None else {}),
        }
        cluster = cls(rollouts, trainers, ref, reward, slots, pg, names)
        cluster._join_world(cfg)
        return cluster

    def _join_world(self, cfg: Config) -> None:
        broadcast = TRANSPORTS.get(cfg.sync.transport).collective
        if len(self.trainers) == 1 and not broadcast and cfg.train.strategy != "fsdp2":
            return
        members = self.trainers + (self.rollouts if broadcast else [])
        t = len(self.trainers)
        sync_ranks = [0, *range(t, t + len(self.rollouts))] if broadcast else []
        addr = ray.util.get_node_ip_address()
        port = free_port()
        refs = [
            m.join.remote(rank, len(members), addr, port, t, sync_ranks) for rank, m in enumerate(members)
        ]
        ray.get(refs, timeout=cfg.sync.timeout_s + 30)

    def close(self) -> None:
        try:
            ray.get(self.reward.close.remote(), timeout=30)
        except Exception:  # the run is ending either way; a dead pool must not mask the real error
            pass
        for actor in [*self.rollouts, *self.trainers, self.ref, self.reward]:
            if actor is not None:
                ray.kill(actor)
        if self.pg is not None:
            remove_placement_group(self.pg)
