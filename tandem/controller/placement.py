"""Placement: which CPUs each role's actors get, from `placement.groups` and `placement.ratios`.

Task names follow the seeds' pull request: `generate` (rollout workers), `actor_train` (train
workers, which also compute π_old, so `logp` goes with them), `ref_logp` (the reference worker).
A task group shares `ratio × cpus`; each actor in it gets an equal part as its own placement-group
bundle (so groups can span nodes) and as many torch threads as whole CPUs in its part. With no
groups every role is colocated: they share all CPUs, each with that many threads, and take turns.
GPUs: each rollout worker of rollout.engine=vllm reserves one; every other role runs on the CPU.
"""

from dataclasses import dataclass

from tandem.config import Config
from tandem.errors import TandemError

# The driver and the reward actor are light; the reward pool's processes run outside any bundle.
ROLES = ("generate", "actor_train", "ref_logp")


@dataclass
class Slot:
    """One actor's share: the bundle it lives in, its Ray CPU amount and torch thread count."""

    role: str
    rank: int
    cpus: float
    threads: int
    bundle: int = 0
    gpus: float = 0.0  # a rollout worker on rollout.engine=vllm takes one whole GPU


def role_counts(cfg: Config) -> dict[str, int]:
    return {
        "generate": cfg.rollout.num_workers,
        "actor_train": cfg.train.num_workers,
        "ref_logp": 1 if cfg.algo.kl_coef > 0 else 0,
    }


def _task_groups(cfg: Config) -> tuple[list[list[str]], list[float]]:
    p = cfg.placement
    if not p.groups:
        return [list(ROLES)], [1.0]
    groups = [[g] if isinstance(g, str) else list(g) for g in p.groups]
    groups = [[t for t in g if t != "logp"] for g in groups]  # logp runs inside actor_train
    if "ref_logp" not in {t for g in groups for t in g}:
        next(g for g in groups if "actor_train" in g).append("ref_logp")  # ref shares the trainers'
    return groups, list(p.ratios)


def plan(cfg: Config, total_cpus: float) -> list[Slot]:
    """One Slot per actor, bundles numbered in order; raises when a share is too small to use."""
    counts = role_counts(cfg)
    groups, ratios = _task_groups(cfg)
    colocated = not cfg.placement.groups
    slots: list[Slot] = []
    for group, ratio in zip(groups, ratios, strict=True):
        share = ratio * total_cpus
        actors = sum(counts[t] for t in group)
        if actors == 0:
            raise TandemError(
                f"Placement group {group} gets {ratio:.0%} of the CPUs but runs nothing "
                f"(ref_logp needs algo.kl_coef > 0)."
            )
        each = share / actors
        if each < 0.05:
            raise TandemError(
                f"Placement group {group} gets {share:.2f} CPUs for {actors} actors: too little. "
                f"Raise its ratio, lower the worker counts, or give Ray more CPUs."
            )
        threads = max(1, round(total_cpus if colocated else each))
        for task in group:
            gpus = 1.0 if task == "generate" and cfg.rollout.engine == "vllm" else 0.0
            for rank in range(counts[task]):
                slots.append(Slot(task, rank, each, threads, bundle=len(slots), gpus=gpus))
    return slots


def describe(slots: list[Slot]) -> str:
    parts = []
    for role in ROLES:
        mine = [s for s in slots if s.role == role]
        if mine:
            gpu = f", {mine[0].gpus:g} GPU" if mine[0].gpus else ""
            parts.append(f"{role} ×{len(mine)} ({mine[0].cpus:g} CPU{gpu}, {mine[0].threads} threads each)")
    return "; ".join(parts)


def bundle(slot: Slot) -> dict[str, float]:
    """The Ray resources of a slot's placement-group bundle."""
    return {"CPU": slot.cpus, **({"GPU": slot.gpus} if slot.gpus else {})}
