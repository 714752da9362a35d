"""The rollout buffer: admits prompt groups by staleness and hands out whole-group training batches.

Units are groups (the n samples of one prompt). P is the published version (weights on every
rollout worker), V the trainer's version, k = `max_staleness`, B = `batch_size`. A group records
its start version s = P when it starts; all its tokens then come from versions >= s.

Admission (AReaL's rule, in groups): a group may start only while `started < (P + k + 1) * B`.
Fence: the batch that trains version V holds every unconsumed group with s <= V - k, and waits
while one of them is still generating. Window: a batch is drawn only from the 2B oldest-started
unconsumed groups (the B oldest with `whole_batches`), oldest start version first, then in
finishing order.

Why no group is trained more than k versions after its start version: a group admitted at start
version s had fewer than (s + k + 1) * B groups started before it, so every group with s <= V - k
is among the first (V + 1) * B started. The window keeps every consumed group among the first
`consumed + B` started, so after V batches the V * B consumed groups all lie in that same prefix
and at most B of it remain: the fence's groups always fit in one batch, and each group is trained
at version s + k at the latest. The fence alone is not enough once k >= 2: filling batches with
newer groups while old ones still generate can leave more than B groups due at once.
"""

import dataclasses
from itertools import islice
from typing import Any

from tandem.errors import TandemError
from tandem.sample import Prompt, Sample, Status


@dataclasses.dataclass(eq=False)
class _Group:
    group_id: int
    start_version: int
    samples: list[Sample] | None = None  # None while generating
    finish_index: int = -1


class RolloutBuffer:
    """Admission by staleness, a version fence and whole-group batches, for one controller thread.

    `whole_batches=True` admits in multiples of `batch_size` and trains the groups in the order
    they were admitted, batch by batch (one-step-off / generate-ahead with k = max_staleness), so
    which groups form each batch does not depend on generation timing.
    """

    def __init__(self, batch_size: int, max_staleness: int, whole_batches: bool = False):
        if not _is_int(batch_size) or batch_size < 1:
            raise TandemError(f"RolloutBuffer batch_size must be an int >= 1, got {batch_size!r}.")
        if not _is_int(max_staleness) or max_staleness < 0:
            raise TandemError(f"RolloutBuffer max_staleness must be an int >= 0, got {max_staleness!r}.")
        if not isinstance(whole_batches, bool):
            raise TandemError(f"RolloutBuffer whole_batches must be a bool, got {whole_batches!r}.")
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.whole_batches = whole_batches
        self._groups: dict[int, _Group] = {}  # unconsumed groups, in start order
        self._started = self._finished = self._consumed = 0

    @property
    def started(self) -> int:
        return self._started

    @property
    def finished(self) -> int:
        return self._finished

    @property
    def consumed(self) -> int:
        return self._consumed

    @property
    def in_flight(self) -> int:
        return self._started - self._finished

    @property
    def ready(self) -> int:
        return self._finished - self._consumed

    @property
    def in_flight_ids(self) -> list[int]:
        """Ids of the groups still generating, in start order (to re-submit after a resume)."""
        return [g.group_id for g in self._groups.values() if g.samples is None]

    def admissible(self, published_version: int) -> int:
        """How many more groups may start now: (P + k + 1) * B - started, floored at 0.

        With `whole_batches` the limit is a whole number of batches, so this completes the last
        batch started (after a `drop`, the dropped groups' places) or starts whole new ones.
        """
        _check_version("published_version", published_version)
        return max(0, self._limit(published_version) - self._started)

    def start(self, group_id: int, version: int) -> None:
        """Record that group `group_id` started at published version `version` (its start version)."""
        _check_version("version", version)
        if group_id in self._groups:
            raise TandemError(f"Group {group_id} was started twice; it is still in the buffer.")
        if self._started >= self._limit(version):
            raise TandemError(
                f"Group {group_id} may not start at published version {version}: {self._started} groups "
                f"have started and max_staleness={self.max_staleness} allows "
                f"{self._limit(version)} until a newer version is published. Ask admissible() first."
            )
        self._groups[group_id] = _Group(group_id, version)
        self._started += 1

    def finish(self, group_id: int, samples: list[Sample]) -> None:
        """Record that group `group_id` is done: all its samples finished and rewarded."""
        group = self._groups.get(group_id)
        if group is None:
            raise TandemError(f"Group {group_id} finished but was never started (or was already trained).")
        if group.samples is not None:
            raise TandemError(f"Group {group_id} finished twice.")
        if not samples:
            raise TandemError(f"Group {group_id} finished with no samples.")
        wrong = sorted({s.group_id for s in samples if s.group_id != group_id})
        if wrong:
            raise TandemError(f"Group {group_id} finished with samples of other groups: {wrong}.")
        group.samples = list(samples)
        group.finish_index = self._finished
        self._finished += 1

    def drop(self, group_id: int) -> None:
        """Forget a started group that will not be trained (DAPO's dynamic sampling drops a group
        whose rewards are all equal): it no longer counts as started, so a new group may start in
        its place. The staleness argument above holds unchanged: it counts the groups that are
        trained, and a dropped group is as if it had never started."""
        group = self._groups.get(group_id)
        if group is None or group.samples is not None:
            raise TandemError(f"Group {group_id} cannot be dropped: it is not generating in the buffer.")
        del self._groups[group_id]
        self._started -= 1

    def next_batch(self, version: int) -> list[list[Sample]] | None:
        """The `batch_size` groups that train version `version`, or None while the fence waits.

        `version` must equal consumed / batch_size: each version trains exactly one batch.
        """
        self._check_train_version(version)
        window = self._window()
        if any(g.samples is None for g in self._required(version, window)):
            return None
        done = sorted((g for g in window if g.samples is not None), key=_fill_order)
        if len(done) < self.batch_size:
            return None
        batch = done[: self.batch_size]
        for g in batch:
            del self._groups[g.group_id]
        self._consumed += self.batch_size
        return [g.samples for g in batch if g.samples is not None]

    def blocking(self, version: int) -> list[int]:
        """Ids of the unfinished groups the next batch must contain (the fence), in start order."""
        self._check_train_version(version)
        return [g.group_id for g in self._required(version, self._window()) if g.samples is None]

    def stats(self) -> dict[str, float]:
        return {
            "buffer/in_flight": float(self.in_flight),
            "buffer/ready": float(self.ready),
            "buffer/started": float(self._started),
            "buffer/consumed": float(self._consumed),
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain data (dicts, lists, numbers, strings): counters and every unconsumed group."""
        return {
            "batch_size": self.batch_size,
            "max_staleness": self.max_staleness,
            "whole_batches": self.whole_batches,
            "started": self._started,
            "finished": self._finished,
            "consumed": self._consumed,
            "groups": [_group_to_dict(g) for g in self._groups.values()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("batch_size", "max_staleness", "whole_batches"):
            if state[key] != getattr(self, key):
                raise TandemError(
                    f"The saved buffer has {key}={state[key]!r} but this run has {getattr(self, key)!r}; "
                    "the staleness bound holds only if they stay the same across a resume."
                )
        self._started, self._finished, self._consumed = state["started"], state["finished"], state["consumed"]
        self._groups = {d["group_id"]: _group_from_dict(d) for d in state["groups"]}

    def _limit(self, published_version: int) -> int:
        return (published_version + self.max_staleness + 1) * self.batch_size

    def _window(self) -> list[_Group]:
        size = self.batch_size if self.whole_batches else 2 * self.batch_size
        return list(islice(self._groups.values(), size))

    def _required(self, version: int, window: list[_Group]) -> list[_Group]:
        """The groups every batch for `version` must contain."""
        due = [g for g in self._groups.values() if g.start_version <= version - self.max_staleness]
        in_window = {id(g) for g in window}
        if len(due) > self.batch_size or any(id(g) not in in_window for g in due):
            # Unreachable when every start went through start(): see the module docstring.
            raise TandemError(f"{len(due)} groups are due at version {version}, more than one batch holds.")
        return window if self.whole_batches else due

    def _check_train_version(self, version: int) -> None:
        _check_version("version", version)
        if version * self.batch_size != self._consumed:
            raise TandemError(
                f"next_batch(version={version}) but {self._consumed} groups were consumed, i.e. "
                f"{self._consumed / self.batch_size:g} batches of {self.batch_size}: each version must "
                "train exactly one batch, or the staleness bound does not hold."
            )


def _fill_order(g: _Group) -> tuple[int, int]:
    return (g.start_version, g.finish_index)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_version(name: str, version: int) -> None:
    if not _is_int(version) or version < 0:
        raise TandemError(f"RolloutBuffer {name} must be an int >= 0, got {version!r}.")


def _group_to_dict(g: _Group) -> dict[str, Any]:
    samples = None if g.samples is None else [_sample_to_dict(s) for s in g.samples]
    return {**dataclasses.asdict(dataclasses.replace(g, samples=None)), "samples": samples}


def _group_from_dict(d: dict[str, Any]) -> _Group:
    samples = None if d["samples"] is None else [_sample_from_dict(s) for s in d["samples"]]
    return _Group(**{**d, "samples": samples})


def _sample_to_dict(s: Sample) -> dict[str, Any]:
    # Plain types only, so a checkpoint loads with torch.load(weights_only=True) or as JSON.
    return {**dataclasses.asdict(s), "status": s.status.value}


def _sample_from_dict(d: dict[str, Any]) -> Sample:
    return Sample(**{**d, "prompt": Prompt(**d["prompt"]), "status": Status(d["status"])})
