"""Simulated workers: the Ray actors' methods, as the loop calls them, with time from the cost model.

Each answers what its actor answers (samples, metrics, timeline spans on the virtual clock) and
runs in the lanes its actor's concurrency groups give it: a rollout worker's "gen" lane runs one
generate call at a time (tandem's actor; `sim.generate_calls` lets it run more, as an engine
serving concurrent requests would), its "weights" lane receives pushes meanwhile; the others run
one call at a time. The simulator's samples carry lengths, not tokens: `response_ids` is a range
(only its length matters here) and `versions` one entry per policy version their tokens came from.
"""

import math

from tandem.algo.corrections import CORRECTIONS, OldSource, old_logprob_source
from tandem.config import Config
from tandem.controller.timeline import Span
from tandem.sample import Sample, Status
from tandem.sim.cluster import INF, Job
from tandem.sim.costs import Costs
from tandem.sim.engine import Engine, Seq
from tandem.sim.lengths import ResponseLengths

DONE_S = 1e-9  # a timed call this close to its end has ended (the clock's rounding)


class TimedWorker:
    """Calls that take a known time from their start: `cost(job)` full-speed seconds; `result(job,
    now)` at their end. Calls in different lanes progress side by side. A call that starts before
    the worker is up (`ready_at`: its process, imports and model, Calibration.startup_s) waits
    for it first."""

    lanes: dict[str, tuple[str, int]] = {}  # method -> (lane, width); the rest run in ("main", 1)
    compute: tuple[str, ...] = ()  # methods that occupy the worker's devices
    ready_at = 0.0  # virtual seconds

    def __init__(self, name: str, pool: str = "", demand: float = 1.0):
        self.name, self.pool, self.demand = name, pool, demand
        self.timed: dict[Job, float] = {}  # running call -> full-speed seconds left

    def lane(self, method: str) -> tuple[str, int]:
        return self.lanes.get(method, ("main", 1))

    def begin(self, job: Job, now: float) -> None:
        self.timed[job] = self.starting(now) + self.cost(job)

    def starting(self, now: float) -> float:
        """Seconds a call starting now waits for the worker to be up."""
        return max(self.ready_at - now, 0.0)

    def until_next(self) -> float:
        return min(self.timed.values(), default=INF)

    def advance(self, dt: float, now: float) -> list[Job]:
        ended = []
        for job in list(self.timed):
            self.timed[job] -= dt
            if self.timed[job] <= DONE_S:
                del self.timed[job]
                job.result = self.result(job, now)
                ended.append(job)
        return ended

    def computing(self) -> bool:
        return any(j.method in self.compute for j in self.timed)

    def cost(self, job: Job) -> float:
        return 0.0

    def result(self, job: Job, now: float):
        return None

    def span(self, kind: str, job: Job, now: float) -> Span:
        return Span(kind, self.name, job.start, now)


class SimRollout(TimedWorker):
    """A rollout worker: an `Engine` for generate calls; pushes staged and applied per
    rollout.on_update (drain: before the next call; abort: the running calls return their
    partial samples now; continue: the next decode step uses the new weights)."""

    compute = ("sleep",)

    def __init__(
        self,
        name: str,
        engine: Engine,
        costs: Costs,
        lengths: ResponseLengths,
        cfg: Config,
        colocated: bool,
        width: int = 1,
        pool: str = "",
        demand: float = 1.0,
    ):
        super().__init__(name, pool, demand)
        self.engine, self.costs, self.lengths, self.colocated = engine, costs, lengths, colocated
        self.on_update, self.call_s = cfg.rollout.on_update, costs.cal.call_s
        self.lanes = {"receive_weights": ("weights", 1), "join": ("weights", 1)}
        self.width = width
        self.calls: dict[Job, int] = {}  # generate calls running -> their sequences still decoding
        self.staged: int | None = None  # a pushed version not yet in use
        self.asleep = False

    def lane(self, method: str) -> tuple[str, int]:
        return self.lanes.get(method, ("gen", self.width))

    def begin(self, job: Job, now: float) -> None:
        if job.method != "generate":
            return super().begin(job, now)
        samples, params, _ = job.args
        if self.staged is not None:  # applied between calls, whatever the policy
            self.engine.swap(self.staged)
            self.staged = None
        stall = self.starting(now) + self.call_s + (self.costs.wake_s() if self.asleep else 0.0)
        self.asleep = False
        seqs, groups = [], set()
        for s in samples:
            cap = min(params.max_new_tokens, s.max_new_tokens or params.max_new_tokens)
            target = cap if params.decode_past_eos else min(cap, self.lengths.of(s))
            done = len(s.response_ids)
            prompt = len(s.prompt_ids) if s.group_id not in groups or done else 0  # one prefill per group
            groups.add(s.group_id)
            seqs.append(Seq(s, job, max(target, done), done, len(s.prompt_ids) + done, prompt + done))
        self.calls[job] = len(seqs)
        job.state["cap"] = params.max_new_tokens
        if not seqs:
            self.timed[job] = stall
            return
        self.engine.add(seqs, stall)

    def until_next(self) -> float:
        return min(super().until_next(), self.engine.until_next())

    def advance(self, dt: float, now: float) -> list[Job]:
        ended = super().advance(dt, now)
        for seq in self.engine.advance(dt):
            self._finish(seq.sample, seq.target, Status.FINISHED, job=seq.owner)
            self.calls[seq.owner] -= 1
            if self.calls[seq.owner] == 0:
                ended.append(self._return(seq.owner, now))
        for job in [j for j in ended if j.method == "receive_weights"]:
            ended += self._stage(job.args[1], now)
        return ended

    def computing(self) -> bool:
        return self.engine.busy() or super().computing()

    def cost(self, job: Job) -> float:
        if job.method == "receive_weights":
            return self.costs.push_s(self.colocated)
        if job.method == "sleep":
            return self.costs.sleep_s()
        return 0.0

    def result(self, job: Job, now: float):
        if job.method == "generate":  # a call with no samples
            return self._return(job, now, pop=False).result
        if job.method == "sleep":
            self.asleep = True
            kv = self.engine.kv_tokens * self.costs.kv_bytes_per_token
            metrics = {"memory/engine_bytes": self.costs.weight_bytes + kv}
            metrics |= {"perf/sleep_s": self.costs.sleep_s(), "perf/wake_s": self.costs.wake_s()}
            return metrics, self.span("sleep", job, now)
        if job.method == "receive_weights":
            return self.span("sync", job, now)
        if job.method == "apply_pending":
            return self.engine.version
        return None

    def _stage(self, version: int, now: float) -> list[Job]:
        """A push arrived -> the generate calls it ends (rollout.on_update=abort)."""
        if not self.calls or self.on_update == "drain":
            self.staged = version if self.calls else None
            if not self.calls:
                self.engine.swap(version)
            return []
        if self.on_update == "continue":
            self.engine.swap(version)
            return []
        for seq in self.engine.take(set(self.calls)):  # abort: what they have, partial
            self._finish(seq.sample, int(seq.done), Status.ABORTED, job=seq.owner)
        self.engine.swap(version)
        return [self._return(job, now) for job in list(self.calls)]

    def _finish(self, s: Sample, tokens: int, status: Status, job: Job) -> None:
        s.response_ids = range(tokens)  # type: ignore[assignment]  # lengths only: see the module doc
        s.status = status
        if status == Status.ABORTED:
            s.finish_reason = "abort"
        else:
            s.finish_reason = "length" if tokens >= job.state["cap"] else "stop"

    def _return(self, job: Job, now: float, pop: bool = True) -> Job:
        if pop:
            self.calls.pop(job)
        else:
            self.calls.pop(job, None)
        samples, _, kind = job.args
        job.result = (samples, self.span(kind, job, now))
        return job


class DeviceWorker(TimedWorker):
    """A worker whose calls run on `devices` of the trainer's kind: the trainer, reference, critic."""

    def __init__(
        self,
        name: str,
        costs: Costs,
        devices: float,
        cfg: Config,
        pool: str = "",
        demand: float = 1.0,
        colocated: bool = False,
    ):
        """colocated: its devices are the rollout engines' too (`Costs.train_rate`)."""
        super().__init__(name, pool, demand)
        self.costs, self.devices, self.cfg, self.colocated = costs, devices, cfg, colocated


class SimTrainer(DeviceWorker):
    """The train workers, as one: a step's forward/backward (and π_old's forward where tandem's
    trainer recomputes it) on all the trainer's devices; rank 0's share of a push."""

    compute = ("train_step", "send_weights")
    version = 0  # of the weights it holds: one more each train step

    @property
    def source(self) -> OldSource:
        """Where π_old comes from, by the config's corrections (`old_logprob_source`)."""
        return old_logprob_source(self.cfg.algo.corrections, self.cfg.algo.prox_logprob)

    def recomputes(self, batch: list[Sample]) -> bool:
        """π_old needs a forward of its own, by `tandem.train.worker`'s rule: unless bypassed or
        interpolated, or the step is exactly on-policy with one update."""
        if self.source is not OldSource.RECOMPUTE:
            return False
        t = self.cfg.train
        one_update = t.epochs == 1 and (t.mini_batch_size or len(batch)) >= len(batch)
        on_policy = all(v == self.version for s in batch for v in s.versions)
        masking = any(CORRECTIONS.traits(n).masks for n in self.cfg.algo.corrections)
        return not (one_update and on_policy and not masking)

    def cost(self, job: Job) -> float:
        if job.method == "train_step":
            batch = job.args[0]
            lengths = [len(s.prompt_ids) + len(s.response_ids) for s in batch]
            t = self.cfg.train
            updates = t.epochs * math.ceil(len(batch) / (t.mini_batch_size or len(batch)))
            g, shared = self.devices, self.colocated
            logp = self.costs.forward_s(lengths, g, shared) if self.recomputes(batch) else 0.0
            job.state["logp"] = logp
            return self.costs.cal.call_s + logp + self.costs.train_s(lengths, g, updates, shared)
        if job.method == "send_weights":
            return self.costs.pack_s()
        return 0.0

    def result(self, job: Job, now: float):
        if job.method == "train_step":
            self.version += 1
            logp = job.state["logp"]
            spans = [Span("train", self.name, job.start, now)]
            if logp:
                spans.insert(0, Span("logp", self.name, job.start, job.start + logp))
            return {"timing_s/logp": logp, "actor/old_logprob_source/recompute": float(logp > 0)}, spans
        if job.method == "send_weights":
            return None, self.span("sync", job, now)
        if job.method == "load":
            return self.version
        return self.span(job.method, job, now) if job.method == "save" else None


class SimReward(TimedWorker):
    """The reward pool: a fixed time per sample; rewards 0 or 1, by a hash of the sample's key."""

    def __init__(self, name: str, costs: Costs, seed: int):
        super().__init__(name)
        self.costs, self.seed = costs, seed

    def cost(self, job: Job) -> float:
        return self.costs.cal.call_s + len(job.args[0]) * self.costs.cal.reward_s_per_sample

    def result(self, job: Job, now: float):
        samples = job.args[0]
        kind = job.args[1] if len(job.args) > 1 else "reward"
        for s in samples:
            s.reward = float(hash((self.seed, s.group_id, s.index)) % 2)
        return samples, {}, self.span(kind, job, now)


class SimForward(DeviceWorker):
    """The reference worker (`score`) or a critic (`estimate`, `train_step`): forwards (and the
    critic's update) over the batch on its devices."""

    compute = ("score", "estimate", "train_step")

    def cost(self, job: Job) -> float:
        if job.method not in self.compute:
            return 0.0
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in job.args[0]]
        if job.method == "train_step":
            return self.costs.cal.call_s + self.costs.train_s(lengths, self.devices, 1, self.colocated)
        return self.costs.cal.call_s + self.costs.forward_s(lengths, self.devices, self.colocated)

    def result(self, job: Job, now: float):
        if job.method == "score":  # the reference or the teacher: its role names the span
            return job.args[0], self.span(self.name.split("/")[0], job, now)
        if job.method == "estimate":
            return job.args[0], {}, self.span("values", job, now)
        if job.method == "train_step":
            return {}, [self.span("critic", job, now)]
        return None
