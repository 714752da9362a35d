"""The loop's checkpoints: what the driver writes at a step boundary, and how a run continues.

These functions read and set the `Loop`'s own fields (its queue, pending calls, buffer, counters):
they are the loop's, kept in a file of their own so the loop's event handling reads on one screen.
What a checkpoint holds and how resuming works: docs/resume.md.
"""

from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from tandem.config import save_config
from tandem.controller.checkpoint import read_driver_state, write_driver_state
from tandem.errors import TandemError
from tandem.rollout import make_groups
from tandem.sample import Sample, Status

if TYPE_CHECKING:
    from tandem.controller.loop import Loop


def save_checkpoint(loop: "Loop", name: str) -> Path:
    """A full checkpoint at this step boundary, written atomically. Every train rank writes
    (under fsdp2 the weights are gathered from all shards, the optimizer state stays sharded);
    the driver adds its own state and each engine's sampling stream."""
    tmp = loop.checkpoints.begin(name)
    saves = [t.save.remote(str(tmp)) for t in [*loop.cluster.trainers, *loop.cluster.critics]]
    workers = [*loop.cluster.names["train"], *loop.cluster.names.get("critic", [])]
    streams = [r.rng_state.remote() for r in loop.cluster.rollouts]
    try:
        for worker, ref in zip(workers, saves, strict=True):
            try:
                loop.timeline.add(ray.get(ref, timeout=loop.cfg.run.timeout_s))
            except ray.exceptions.RayActorError as e:
                raise loop.died(worker, f"while saving {name}", e) from None
        write_driver_state(tmp, {**driver_state(loop), "engine_rngs": _engine_streams(loop, streams)})
        save_config(loop.cfg, tmp / "config.yaml")
        return loop.checkpoints.commit(tmp, name)
    except (ray.exceptions.RayTaskError, OSError) as e:  # e.g. a full disk
        raise TandemError(
            f"Writing checkpoint {name} failed; the previous one ({loop.checkpoints.latest()}) is intact: {e}"
        ) from None


def _engine_streams(loop: "Loop", refs: list) -> list:
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=loop.cfg.run.timeout_s))
        except ray.exceptions.RayActorError:  # a dead worker restarts with a fresh stream
            out.append(None)
    return out


def driver_state(loop: "Loop") -> dict[str, Any]:
    """What the driver must remember at a step boundary: counters, the data cursor, the buffer,
    and every sample of the groups still in flight (queued, generating, finished but not yet
    rewarded) as the driver last saw it: fresh, a partial response, or finished."""
    in_flight = [s for _, samples, _ in loop.work for s in samples if s.group_id >= 0]
    for call in loop.pending.values():
        if call.kind in ("generate", "reward", "ref"):
            in_flight += call.samples
    in_flight += [s for group in loop.groups.values() for s in group]
    return {
        "version": loop.version,
        "next_group": loop.next_group,
        "loader": loop.data.train.state_dict(),
        "buffer": loop.buffer.state_dict(),
        "in_flight": in_flight,
        "val_metrics": loop.validation.metrics,
        "rewards": loop.rewards,
        "lengths": loop.lengths.getstate(),
        "filter": loop.sampling.state_dict() if loop.sampling else None,
    }


def resume_from(loop: "Loop", path: Path) -> None:
    """Continue from the checkpoint at `path`: the trainers load their state, the engines get
    its weights (before anything generates) and sampling streams, the groups that were in
    flight go back into the queue."""
    state = read_driver_state(path)
    loads = [t.load.remote(str(path)) for t in [*loop.cluster.trainers, *loop.cluster.critics]]
    versions = ray.get(loads, timeout=loop.cfg.run.timeout_s)
    if set(versions) != {state["version"]}:
        raise TandemError(f"{path}: the trainers hold versions {versions}, driver.pt {state['version']}.")
    loop.version = loop.first_version = state["version"]
    loop.next_group, loop.validation.metrics = state["next_group"], state["val_metrics"]
    loop.rewards = state["rewards"]
    loop.lengths.setstate(state["lengths"])
    if loop.sampling and state.get("filter"):
        loop.sampling.load_state_dict(state["filter"])
    loop.data.train.load_state_dict(state["loader"])
    loop.buffer.load_state_dict(state["buffer"])
    streams = zip(loop.cluster.rollouts, state["engine_rngs"], strict=True)
    ray.get([r.set_rng_state.remote(s) for r, s in streams if s is not None], timeout=loop.cfg.run.timeout_s)
    loop.push_weights()  # synchronously: nothing may generate on the initial weights
    ray.get(list(loop.pending), timeout=loop.cfg.run.timeout_s)
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
            loop.work.append(("generate", rest, loop.version))
        else:
            loop.score(finished, loop.version)
