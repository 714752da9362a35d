"""The controller: one event loop drives every mode over a cluster (`tandem.controller.protocol`).

The driver holds no model. It admits prompt groups into generation as the rollout buffer allows
(`tandem.buffer`: the staleness rule and the version fence), and reacts to whatever finishes next.
One training step, call by call (`calls.ROUTES` names each kind's role and worker method;
`Loop.handlers` its handler here):

    admit -> dispatch    GENERATE  rollout/i.generate      -> on_generate: a group is whole
                         REWARD    reward/0.score          -> on_reward: (dynamic sampling)
                                   (judge/0.score with reward.fn=judge)
                         REF       ref/0.score             -> on_scored (with algo.kl_coef > 0)
                         TEACHER   teacher/0.score         -> on_scored (with algo.distill.teacher)
                                   buffer.finish(group)    ... until a batch is ready:
    maybe_train          SLEEP     rollout/*.sleep         -> on_sleep (free_memory_during_train)
                         VALUES    critic/*.estimate       -> on_values (gae: values, advantages)
                         TRAIN     train/*.train_step      -> on_train: the last rank -> version+1,
                                   critic/*.train_step        log_step, then:
    push_weights         SEND      train/*.send_weights    -> on_send
    deliver              RECEIVE   rollout/*.receive_weights -> on_receive: all -> published
    validation           VAL, VAL_REWARD (held-out prompts first in the queue) -> on_val_reward

Modes only change the admission:

    sync          max_staleness=0, whole batches: generate, then train, strictly on-policy
    one_step_off  max_staleness=k (generate_ahead_steps), whole batches: batch n+k generates while n trains
    async         max_staleness=k, groups stream in chunks of rollout.chunk_groups

It blocks on the cluster's `wait_next` (never sleep-polls) with a timeout that names what it waited
for. The cluster is Ray's actors (`tandem.runtime.cluster.RayCluster`) or simulated workers on a
virtual clock (`tandem.sim`). A dead rollout worker is restarted and re-synced (RESYNC); restarts,
stops, checkpoints and resume are `tandem.controller.recovery`'s.
"""

import sys
from collections import deque
from pathlib import Path

from tandem.buffer import RolloutBuffer
from tandem.config import Config
from tandem.config.sampling import sampling_params
from tandem.controller.calls import GENERATING, ROUTES, SCORERS, Call, Kind
from tandem.controller.checkpoint import Checkpoints
from tandem.controller.dynamic_sampling import DynamicSampling
from tandem.controller.inputs import Data
from tandem.controller.lengths import TailLengths
from tandem.controller.protocol import Cluster, Done, Handle, WorkerDied
from tandem.controller.recovery import Recovery, Stopped
from tandem.controller.slots import RolloutSlots
from tandem.controller.stats import StepMetrics, clipped_warning
from tandem.controller.timeline import Timeline
from tandem.controller.validation import Validation
from tandem.errors import TandemError
from tandem.rollout.group import make_groups
from tandem.rollout.sampler import request_seed
from tandem.sample import Sample, Status, episodes
from tandem.sync import TRANSPORTS

STOP_POLL_S = 1.0  # the longest the loop waits on the cluster before it looks for a stop signal


class Loop(Recovery):
    def __init__(self, cfg: Config, data: Data, cluster: Cluster):
        self.cfg, self.data, self.cluster = cfg, data, cluster
        r, rollouts = cfg.run, cluster.names["rollout"]
        staleness = {"sync": 0, "one_step_off": r.generate_ahead_steps, "async": r.max_staleness}[r.mode]
        self.buffer = RolloutBuffer(cfg.rollout.batch_size, staleness, whole_batches=r.mode != "async")
        self.params = sampling_params(cfg, cfg.rollout.temperature)
        self.params.decode_past_eos = cfg.rollout.length_tail_alpha > 0
        self.val_params = sampling_params(cfg, cfg.rollout.val_temperature)
        self.lengths = TailLengths(cfg.rollout.length_tail_alpha, cfg.rollout.max_new_tokens, r.seed)
        self.collective = TRANSPORTS.get(cfg.sync.transport).collective  # broadcast: no restarts
        self.version = self.published = 0  # the trainers' version; the one every rollout worker holds
        self.pending: dict[Handle, Call] = {}  # everything in flight
        self.work: deque[tuple[Kind, list[Sample], int]] = deque()  # (kind, samples, version) to generate
        self.slots = RolloutSlots(len(rollouts), cfg.rollout.calls_per_worker)
        self.validation = Validation(data.val_prompts, data.val_ids, len(rollouts), self.seeded)
        self.groups: dict[int, list[Sample]] = {}  # finished samples of groups still generating
        self.next_group = 0
        self.training = 0  # train ranks (and the critic) still running the current step
        self.train_metrics: dict[str, float] = {}  # the ranks' (all-reduced, equal) and the critic's
        self.receiving: dict[int, int] = {}  # version -> rollout workers yet to ack it
        self.last_handle: Handle = None  # the latest push's handle, for re-syncing a restarted worker
        self.undelivered: deque[tuple[int, Handle]] = deque()  # (version, handle) pushed, not yet received
        self.sampling = None  # DAPO's dynamic sampling (algo.filter_groups)
        if cfg.algo.filter_groups:
            self.sampling = DynamicSampling(cfg.rollout.batch_size, cfg.algo.max_filter_rounds)
        self.stats = StepMetrics(filtering=self.sampling is not None)
        self.timeline = Timeline(cluster.names, start=cluster.now())
        self.on_step = None  # a callback(version) after each train step (tests use it)
        self.checkpoints = Checkpoints(Path(r.out_dir) / r.name, r.keep_checkpoints)
        self.first_version = 0  # the version this process started from (a resume's checkpoint)
        self.stop_signal: str | None = None  # SIGINT / SIGTERM seen: save and stop at the step's end
        self.handlers = {  # what the loop does when a call of each kind comes back
            Kind.GENERATE: self.on_generate,
            Kind.REWARD: self.on_reward,
            Kind.REF: self.on_scored,
            Kind.TEACHER: self.on_scored,
            Kind.SLEEP: self.on_sleep,
            Kind.VALUES: self.on_values,
            Kind.TRAIN: self.on_train,
            Kind.SEND: self.on_send,
            Kind.RECEIVE: self.on_receive,
            Kind.RESYNC: self.on_resync,
            Kind.VAL: self.on_val,
            Kind.VAL_REWARD: self.on_val_reward,
        }

    # -- admission and dispatch ------------------------------------------------------------------
    def admit(self) -> None:
        """Start as many new groups as the buffer allows, in chunks for the rollout workers."""
        b, n = self.cfg.rollout.batch_size, self.cfg.rollout.n
        room = self.room()
        workers = len(self.cluster.names["rollout"])
        chunk = self.cfg.rollout.chunk_groups if self.cfg.run.mode == "async" else -(-b // workers)
        while room > 0:
            prompts, ids = self.data.train.next_batch(min(chunk, room))
            samples = self.seeded(make_groups(prompts, ids, n, first_group=self.next_group))
            if self.params.decode_past_eos:
                self.lengths.assign(samples)
            for g in range(len(prompts)):
                self.buffer.start(self.next_group + g, self.published)
            self.next_group += len(prompts)
            room -= len(prompts)
            if self.sampling:
                self.stats.count("filter/extra_prompts", self.sampling.refilled(len(prompts)))
            self.work.append((Kind.GENERATE, samples, self.published))

    def room(self) -> int:
        """Groups that may start now, under the published version."""
        limit = self.cfg.run.steps * self.cfg.rollout.batch_size - self.buffer.started
        return min(self.buffer.admissible(self.published), limit)

    def seeded(self, samples: list[Sample]) -> list[Sample]:
        """run.deterministic: each sample its own sampling seed, so its tokens do not depend on
        which worker or batch generates it."""
        if self.cfg.run.deterministic:
            for s in samples:
                s.seed = request_seed(self.cfg.run.seed, s.group_id, s.index)
        return samples

    def dispatch(self) -> None:
        """Hand queued work to rollout workers with a free slot, least loaded first."""
        while self.work and (i := self.slots.pick()) is not None:
            kind, samples, version = self.work.popleft()
            params = self.val_params if kind == Kind.VAL else self.params
            worker = self.cluster.names["rollout"][i]
            self.call(Call(kind, worker, samples, version, i), samples, params, kind.value)
            self.slots.took(i)

    def call(self, call: Call, *args, until_restarted: bool = False) -> Handle:
        """`call.worker.<call.method>(*args)`, in flight until its result comes back to its kind's
        handler."""
        handle = self.cluster.submit(call.worker, call.method, *args, until_restarted=until_restarted)
        self.pending[handle] = call
        return handle

    def call_role(self, role: str, kind: Kind, batch: list[Sample], *args) -> list[Handle]:
        """The same call on every rank of `role`, at the current version."""
        workers = enumerate(self.cluster.names.get(role, []))
        calls = [Call(kind, w, batch, self.version, rank) for rank, w in workers]
        return [self.call(c, *args) for c in calls]

    def maybe_train(self) -> None:
        if self.training or self.version >= self.cfg.run.steps:
            return
        groups = self.buffer.next_batch(self.version)
        if groups is None:
            return
        # In group order, not finishing order: the trainers' micro-batches, and so their rounding,
        # are then the same whichever worker finished first.
        batch = [s for g in sorted(groups, key=lambda g: g[0].group_id) for s in g]
        self.training = len(self.cluster.names["train"]) + len(self.cluster.names.get("critic", []))
        self.train_metrics = {}
        if not self.cfg.rollout.free_memory_during_train:
            return self.estimate(batch)
        self.call_role("rollout", Kind.SLEEP, batch)  # the engines free the device first

    def on_sleep(self, call: Call, result) -> None:
        metrics, span = result
        self.timeline.add(span)
        self.stats.slept(metrics)
        self.slept(call)

    def slept(self, call: Call) -> None:
        """A rollout worker is done with its sleep call: the train step starts after the last one."""
        if not any(c.kind == Kind.SLEEP for c in self.pending.values()):
            self.estimate(call.samples)

    def estimate(self, batch: list[Sample]) -> None:
        """With a critic (gae), its values and advantages come first; else the step starts now."""
        if not self.cluster.names.get("critic"):
            return self.start_train(batch)
        # each critic rank computes its share of the values
        self.call_role("critic", Kind.VALUES, batch, self.cluster.share(batch))

    def on_values(self, call: Call, result) -> None:
        """Every critic rank returns the same advantages (the values are all-reduced); the step
        starts with the last one's."""
        batch, metrics, span = result
        self.timeline.add(span)
        self.train_metrics.update(metrics)
        if not any(c.kind == Kind.VALUES for c in self.pending.values()):
            self.start_train(batch)

    def start_train(self, batch: list[Sample]) -> None:
        shared = self.cluster.share(batch)
        self.call_role("train", Kind.TRAIN, batch, shared)
        self.call_role("critic", Kind.TRAIN, batch, shared)  # beside the policy's update

    # -- the loop ----------------------------------------------------------------------------------
    def run(self, logger) -> dict[str, float]:
        """Train up to run.steps versions; `logger.log(step, metrics)` gets each step's and
        validation's metrics, `logger.log_batch(step, group_ids)` the groups each step trained."""
        self.logger = logger
        self.stats.start(self.cluster.now())
        if self.version == 0 or self.validates(self.version):
            self.request_validation(self.version)
        while not self.finished():
            if self.stop_signal and not self.training:
                self.stop()
            self.admit()
            self.dispatch()
            self.maybe_train()
            self.deliver()
            self.handle(*self.wait())
        return self.summary()

    def finished(self) -> bool:
        done = self.version >= self.cfg.run.steps
        return done and not self.pending and not self.work and not self.validation.due

    def wait(self) -> tuple[Done, Call]:
        if not self.pending:  # nothing can arrive: a bug in the loop, never a reason to hang
            raise TandemError(
                f"The controller has nothing in flight at version {self.version} (published "
                f"{self.published}): queued work {len(self.work)}, {self.slots}, buffer "
                f"{self.buffer.stats()}, receiving {self.receiving}."
            )
        start = self.cluster.now()
        while (done := self.cluster.wait_next(self.pending, STOP_POLL_S)) is None:
            if self.stop_signal and not self.training:
                self.stop()
            if self.cluster.now() - start >= self.cfg.run.timeout_s:
                waiting = ", ".join(sorted({str(c) for c in self.pending.values()}))
                raise TandemError(
                    f"Nothing finished in run.timeout_s={self.cfg.run.timeout_s:g} s; waiting for: {waiting}."
                )
        return done, self.pending.pop(done.handle)

    def handle(self, done: Done, call: Call) -> None:
        if isinstance(done.error, WorkerDied):
            return self.on_worker_died(call, done.error)
        if isinstance(done.error, TandemError):  # the worker's own paragraph for the user
            raise done.error
        if done.error is not None:
            raise TandemError(f"{call} failed:\n{done.error}") from None
        self.handlers[call.kind](call, done.result)

    # -- handlers, one per kind of call ------------------------------------------------------------
    def on_generate(self, call: Call, result) -> None:
        samples, span = result
        self.timeline.add(span)
        self.slots.returned(call.rank)
        partial = [s for s in samples if s.status == Status.ABORTED]
        if partial:  # re-submitted as prompt + partial response, ahead of new prompts
            self.stats.count("rollout/aborted", len(partial))
            self.work.appendleft((Kind.GENERATE, partial, call.version))
        finished = [s for s in samples if s.status == Status.FINISHED]
        for s in finished:  # an episode's extra samples (episode_of) ride with their group
            self.groups.setdefault(s.group_id, []).append(s)
        done = []
        for gid in dict.fromkeys(s.group_id for s in finished):
            if len(episodes(self.groups[gid])) == self.cfg.rollout.n:
                done.extend(sorted(self.groups.pop(gid), key=lambda x: x.index))
        if done:
            self.score(done, call.version)

    def score(self, samples: list[Sample], version: int) -> None:
        worker = ROUTES[Kind.REWARD].worker(self.cluster.names)
        self.call(Call(Kind.REWARD, worker, samples, version), samples)

    def on_reward(self, call: Call, result) -> None:
        samples, metrics, span = result
        self.timeline.add(span)
        self.stats.rewarded(samples, metrics)
        if self.sampling:
            samples, dropped = self.sampling.keep(samples, self.buffer, self.version)
            self.stats.count("filter/dropped_groups", dropped)
            if not samples:
                return
        self.next_score(samples, call.version, after=None)

    def next_score(self, samples: list[Sample], version: int, after: Kind | None) -> None:
        """The per-token scores a rewarded group still needs, one role after another (the
        reference's, then the teacher's, where the run has them); then the group is finished."""
        order = SCORERS[SCORERS.index(after) + 1 :] if after else SCORERS
        for kind in order:
            if worker := ROUTES[kind].worker(self.cluster.names):
                self.call(Call(kind, worker, samples, version), samples)
                return
        self.finish_groups(samples)

    def on_scored(self, call: Call, result) -> None:
        samples, span = result
        self.timeline.add(span)
        self.next_score(samples, call.version, after=call.kind)

    def finish_groups(self, samples: list[Sample]) -> None:
        by_group: dict[int, list[Sample]] = {}
        for s in samples:
            by_group.setdefault(s.group_id, []).append(s)
        for gid, group in by_group.items():
            self.buffer.finish(gid, group)

    def on_train(self, call: Call, result) -> None:
        metrics, spans = result
        self.timeline.add(*spans)
        self.train_metrics.update(metrics)
        self.training -= 1
        if self.training:
            return
        self.version += 1
        if self.sampling:
            self.sampling.since_step = 0
        self.log_step(call.samples, self.train_metrics)
        if self.pushes(self.version):
            self.push_weights()
        if self.validates(self.version):
            self.request_validation(self.version)
        saved = None
        if self.cfg.run.save_every and self.version % self.cfg.run.save_every == 0:
            saved = self.save(f"step_{self.version}")
        if self.on_step is not None:
            self.on_step(self.version)
        if self.stop_signal and self.version < self.cfg.run.steps:
            raise Stopped(self.stop_signal, self.version, saved or self.save(f"step_{self.version}"))

    def validates(self, version: int) -> bool:
        every = self.cfg.run.val_every
        return version == self.cfg.run.steps or bool(every and version % every == 0)

    def pushes(self, version: int) -> bool:
        """Weights go out every sync.every versions, and for the versions validation runs on."""
        return version % self.cfg.sync.every == 0 or self.validates(version)

    def push_weights(self) -> None:
        # Every train rank takes part (under fsdp2 each tensor is gathered from all shards); rank 0 sends.
        sends = self.call_role("train", Kind.SEND, [], self.version)
        # The object store's receivers take the send's result (the cluster hands it over once the
        # send is done); broadcast receivers must run while the send runs, so they take none.
        self.last_handle = None if self.collective else sends[0]
        self.undelivered.append((self.version, self.last_handle))
        self.deliver()

    def deliver(self) -> None:
        """The pushed versions to the rollout workers, oldest first. run.deterministic holds one back
        while prompts admitted under older weights may still start or are generating, so batch i is
        always generated by version i - k whatever the timing (the fixed pipeline schedule)."""
        while self.undelivered:
            version, handle = self.undelivered[0]
            if self.cfg.run.deterministic and (self.room() > 0 or self.generating_before(version)):
                return
            self.undelivered.popleft()
            self.receiving[version] = len(self.cluster.names["rollout"])
            for i, worker in enumerate(self.cluster.names["rollout"]):
                call = Call(Kind.RECEIVE, worker, version=version, rank=i)
                self.call(call, handle, version)

    def generating_before(self, version: int) -> bool:
        """Generate or validation calls under weights older than `version`, queued or running."""
        running = (c.version for c in self.pending.values() if c.kind in GENERATING)
        return any(v < version for _, _, v in self.work) or any(v < version for v in running)

    def on_send(self, call: Call, result) -> None:
        self.timeline.add(result[1])

    def on_receive(self, call: Call, span) -> None:
        self.timeline.add(span)
        self.received(call.version)

    def received(self, version: int) -> None:
        """One rollout worker is done with a push (or died, and gets re-synced): publish when all are."""
        self.receiving[version] -= 1
        if self.receiving[version] == 0 and version == self.version and not self.cluster.restarts_workers:
            self.last_handle = None  # nobody will need it again: its buckets' memory goes now
        if self.receiving[version] == 0 and version > self.published:
            self.published = version
            self.start_validations()

    # -- validation: prompts at the front of the rollout queue, never in training data ------------
    def request_validation(self, version: int) -> None:
        self.validation.request(version)
        self.start_validations()

    def start_validations(self) -> None:
        for version, chunks in self.validation.ready(self.published):
            for c in reversed(chunks):
                self.work.appendleft((Kind.VAL, c, version))

    def on_val(self, call: Call, result) -> None:
        samples, span = result
        self.timeline.add(span)
        self.slots.returned(call.rank)
        batch = self.validation.returned(call.version, samples)
        if batch is not None:
            self.call(Call(Kind.VAL_REWARD, "reward/0", version=call.version), batch, "val_reward")

    def on_val_reward(self, call: Call, result) -> None:
        samples, metrics, span = result
        self.timeline.add(span)
        scored = self.validation.scored(call.version, samples, metrics)
        self.logger.log(call.version, scored)
        if scored["val/reward_errors"] >= len(samples):
            raise TandemError(
                f"Every reward of the {len(samples)} held-out samples of version {call.version} failed "
                f"(reward.fn={self.cfg.reward.fn!r}; the reward worker's log above says why), so no "
                "step could learn either: the run stops now rather than after run.steps steps."
            )

    # -- steps and the end --------------------------------------------------------------------------
    def log_step(self, batch: list[Sample], train: dict[str, float]) -> None:
        metrics = self.stats.step(batch, train, self.version, self.buffer, self.timeline, self.cluster.now())
        self.logger.log(self.version, metrics)
        self.logger.log_batch(self.version, sorted({s.group_id for s in batch}))
        if (warning := clipped_warning(metrics, self.cfg.rollout.max_new_tokens)) is not None:
            print(warning, file=sys.stderr)
        self.stats.check_learning(self.version, self.cfg.run.steps, self.first_version)
        if (
            self.cfg.run.deterministic
            and metrics.get("mismatch/logprob_abs_diff_max", 0.0)
            and all(s.version_span == (self.version - 1,) * 2 for s in batch if s.versions)
        ):
            raise TandemError(
                f"run.deterministic=true: step {self.version} trained on tokens its own version sampled, "
                "yet the engine's logprobs differ from the trainer's (mismatch/logprob_abs_diff_max "
                f"{metrics['mismatch/logprob_abs_diff_max']:.3g}, not 0), so the run stops instead of "
                "training on a promise it does not keep. The self-test at start passed, so a path it "
                "does not cover differs here: please report it with this machine's CPU or GPU "
                "(docs/determinism.md), and run without run.deterministic meanwhile."
            )

    def summary(self) -> dict[str, float]:
        trained = (self.cfg.run.steps - self.first_version) * self.cfg.rollout.batch_size * self.cfg.rollout.n
        return self.stats.summary(trained, self.validation.metrics, self.cfg.run.steps, self.cluster.now())
