"""The loop's checkpoints: what the driver writes at a step boundary, and how a run continues.

These functions read and set the `Loop`'s own fields (its queue, pending calls, buffer, counters):
they are the loop's, kept in a file of their own so the loop's event handling reads on one screen.
What a checkpoint holds and how resuming works: docs/resume.md.
"""

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.config import save_config
from tandem.controller.calls import Kind
from tandem.controller.checkpoint import read_driver_state, write_driver_state
from tandem.controller.protocol import CallFailed, WorkerDied
from tandem.errors import TandemError
from tandem.rollout.group import make_groups
from tandem.sample import Sample, Status

if TYPE_CHECKING:
    from tandem.controller.loop import Loop


def save_checkpoint(loop: "Loop", name: str) -> Path:
    """A full checkpoint at this step boundary, written atomically. Every train rank writes
    (under fsdp2 the weights are gathered from all shards, the optimizer state stays sharded);
    the driver adds its own state and each engine's sampling stream."""
    tmp = loop.checkpoints.begin(name)
    cluster, timeout = loop.cluster, loop.cfg.run.timeout_s
    workers = [*cluster.names["train"], *cluster.names.get("critic", [])]
    saves = [cluster.submit(w, "save", str(tmp)) for w in workers]
    streams = [cluster.submit(w, "rng_state") for w in cluster.names["rollout"]]
    try:
        for worker, handle in zip(workers, saves, strict=True):
            try:
                loop.timeline.add(*cluster.get([handle], timeout))
            except WorkerDied as e:
                raise loop.died(worker, f"while saving {name}", e) from None
        write_driver_state(tmp, {**driver_state(loop), "engine_rngs": _engine_streams(loop, streams)})
        save_config(loop.cfg, tmp / "config.yaml")
        return loop.checkpoints.commit(tmp, name)
    except (CallFailed, OSError) as e:  # e.g. a full disk
        raise TandemError(
            f"Writing checkpoint {name} failed; the previous one ({loop.checkpoints.latest()}) is intact: {e}"
        ) from None


def _engine_streams(loop: "Loop", handles: list) -> list:
    out = []
    for handle in handles:
        try:
            out.extend(loop.cluster.get([handle], loop.cfg.run.timeout_s))
        except WorkerDied:  # a dead worker restarts with a fresh stream
            out.append(None)
    return out


def driver_state(loop: "Loop") -> dict[str, Any]:
    """What the driver must remember at a step boundary: counters, the data cursor, the buffer,
    and every sample of the groups still in flight (queued, generating, finished but not yet
    rewarded) as the driver last saw it: fresh, a partial response, or finished."""
    in_flight = [s for _, samples, _ in loop.work for s in samples if s.group_id >= 0]
    for call in loop.pending.values():
        if call.kind in (Kind.GENERATE, Kind.REWARD, Kind.REF):
            in_flight += call.samples
    in_flight += [s for group in loop.groups.values() for s in group]
    return {
        "version": loop.version,
        "next_group": loop.next_group,
        "loader": loop.data.train.state_dict(),
        "buffer": loop.buffer.state_dict(),
        "in_flight": in_flight,
        "val_metrics": loop.validation.metrics,
        "rewards": loop.stats.rewards,
        "lengths": loop.lengths.getstate(),
        "filter": loop.sampling.state_dict() if loop.sampling else None,
    }


def resume_from(loop: "Loop", path: Path) -> None:
    """Continue from the checkpoint at `path`: the trainers load their state, the engines get
    its weights (before anything generates) and sampling streams, the groups that were in
    flight go back into the queue."""
    state = read_driver_state(path)
    cluster, timeout = loop.cluster, loop.cfg.run.timeout_s
    workers = [*cluster.names["train"], *cluster.names.get("critic", [])]
    versions = cluster.get([cluster.submit(w, "load", str(path)) for w in workers], timeout)
    if set(versions) != {state["version"]}:
        raise TandemError(f"{path}: the trainers hold versions {versions}, driver.pt {state['version']}.")
    loop.version = loop.first_version = state["version"]
    loop.next_group, loop.validation.metrics = state["next_group"], state["val_metrics"]
    loop.stats.rewards = state["rewards"]
    loop.lengths.setstate(state["lengths"])
    if loop.sampling and state.get("filter"):
        loop.sampling.load_state_dict(state["filter"])
    loop.data.train.load_state_dict(state["loader"])
    loop.buffer.load_state_dict(state["buffer"])
    streams = zip(cluster.names["rollout"], state["engine_rngs"], strict=True)
    cluster.get([cluster.submit(w, "set_rng_state", s) for w, s in streams if s is not None], timeout)
    loop.push_weights()  # synchronously: nothing may generate on the initial weights
    cluster.get(list(loop.pending), timeout)
    loop.pending.clear()
    loop.receiving.clear()
    loop.published = loop.version
    _requeue(loop, state["in_flight"])


def _requeue(loop: "Loop", saved: list[Sample]) -> None:
    """The in-flight groups of a checkpoint: finished samples wait for their group (or go to the
    reward when the group is whole), the others generate again from where they were."""
    by_group: dict[int, dict[int, Sample]] = {g: {} for g in loop.buffer.in_flight_ids}
    for s in saved:
        by_group[s.group_id][s.index] = s
    for gid, samples in by_group.items():
        if len(samples) < loop.cfg.rollout.n:  # never when saved whole; a fresh group otherwise
            prompt, ids = loop.data.train.at(gid)
            fresh = make_groups([prompt], [ids], loop.cfg.rollout.n, first_group=gid)
            samples = {s.index: samples.get(s.index, s) for s in fresh}
        ordered = [s for _, s in sorted(samples.items())]
        finished = [s for s in ordered if s.status == Status.FINISHED]
        rest = [s for s in ordered if s.status != Status.FINISHED]
        if rest:
            loop.groups[gid] = finished
            loop.work.append((Kind.GENERATE, rest, loop.version))
        else:
            loop.score(finished, loop.version)
