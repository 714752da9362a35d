"""The roles of a run, one row each: what the Ray cluster, the one-process cluster, the simulator,
placement and validation ask about a role, in one place.

A row names the role (its workers are "<name>/<rank>": the loop, the timeline and the metrics use
that name), its task in `placement.groups` (the seeds' vocabulary: `generate`, `actor_train`, ...),
how many workers the config gives it, the class of its worker and the builder of its simulated
stand-in (both "module:name", imported only when built: this module imports neither torch nor
Ray), how Ray restarts it, and whether the one-process cluster can hold it.

Adding a role is one `ROLES.register` here, with its worker class (`tandem.runtime.actors`) and its
simulated builder (`tandem.sim.run`); every cluster builds it from the row. A worker class is built
as `Class(cfg, rank, threads)`.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tandem.algo import ADV_ESTIMATORS
from tandem.loading import load
from tandem.registry import Registry
from tandem.sync.protocol import TRANSPORTS

# The run's `tandem.config.Config`, not imported: config's validation reads this table.
Config = Any


@dataclass(frozen=True)
class Role:
    name: str
    task: str  # its name in placement.groups; "" = not placed (a light actor beside the bundles)
    count: Callable[[Config], int]  # its workers in this run (0: the run has none)
    count_key: str  # the config key its count follows, for messages
    worker: str  # "module:Class" of the worker a cluster builds, as Class(cfg, rank, threads)
    simulated: str  # "module:function" building its simulated workers (`tandem.sim.run`)
    restarts: Callable[[Config], int] = lambda cfg: 0  # how often Ray restarts a killed worker
    retry_calls: bool = False  # a restarted worker runs the calls it held again (they are pure)
    one_process: bool = True  # the one-process cluster (`tandem.runtime.local`) can hold it
    placed_with: str = ""  # left out of placement.groups, its task joins this task's group

    def worker_class(self) -> type:
        return load(self.worker)

    def simulator(self) -> Callable[..., list[Any]]:
        return load(self.simulated)

    def workers(self, cfg: Config) -> list[str]:
        return [f"{self.name}/{rank}" for rank in range(self.count(cfg))]


ROLES: Registry[Role] = Registry("role")


def _register(role: Role) -> None:
    ROLES.register(role.name)(role)


def in_run(cfg: Config) -> Iterator[Role]:
    """The roles this run has workers of, in the table's order."""
    return (r for r in table() if r.count(cfg) > 0)


def table() -> list[Role]:
    """Every row, in registration order (rank 0 of the first role is built first)."""
    return [ROLES.get(n) for n in ROLES.in_order()]


def by_task(task: str) -> Role:
    return next(r for r in table() if r.task == task)


def placement_tasks() -> list[str]:
    """What placement.groups may name: each placed role's task, and `logp`, the π_old recompute,
    which runs inside actor_train."""
    return [*(r.task for r in table() if r.task), "logp"]


def one_process_reasons(cfg: Config) -> list[str]:
    """Why the run's roles cannot be held in one process: a role with more than one worker, or one
    whose row says it cannot ([] where they can)."""
    reasons = {}
    for r in in_run(cfg):
        n = r.count(cfg)
        if n > 1:
            reasons[r.count_key] = f"{r.count_key}={n}"
        elif not r.one_process:
            reasons[r.name] = f"the {r.name} role runs on Ray only"
    return list(reasons.values())


def ref_count(cfg: Config) -> int:
    """The reference worker: KL to the initial policy needs one, but not in a LoRA run, where the
    reference is the train workers' own model with its adapters off."""
    return 1 if cfg.algo.kl_coef > 0 and not cfg.train.lora.rank else 0


def critic_count(cfg: Config) -> int:
    """PPO's value model (an estimator that needs a critic): as many ranks as the train workers."""
    return cfg.train.num_workers if ADV_ESTIMATORS.traits(cfg.algo.adv_estimator).needs_critic else 0


def rollout_restarts(cfg: Config) -> int:
    """A killed rollout worker is restarted (and re-synced by the controller); with the broadcast
    transport it could not rejoin the torch.distributed world, so it is not."""
    return 0 if TRANSPORTS.get(cfg.sync.transport).collective else 1


ACTORS, SIM = "tandem.runtime.actors", "tandem.sim.run"
_register(Role(
    "rollout", task="generate", count=lambda cfg: cfg.rollout.num_workers, count_key="rollout.num_workers",
    worker=f"{ACTORS}:RolloutActor", simulated=f"{SIM}:sim_rollouts", restarts=rollout_restarts,
))  # fmt: skip
_register(Role(
    "train", task="actor_train", count=lambda cfg: cfg.train.num_workers, count_key="train.num_workers",
    worker=f"{ACTORS}:TrainActor", simulated=f"{SIM}:sim_trainer",
))  # fmt: skip
_register(Role(
    "ref", task="ref_logp", count=ref_count, count_key="algo.kl_coef", placed_with="actor_train",
    worker=f"{ACTORS}:RefActor", simulated=f"{SIM}:sim_forward",
))  # fmt: skip
_register(Role(
    "teacher", task="teacher_logp", count=lambda cfg: int(bool(cfg.algo.distill.teacher)),
    count_key="algo.distill.teacher", placed_with="actor_train",
    worker=f"{ACTORS}:TeacherActor", simulated=f"{SIM}:sim_forward",
))  # fmt: skip
_register(Role(
    "critic", task="critic", count=critic_count, count_key="train.num_workers", placed_with="actor_train",
    worker=f"{ACTORS}:CriticActor", simulated=f"{SIM}:sim_forward",
))  # fmt: skip
_register(Role(
    "judge", task="judge", count=lambda cfg: int(cfg.reward.fn == "judge"), count_key="reward.fn",
    placed_with="generate", worker=f"{ACTORS}:JudgeActor", simulated=f"{SIM}:sim_reward",
    restarts=lambda cfg: 1, retry_calls=True,  # greedy judging is pure: a restarted judge judges again
))  # fmt: skip
_register(Role(
    "reward", task="", count=lambda cfg: 1, count_key="",
    worker=f"{ACTORS}:RewardActor", simulated=f"{SIM}:sim_reward",
    restarts=lambda cfg: 3, retry_calls=True,  # scoring is pure: a restarted pool scores again
))  # fmt: skip
