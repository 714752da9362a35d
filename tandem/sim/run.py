"""One simulated run: the real `Loop` and `RolloutBuffer` on a `SimCluster` built from the config.

The GPU count and the placement decide each role's devices: colocated (no placement.groups), every
role on all of them, time-shared; else each task group its ratio of them. Engines are
sim.tensor_parallel GPUs each, so rollout.num_workers = rollout GPUs / tensor_parallel; the train
workers are simulated as one on all the trainer's GPUs. With no GPU count (run.device=cpu) roles
get CPU threads as `tandem.runtime.placement` gives them, all on placement.num_cpus cores.
"""

import os
import statistics
from dataclasses import dataclass, field, replace

from tandem import devices
from tandem.config import Config
from tandem.controller.inputs import Data
from tandem.controller.loop import Loop
from tandem.data.loader import PromptLoader
from tandem.errors import TandemError
from tandem.model.config import ModelConfig, model_dir
from tandem.runtime import placement
from tandem.runtime.role_table import in_run
from tandem.sample import Prompt
from tandem.sim.cluster import SimCluster
from tandem.sim.costs import Calibration, Costs, Shape
from tandem.sim.engine import Engine
from tandem.sim.lengths import ResponseLengths, response_lengths
from tandem.sim.models import model_config
from tandem.sim.workers import SimForward, SimReward, SimRollout, SimTrainer, TimedWorker


@dataclass
class Result:
    """What one simulated run shows: steady-state figures over the steps after sim.warmup_steps (the
    pipeline filling) but the last (its draining: the loop admits no group beyond the run's last
    batch, so that batch waits for its own stragglers)."""

    label: str
    gpus: int  # 0: CPUs
    split: str  # e.g. "colocated", "train 0.5 / generate 0.5"
    step_s: float
    samples_per_s: float
    tokens_per_s: float
    run_samples_per_s: float  # the whole run, validations and pipeline fill included (the bench's figure)
    idle: dict[str, float] = field(default_factory=dict)  # role -> idle ratio
    staleness_mean: float = 0.0
    staleness_max: float = 0.0
    # a step's phases as verl's tables split it, per train step: the trainer's π_old forward, its
    # update (forward, backward, optimizer), and the rest of the step (waiting for samples, pushes,
    # sleep and wake): `gen` in verl's sync rows (with its few seconds of overhead), its async "wait"
    logp_s: float = 0.0
    update_s: float = 0.0
    wait_s: float = 0.0


class Recorder:
    """The loop's logger: keeps the train steps' metrics."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if "version" in metrics:
            self.steps.append(metrics)

    def log_batch(self, step: int, group_ids: list[int]) -> None:
        pass


def simulate_run(cfg: Config, label: str, gpus: int, calibration: Calibration) -> Result:
    """Run `cfg` on the simulated cluster of `gpus` GPUs (0: run.device=cpu) -> its figures."""
    cfg = devices.resolve(replace(cfg, run=replace(cfg.run, device="cuda" if gpus else "cpu")), gpus)
    cluster, split = build_cluster(cfg, gpus, calibration)
    loop = Loop(cfg, synthetic_data(cfg), cluster)
    rec = Recorder()
    summary = loop.run(rec)
    return summarize(cfg, label, gpus, split, rec.steps, summary)


def summarize(cfg: Config, label: str, gpus: int, split: str, steps: list[dict], summary: dict) -> Result:
    warm = min(cfg.sim.warmup_steps, len(steps) - 1)
    kept = steps[warm:-1] if len(steps) - warm > 1 else steps[warm:]
    wall = sum(r["timing_s/step"] for r in kept)
    samples = len(kept) * cfg.rollout.batch_size * cfg.rollout.n
    tokens = sum(r["perf/throughput_tokens_per_s"] * r["timing_s/step"] for r in kept)
    idle = "perf/idle_ratio/"
    roles = sorted({k.removeprefix(idle) for r in kept for k in r if k.startswith(idle)})
    logp = statistics.mean(r.get("timing_s/logp", 0.0) for r in kept)
    train = statistics.mean(r.get("timing_s/train", 0.0) for r in kept)  # its span includes π_old's
    return Result(
        label,
        gpus,
        split,
        step_s=wall / len(kept),
        samples_per_s=samples / wall,
        tokens_per_s=tokens / wall,
        run_samples_per_s=summary["perf/run_samples_per_s"],
        idle={role: statistics.mean(r[idle + role] for r in kept) for role in roles},
        staleness_mean=statistics.mean(r["staleness/mean"] for r in kept),
        staleness_max=max(r["staleness/max"] for r in kept),
        logp_s=logp,
        update_s=train - logp,
        wait_s=wall / len(kept) - train,
    )


def synthetic_data(cfg: Config) -> Data:
    """Prompts of sim.prompt_tokens tokens: only their lengths matter to the simulator."""
    ids = list(range(cfg.sim.prompt_tokens))
    train = [Prompt(text="") for _ in range(cfg.data.train_size)]
    loader = PromptLoader(train, [ids] * len(train), cfg.rollout.batch_size, cfg.data.shuffle, cfg.run.seed)
    val = [Prompt(text="") for _ in range(cfg.data.val_size)]
    return Data(loader, val, [ids] * len(val))


def shape_of(cfg: Config) -> Shape:
    return Shape.of(
        model_config(cfg.sim.model) if cfg.sim.model else ModelConfig.load(model_dir(cfg.model.path))
    )


@dataclass
class Layout:
    """Where the simulated workers compute: each engine's devices and the trainer's, the device pools
    they share and what each asks of its pool while computing."""

    engines: list[float]  # devices (GPUs or CPU threads) per engine
    trainer: float
    pools: dict[str, float]  # pool -> capacity
    pool: str  # the pool every worker computes on; "" = devices of its own
    engine_demand: list[float]
    train_demand: float


def layout(cfg: Config, gpus: int, share: dict[str, float], colocated: bool) -> Layout:
    """GPUs: engines of sim.tensor_parallel GPUs on the rollout's share, the trainer on its share
    (colocated: both time-share one pool of all of them). CPUs: threads as `placement.plan` gives
    them, every worker on placement.num_cpus cores."""
    if not gpus:
        cpus = cfg.placement.num_cpus or float(os.cpu_count() or 1)
        slots = placement.plan(cfg, cpus)
        engines = [float(x.threads) for x in slots if x.role == "rollout"]
        trainer = float(sum(x.threads for x in slots if x.role == "train"))
        return Layout(engines, trainer, {"cpus": cpus}, "cpus", engines, trainer)
    tp = cfg.sim.tensor_parallel
    rollout_gpus = share["generate"] * gpus
    count = round(rollout_gpus / tp)  # a ratio such as 1/3 reaches its whole count only to rounding
    if count < 1 or abs(count * tp - rollout_gpus) > 1e-3:
        raise TandemError(
            f"Config 'sim.tensor_parallel'={tp} does not divide the rollout's "
            f"{rollout_gpus:g} GPUs ({gpus} GPUs x its share {share['generate']:g}): pick a split "
            "(placement.ratios) or GPU count (sim.gpus) that gives whole engines."
        )
    pools, pool = ({"gpus": 1.0}, "gpus") if colocated else ({}, "")
    return Layout([float(tp)] * count, share["actor_train"] * gpus, pools, pool, [tp / gpus] * count, 1.0)


@dataclass
class Parts:
    """What the simulated workers are built from (`build_cluster`)."""

    cfg: Config
    gpus: int
    costs: Costs
    at: Layout
    lengths: ResponseLengths
    colocated: bool

    @property
    def trainer(self) -> tuple:
        """A trainer-like worker's devices, config, pool, demand and colocation."""
        return (self.at.trainer, self.cfg, self.at.pool, self.at.train_demand, self.colocated)


def build_cluster(cfg: Config, gpus: int, calibration: Calibration) -> tuple[SimCluster, str]:
    """The simulated workers of `cfg` on `gpus` GPUs (0: on placement.num_cpus CPUs), each role the
    run has (the roles table) built by its row's builder -> (cluster, a description of the split)."""
    share = _shares(cfg)
    colocated = devices.shares_gpus(cfg)
    parts = Parts(cfg, gpus, Costs(shape_of(cfg), calibration), layout(cfg, gpus, share, colocated),
                  response_lengths(cfg), colocated)  # fmt: skip
    workers: dict[str, TimedWorker] = {}
    names: dict[str, list[str]] = {}
    for role in in_run(cfg):
        built = role.simulator()(role.name, parts)
        workers.update({w.name: w for w in built})
        names[role.name] = [w.name for w in built]
    for w in workers.values():
        w.ready_at = calibration.startup_s  # the actors start together when the run does
    split = "colocated" if colocated else " / ".join(f"{k} {v:g}" for k, v in share.items())
    return SimCluster(workers, names, parts.at.pools, calibration.oversubscription_exponent), split


def sim_rollouts(role: str, p: Parts) -> list[TimedWorker]:
    """The engines the layout gives (on GPUs: the rollout's share / sim.tensor_parallel of them)."""
    out = []
    for i, (d, demand) in enumerate(zip(p.at.engines, p.at.engine_demand, strict=True)):
        kv = p.costs.kv_capacity_tokens(d, p.cfg.sim.kv_memory_fraction) if p.gpus else float("inf")
        engine = Engine(p.costs, d, p.cfg.rollout.max_batch_size, kv)
        name = f"{role}/{i}"
        out.append(SimRollout(name, engine, p.costs, p.lengths, p.cfg, p.colocated, p.cfg.sim.generate_calls,
                              p.at.pool, demand))  # fmt: skip
    return out


def sim_trainer(role: str, p: Parts) -> list[TimedWorker]:
    """The train workers as one, on all the trainer's devices."""
    return [SimTrainer(f"{role}/0", p.costs, *p.trainer)]


def sim_forward(role: str, p: Parts) -> list[TimedWorker]:
    """A worker that runs forwards on the trainer's devices (the reference, the critic): as one."""
    return [SimForward(f"{role}/0", p.costs, *p.trainer)]


def sim_reward(role: str, p: Parts) -> list[TimedWorker]:
    return [SimReward(f"{role}/0", p.costs, p.cfg.run.seed)]


def _shares(cfg: Config) -> dict[str, float]:
    """Each task's share of the devices: 1 each when colocated, else its group's ratio."""
    if not cfg.placement.groups:
        return {"actor_train": 1.0, "generate": 1.0}
    out = {}
    for group, ratio in zip(cfg.placement.groups, cfg.placement.ratios, strict=True):
        for task in [group] if isinstance(group, str) else group:
            out[task] = ratio
    if "generate" not in out or "actor_train" not in out:
        raise TandemError("Config 'placement.groups' must place generate and actor_train for the simulator.")
    return {"actor_train": out["actor_train"], "generate": out["generate"]}
