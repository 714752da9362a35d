"""How a run survives and continues: what the controller loop does when a worker dies, a call times
out or a stop signal comes, and how it saves and resumes (docs/resume.md).

A dead rollout worker is restarted by Ray and re-synced (RESYNC) with the newest weights, its
prompts queued again; any other death ends the run with the newest checkpoint to continue from.
A checkpoint holds the trainers' state (the files are `tandem.controller.checkpoint`'s) and the
driver's (`state_dict`): counters, the data cursor, the buffer and the groups still in flight,
which a resume puts back in the queue (`requeue`).
"""

from pathlib import Path
from typing import Any

from tandem.controller.calls import GENERATING, SCORERS, Call, Kind
from tandem.controller.checkpoint import load_workers, save_checkpoint
from tandem.controller.protocol import WorkerDied
from tandem.errors import TandemError
from tandem.rollout.group import make_groups
from tandem.sample import Sample, Status, episodes


class Stopped(Exception):
    """SIGINT / SIGTERM: the run saved a checkpoint at a step boundary and stops."""

    def __init__(self, signal: str, version: int, checkpoint: Path | None):
        super().__init__(f"{signal} at step {version}")
        self.signal, self.version, self.checkpoint = signal, version, checkpoint


class Recovery:
    """The restarts, stops, checkpoints and resume of the controller loop (`tandem.controller.loop.Loop`,
    which this is a base of): they read and change the loop's state (`version`, `pending`, `work`,
    `groups`, `slots`, `checkpoints`) and call its `call`, `push_weights`, `received`, `slept` and `score`."""

    # -- failures and stops -----------------------------------------------------------------------
    def stop(self) -> None:
        """SIGINT / SIGTERM while no train step runs: the trainers hold the last step boundary's
        weights, so save it now with whatever was in flight (a resume generates that again) -> Stopped."""
        latest = self.checkpoints.latest()
        if self.version > self.first_version and (latest is None or latest.name != f"step_{self.version}"):
            latest = self.save(f"step_{self.version}")
        raise Stopped(self.stop_signal, self.version, latest)

    def on_worker_died(self, call: Call, error: Exception) -> None:
        """A dead rollout worker is restarted by Ray: re-sync its weights, re-submit its prompts."""
        if not call.worker.startswith("rollout/") or self.collective:
            raise self.died(call.worker, f"during {call.kind.value} (version {call.version})", error)
        i = call.rank
        if call.kind == Kind.SLEEP:
            self.slept(call)  # it frees nothing now, and wakes with its restart
        if call.kind in GENERATING:
            self.slots.returned(i)
            self.work.appendleft((call.kind, call.samples, call.version))
        if call.kind == Kind.RECEIVE:
            self.received(call.version)  # the re-sync below brings it the newest weights
        if self.slots.syncing[i] and call.kind != Kind.RESYNC:
            return  # a re-sync is already on its way
        if not self.slots.syncing[i]:
            self.stats.count("rollout/restarts")
        if not self.slots.restarting(i):
            raise self.died(call.worker, "and could not be restarted", error)
        self.resync(i)

    def died(self, worker: str, when: str, error: Exception) -> TandemError:
        """The error that ends a run whose worker died: which one, and how to go on."""
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        why = ""
        if worker.startswith("rollout/"):
            why = " (with sync.transport=broadcast a restarted worker could not rejoin the weight broadcast)"
        latest = self.checkpoints.latest()
        then = (
            f"Continue from the newest checkpoint, {latest}, with run.resume=auto."
            if latest
            else "No checkpoint was written yet (run.save_every=N writes one every N steps)."
        )
        return TandemError(f"{worker} died {when}{why}: {reason} {then}")

    def resync(self, i: int) -> None:
        """Bring restarted rollout worker `i` the newest weights; it gets no work until then."""
        call = Call(Kind.RESYNC, self.cluster.names["rollout"][i], version=self.version, rank=i)
        self.call(call, self.last_handle, self.version, until_restarted=True)

    def on_resync(self, call: Call, span) -> None:
        self.timeline.add(span)
        if call.version < self.version:  # pushed while it restarted: its push went to the dead
            return self.resync(call.rank)  # process, and this re-sync brought an older version
        self.slots.resynced(call.rank)

    def timed_out(self, what: str) -> TandemError:
        return TandemError(
            f"The workers did not answer within run.timeout_s={self.cfg.run.timeout_s:g} s while {what}; "
            f"the newest complete checkpoint is {self.checkpoints.latest() or 'none yet'}."
        )

    # -- checkpoints and resume (the files are `tandem.controller.checkpoint`'s) ---------------------
    def save(self, name: str) -> Path:
        try:
            path, spans = save_checkpoint(self.cluster, self.cfg, self.checkpoints, name, self.state_dict())
        except TimeoutError:
            raise self.timed_out(f"writing checkpoint {name}") from None
        except WorkerDied as e:
            raise self.died(e.worker, f"while saving {name}", e) from None
        self.timeline.add(*spans)
        return path

    def resume(self, path: Path) -> None:
        """Continue from the checkpoint at `path`: the trainers load their state, the engines get its
        weights (before anything generates) and sampling streams, the groups that were in flight
        go back into the queue."""
        timeout = self.cfg.run.timeout_s
        try:
            state = load_workers(self.cluster, path, timeout)
            self.load_state_dict(state)
            self.push_weights()  # synchronously: nothing may generate on the initial weights
            self.cluster.get(list(self.pending), timeout)
        except TimeoutError:
            raise self.timed_out(f"resuming from {path}") from None
        self.pending.clear()
        self.receiving.clear()
        self.published = self.version
        self.requeue(state["in_flight"])

    def state_dict(self) -> dict[str, Any]:
        """What the driver must remember at a step boundary: counters, the data cursor, the buffer,
        and every sample of the groups still in flight (queued, generating, finished but not yet
        rewarded) as the driver last saw it: fresh, a partial response, or finished."""
        in_flight = [s for _, samples, _ in self.work for s in samples if s.group_id >= 0]
        for call in self.pending.values():
            if call.kind in (Kind.GENERATE, Kind.REWARD, *SCORERS):
                in_flight += call.samples
        in_flight += [s for group in self.groups.values() for s in group]
        return {
            "version": self.version,
            "next_group": self.next_group,
            "loader": self.data.train.state_dict(),
            "buffer": self.buffer.state_dict(),
            "in_flight": in_flight,
            "val_metrics": self.validation.metrics,
            "rewards": self.stats.rewards,
            "lengths": self.lengths.getstate(),
            "filter": self.sampling.state_dict() if self.sampling else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """All of `state_dict` but the in-flight samples, which `requeue` puts back once the
        engines hold the checkpoint's weights."""
        self.version = self.first_version = state["version"]
        self.next_group, self.validation.metrics = state["next_group"], state["val_metrics"]
        self.stats.rewards = state["rewards"]
        self.lengths.setstate(state["lengths"])
        if self.sampling and state.get("filter"):
            self.sampling.load_state_dict(state["filter"])
        self.data.train.load_state_dict(state["loader"])
        self.buffer.load_state_dict(state["buffer"])

    def requeue(self, saved: list[Sample]) -> None:
        """The in-flight groups of a checkpoint: finished samples wait for their group (or go to the
        reward when the group is whole), the others generate again from where they were."""
        by_group: dict[int, dict[int, Sample]] = {g: {} for g in self.buffer.in_flight_ids}
        for s in saved:
            by_group[s.group_id][s.index] = s
        for gid, samples in by_group.items():
            if (
                len(episodes(list(samples.values()))) < self.cfg.rollout.n
            ):  # a fresh group, unless saved whole
                prompt, ids = self.data.train.at(gid)
                fresh = make_groups([prompt], [ids], self.cfg.rollout.n, first_group=gid)
                samples = {**samples, **{s.index: samples.get(s.index, s) for s in fresh}}
            ordered = [s for _, s in sorted(samples.items())]
            finished = [s for s in ordered if s.status == Status.FINISHED]
            rest = [s for s in ordered if s.status != Status.FINISHED]
            if rest:
                self.groups[gid] = finished
                self.work.append((Kind.GENERATE, rest, self.version))
            else:
                self.score(finished, self.version)
