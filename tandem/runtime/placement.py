"""Placement: which CPUs and GPUs each role's actors get, from `placement.groups` and `placement.ratios`.

`placement.groups` names tasks as the seeds' pull request does, each a role's `task` in the roles
table (`tandem.runtime.role_table`): `generate` (rollout workers), `actor_train` (train workers,
which also compute π_old, so `logp` goes with them), `ref_logp` (the reference worker), `critic`
(PPO's value model, with algo.adv_estimator=gae: as many ranks as the train workers, sharded the
same way). A role left out of `placement.groups` joins the group its row names (`placed_with`).
Slots carry role names (`rollout`, `train`, ...), the vocabulary of workers and the loop.

run.device=cpu (and an `auto` not yet resolved): a task group shares `ratio × cpus`; each actor in
it gets an equal part as its own placement-group bundle (so groups can span nodes) and as many torch
threads as whole CPUs in its part. With no groups every role is colocated: they share all CPUs, each
with that many threads, and take turns. Only rollout workers of rollout.engine=vllm take a GPU, one.

run.device=cuda: every role runs on GPUs. A task group also shares `ratio × gpus`, split equally
among its actors, each still its own bundle: a part above one GPU is rounded down to whole GPUs and
one below to 1/k of a GPU, the amounts Ray can pack. With no groups (verl's layout) there is one
bundle per GPU holding `cpus / gpus` CPUs; the i-th actor of every role goes on bundle i % gpus and
the actors of a bundle share its GPU and CPUs equally, with as many threads as the bundle's CPUs.
Bundles no actor lands on are not reserved. NCCL allows one rank of a communicator per GPU, so the
plan refuses to put two train workers (or, with sync.transport=broadcast, two members of the
broadcast) where they could share one.
"""

import math
from dataclasses import dataclass

from tandem.config import Config
from tandem.errors import TandemError
from tandem.rollout.engines import ENGINES
from tandem.runtime.role_table import ROLES, by_task, table
from tandem.sync import TRANSPORTS

MIN_SHARE = 0.05  # the least CPU or GPU an actor may get; less is a mistake, not a plan


@dataclass
class Slot:
    """One actor's share: the bundle it lives in, its Ray CPU and GPU amounts, its torch threads."""

    role: str  # the role's name in the roles table
    rank: int
    cpus: float
    threads: int
    bundle: int = 0
    gpus: float = 0.0  # run.device=cuda: its part of a GPU or whole GPUs; cpu: 1 for a vLLM rollout


def placed_roles() -> list[str]:
    """The roles placement gives a share of the devices, in the table's order (the driver and the
    reward actor are light; the reward pool's processes run outside any bundle)."""
    return [r.name for r in table() if r.task]


def role_counts(cfg: Config) -> dict[str, int]:
    """Each placed role's worker count in this run."""
    return {r.name: r.count(cfg) for r in table() if r.task}


def _task_groups(cfg: Config) -> tuple[list[list[str]], list[float]]:
    """placement.groups as groups of role names, and their ratios (no groups: one of every role)."""
    p = cfg.placement
    if not p.groups:
        return [placed_roles()], [1.0]
    tasks = [[g] if isinstance(g, str) else list(g) for g in p.groups]
    groups = [[by_task(t).name for t in g if t != "logp"] for g in tasks]  # logp runs inside actor_train
    for role in table():  # a role of this run not named joins the group its row names
        if (
            role.task
            and role.placed_with
            and role.count(cfg)
            and role.name not in {n for g in groups for n in g}
        ):
            next(g for g in groups if by_task(role.placed_with).name in g).append(role.name)
    return groups, list(p.ratios)


def check_resolved(cfg: Config) -> None:
    """A cluster is built from a config whose device and dtypes start-up made concrete
    (`tandem.runtime.startup.place`, `tandem.devices.resolve`): a program error otherwise."""
    if "auto" in (cfg.run.device, cfg.train.dtype, cfg.rollout.dtype):
        raise TandemError(
            "A cluster was asked for with run.device, train.dtype or rollout.dtype still 'auto': "
            "resolve the config first (tandem.runtime.startup.place, or tandem.devices.resolve)."
        )


def check_resources(cfg: Config, have: dict[str, float], where: str) -> None:
    """placement.num_cpus / num_gpus within what `where` (the Ray cluster, this machine) has (0 = all
    of it), or a TandemError now: Ray would wait run.timeout_s for a reservation it can never make,
    and a run in one process would divide CPUs it does not have."""
    for key, asked, unit in (
        ("placement.num_cpus", cfg.placement.num_cpus, "CPU"),
        ("placement.num_gpus", cfg.placement.num_gpus, "GPU"),
    ):
        if asked > have.get(unit, 0.0) + 1e-6:
            raise TandemError(
                f"Config '{key}' asks for {asked:g} {unit}s, but {where} has "
                f"{have.get('CPU', 0.0):g} CPUs and {have.get('GPU', 0.0):g} GPUs. Set it to what exists "
                "(0 = all of it) or join a larger cluster (ray.address)."
            )


def plan(cfg: Config, total_cpus: float, total_gpus: float = 0) -> list[Slot]:
    """One Slot per actor, each role's in rank order; raises when a share is too small to use.

    total_gpus counts only with run.device=cuda; it is what the plan spreads, not checked against
    the cluster (`check_fits` does that).
    """
    counts = role_counts(cfg)
    if cfg.run.device != "cuda":
        return _on_ray_grid(_grouped(cfg, counts, total_cpus, 0.0))
    if total_gpus <= 0:
        raise TandemError(
            "run.device=cuda but there are no GPUs to place roles on (placement.num_gpus and the Ray "
            "cluster give 0). Give Ray GPUs or set run.device=cpu."
        )
    if cfg.placement.groups:
        slots = _grouped(cfg, counts, total_cpus, total_gpus)
    else:
        slots = _colocated_on_gpus(counts, total_cpus, total_gpus)
    _check_nccl(cfg, slots)
    return _on_ray_grid(slots)


def _on_ray_grid(slots: list[Slot]) -> list[Slot]:
    for s in slots:
        s.cpus, s.gpus = ray_amount(s.cpus), ray_amount(s.gpus)
    return slots


def _grouped(cfg: Config, counts: dict[str, int], total_cpus: float, total_gpus: float) -> list[Slot]:
    """Each task group's share split among its actors, one bundle per actor (on cpu, also colocated)."""
    groups, ratios = _task_groups(cfg)
    colocated = not cfg.placement.groups
    slots: list[Slot] = []
    for group, ratio in zip(groups, ratios, strict=True):
        actors = sum(counts[r] for r in group)
        if actors == 0:
            tasks = [ROLES.get(r).task for r in group]
            raise TandemError(
                f"Placement group {tasks} gets {ratio:.0%} of the CPUs but runs nothing "
                f"(ref_logp needs algo.kl_coef > 0, critic algo.adv_estimator=gae)."
            )
        who = f"Placement group {[ROLES.get(r).task for r in group]}"
        cpus = _enough(ratio * total_cpus / actors, who, "CPU", actors)
        gpus = _gpu_part(ratio * total_gpus / actors, who, actors) if total_gpus else 0.0
        threads = max(1, round(total_cpus if colocated else cpus))
        for role in group:
            gpu_engine = not total_gpus and role == "rollout" and ENGINES.get(cfg.rollout.engine).needs_gpu
            own = 1.0 if gpu_engine else gpus  # with the rest on the CPU, vLLM still needs a GPU of its own
            for rank in range(counts[role]):
                slots.append(Slot(role, rank, cpus, threads, bundle=len(slots), gpus=own))
    return slots


def _gpu_part(each: float, who: str, actors: int) -> float:
    """An actor's GPU amount in a task group: whole GPUs, or 1/k of one."""
    each = _enough(each, who, "GPU", actors)
    if each >= 1 - 1e-9:
        return float(math.floor(each + 1e-9))  # Ray gives one actor 1 or 2 GPUs, never 1.5
    # k actors at 1/k fill a GPU exactly; at 2/3 each, three actors on two GPUs would not fit.
    return 1 / math.ceil(1 / each - 1e-9)


def _enough(each: float, who: str, resource: str, actors: int) -> float:
    if each < MIN_SHARE:
        raise TandemError(
            f"{who} gets {each * actors:.3g} {resource}s for {actors} actors ({each:.3g} each): too "
            f"little. Raise its ratio or placement.num_{resource.lower()}s, lower the worker counts, "
            f"or give Ray more {resource}s."
        )
    return each


def _colocated_on_gpus(counts: dict[str, int], total_cpus: float, total_gpus: float) -> list[Slot]:
    """One bundle per GPU; the i-th actor of every role on bundle i % gpus, sharing it equally."""
    if total_gpus != int(total_gpus):
        raise TandemError(
            f"Colocated roles take one bundle per GPU, so the GPU count must be whole; got "
            f"{total_gpus:g}. Set placement.num_gpus to a whole number or use placement.groups."
        )
    n = int(total_gpus)
    on_bundle = [0] * n
    for role in placed_roles():
        for rank in range(counts[role]):
            on_bundle[rank % n] += 1
    cpus = total_cpus / n  # per bundle, so a bundle fits a node with its GPU's share of the CPUs
    _enough(cpus / max(on_bundle), "Each GPU's bundle", "CPU", max(on_bundle))
    return [
        Slot(role, rank, cpus / on_bundle[b], max(1, round(cpus)), bundle=b, gpus=1 / on_bundle[b])
        for role in placed_roles()
        for rank in range(counts[role])
        for b in [rank % n]
    ]


def _check_nccl(cfg: Config, slots: list[Slot]) -> None:
    """NCCL refuses a communicator with two ranks on one GPU; catch it here, not at the first step."""
    train = [s for s in slots if s.role == "train"]
    critic = [s for s in slots if s.role == "critic"]
    worlds = {"the train workers (train.num_workers)": train, "the critic's ranks": critic}
    if TRANSPORTS.get(cfg.sync.transport).collective:
        rollouts = [s for s in slots if s.role == "rollout"]
        worlds["train rank 0 and the rollout workers (sync.transport=broadcast)"] = train[:1] + rollouts
    for name, ranks in worlds.items():
        if len(ranks) < 2:
            continue
        if cfg.placement.groups:  # one bundle each: a part of a GPU may share it with anyone
            shared = min(s.gpus for s in ranks) < 1
            where = f"{min(s.gpus for s in ranks):.3g} GPU each"
        else:
            shared = len({s.bundle for s in ranks}) < len(ranks)
            where = f"{len({s.bundle for s in ranks})} GPUs (colocated: rank i on GPU i % gpus)"
        if shared:
            raise TandemError(
                f"NCCL needs one GPU per rank, but {name} are {len(ranks)} ranks on {where}. Give "
                f"each its own GPU: fewer workers, more GPUs (placement.num_gpus), a task group "
                f"with a whole GPU per actor, or sync.transport=object_store for the broadcast."
            )


def describe(slots: list[Slot]) -> str:
    parts = []
    for role in placed_roles():
        mine = [s for s in slots if s.role == role]
        if mine:
            gpu = f", {_amount([s.gpus for s in mine])} GPU" if any(s.gpus for s in mine) else ""
            cpu, threads = _amount([s.cpus for s in mine]), _amount([s.threads for s in mine])
            parts.append(f"{role} ×{len(mine)} ({cpu} CPU{gpu}, {threads} threads each)")
    return "; ".join(parts)


def _amount(values: list[float]) -> str:
    """'0.5', or '0.33-0.5' when the actors of a role got different amounts (colocated on GPUs)."""
    lo, hi = (f"{round(v, 2):g}" for v in (min(values), max(values)))
    return lo if lo == hi else f"{lo}-{hi}"


def bundles(slots: list[Slot]) -> list[dict[str, float]]:
    """The Ray resources of each placement-group bundle, index = Slot.bundle: its slots' sums."""
    out = [{"CPU": 0.0, "GPU": 0.0} for _ in range(max(s.bundle for s in slots) + 1)]
    for s in slots:
        out[s.bundle]["CPU"] += s.cpus
        out[s.bundle]["GPU"] += s.gpus
    return [{k: ray_amount(v) for k, v in b.items() if v > 0} for b in out]


def ray_amount(v: float) -> float:
    """v rounded down to Ray's resource step of 1e-4; the 1e-6 keeps ten 0.1s summing to 0.99999… at 1.
    Slots and bundles both use it, so an actor never asks for more than its bundle reserved."""
    return math.floor(v * 1e4 + 1e-6) / 1e4


def check_fits(slots: list[Slot], cpus: float, gpus: float) -> None:
    """Raise unless the plan's CPUs and GPUs, summed over all bundles, exist in the cluster.

    Ray would otherwise wait run.timeout_s for a reservation it can never make. Totals only: a
    bundle larger than any one node is still left to Ray.
    """
    asked = bundles(slots)
    want_cpus = sum(b.get("CPU", 0.0) for b in asked)
    want_gpus = sum(b.get("GPU", 0.0) for b in asked)
    if want_cpus <= cpus + 1e-6 and want_gpus <= gpus + 1e-6:
        return
    raise TandemError(
        f"The placement asks for {want_cpus:g} CPUs and {want_gpus:g} GPUs ({describe(slots)}), but "
        f"the Ray cluster has {cpus:g} CPUs and {gpus:g} GPUs. Lower placement.num_cpus / "
        f"placement.num_gpus to what exists (0 = all of it), lower rollout.num_workers or "
        f"train.num_workers, or set run.device=cpu."
    )
