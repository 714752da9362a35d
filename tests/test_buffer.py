"""RolloutBuffer: admission numbers, the version fence, fill order, errors, resume, and a simulated
controller (hypothesis) that checks the staleness bound, accounting and progress."""

import heapq
import itertools
import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.buffer import RolloutBuffer
from tandem.errors import TandemError
from tandem.sample import Prompt, Sample, Status


def group(gid: int, n: int = 2, versions: list[int] | None = None) -> list[Sample]:
    versions = versions or [0]
    return [
        Sample(
            prompt=Prompt(text=f"p{gid}", ground_truth=str(gid)),
            prompt_ids=[1, 2],
            group_id=gid,
            index=i,
            response_ids=[3] * len(versions),
            logprobs=[-0.5] * len(versions),
            versions=list(versions),
            loss_mask=[1] * len(versions),
            reward=float(i % 2),
            status=Status.FINISHED,
            finish_reason="stop",
        )
        for i in range(n)
    ]


def ids(batch: list[list[Sample]] | None) -> list[int] | None:
    return None if batch is None else [g[0].group_id for g in batch]


def start_all(buf: RolloutBuffer, gids: range | list[int], version: int) -> None:
    for gid in gids:
        buf.start(gid, version)


# ---------------------------------------------------------------- admission


@pytest.mark.parametrize(
    "batch_size, k, whole, expected",
    [(2, 0, False, [2, 4, 6]), (2, 1, False, [4, 6, 8]), (3, 2, False, [9, 12, 15]), (2, 1, True, [4, 6, 8])],
)
def test_admission_limit_is_p_plus_k_plus_one_batches(batch_size, k, whole, expected):
    buf = RolloutBuffer(batch_size, k, whole_batches=whole)
    assert [buf.admissible(p) for p in range(3)] == expected
    start_all(buf, range(expected[0]), 0)
    assert buf.admissible(0) == 0
    assert buf.admissible(1) == batch_size
    with pytest.raises(TandemError, match="admissible"):
        buf.start(99, 0)


def test_dropped_groups_free_their_places_and_batches_stay_whole():
    buf = RolloutBuffer(3, 0, whole_batches=True)
    start_all(buf, range(3), 0)
    assert buf.admissible(0) == 0
    buf.drop(1)  # dynamic sampling: no signal in group 1
    assert buf.admissible(0) == 1 and buf.started == 2
    buf.start(3, 0)  # its replacement completes the batch
    for g in (0, 2, 3):
        buf.finish(g, group(g))
    assert ids(buf.next_batch(0)) == [0, 2, 3]
    with pytest.raises(TandemError, match="cannot be dropped"):
        buf.drop(0)  # already trained


def test_sync_is_strictly_on_policy():
    buf = RolloutBuffer(2, 0)
    start_all(buf, range(2), 0)
    assert buf.admissible(0) == 0
    buf.finish(1, group(1))
    assert buf.next_batch(0) is None and buf.blocking(0) == [0]
    buf.finish(0, group(0))
    assert ids(buf.next_batch(0)) == [1, 0]
    assert buf.admissible(0) == 0  # nothing starts until version 1 is published
    assert buf.next_batch(1) is None and buf.blocking(1) == []


# ---------------------------------------------------------------- the fence and the fill order


def test_fence_waits_for_a_slow_old_group_and_releases_when_it_finishes():
    buf = RolloutBuffer(2, 1)
    start_all(buf, range(4), 0)
    for gid in (2, 1):
        buf.finish(gid, group(gid))
    assert ids(buf.next_batch(0)) == [2, 1]  # nothing is due yet: finishing order
    start_all(buf, [4, 5], 1)
    for gid in (4, 5):
        buf.finish(gid, group(gid))
    assert buf.ready == 2
    assert buf.next_batch(1) is None  # 0 and 3 started at version 0 and are due at version 1
    assert buf.blocking(1) == [0, 3]
    buf.finish(3, group(3))
    assert buf.next_batch(1) is None and buf.blocking(1) == [0]
    buf.finish(0, group(0))
    assert ids(buf.next_batch(1)) == [3, 0]
    assert ids(buf.next_batch(2)) == [4, 5]


def test_fill_takes_oldest_start_version_first_then_finishing_order():
    buf = RolloutBuffer(2, 3)
    start_all(buf, range(4), 0)  # limit at P=0 is 8: the window is the 4 oldest
    for gid in (3, 0):
        buf.finish(gid, group(gid))
    assert ids(buf.next_batch(0)) == [3, 0]
    start_all(buf, [10, 11], 1)
    for gid in (10, 2, 11, 1):
        buf.finish(gid, group(gid))
    assert ids(buf.next_batch(1)) == [2, 1]
    assert ids(buf.next_batch(2)) == [10, 11]


def test_window_keeps_the_bound_when_fence_alone_would_not():
    # B=1, k=2: 0, 1, 2 start at version 0; 0 trains version 0; 3 starts at version 1 and finishes
    # first. Taking 3 for version 1 would leave 1 and 2 both due at version 2, with room for one.
    buf = RolloutBuffer(1, 2)
    start_all(buf, range(3), 0)
    buf.finish(0, group(0))
    assert ids(buf.next_batch(0)) == [0]
    buf.start(3, 1)
    buf.finish(3, group(3))
    assert buf.next_batch(1) is None
    buf.finish(2, group(2))
    assert ids(buf.next_batch(1)) == [2]
    assert buf.next_batch(2) is None and buf.blocking(2) == [1]


def test_whole_batches_train_in_admission_order():
    buf = RolloutBuffer(2, 1, whole_batches=True)
    start_all(buf, range(4), 0)
    for gid in (3, 2, 1):
        buf.finish(gid, group(gid))
    assert buf.next_batch(0) is None and buf.blocking(0) == [0]
    buf.finish(0, group(0))
    assert ids(buf.next_batch(0)) == [1, 0]
    assert ids(buf.next_batch(1)) == [3, 2]


def test_counters_and_stats():
    buf = RolloutBuffer(2, 1)
    start_all(buf, range(4), 0)
    for gid in range(3):
        buf.finish(gid, group(gid))
    buf.next_batch(0)
    assert (buf.started, buf.finished, buf.consumed, buf.in_flight, buf.ready) == (4, 3, 2, 1, 1)
    assert buf.in_flight_ids == [3]
    assert buf.stats() == {
        "buffer/in_flight": 1.0,
        "buffer/ready": 1.0,
        "buffer/started": 4.0,
        "buffer/consumed": 2.0,
    }


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "args", [(0, 1), (2, -1), (1.5, 1), (True, 1), (2, 1, "yes")], ids=["b0", "k-1", "bfloat", "bbool", "wb"]
)
def test_bad_constructor_values(args):
    with pytest.raises(TandemError, match="RolloutBuffer"):
        RolloutBuffer(*args)


def test_errors():
    buf = RolloutBuffer(2, 0)
    buf.start(0, 0)
    with pytest.raises(TandemError, match="started twice"):
        buf.start(0, 0)
    with pytest.raises(TandemError, match="never started"):
        buf.finish(7, group(7))
    with pytest.raises(TandemError, match="no samples"):
        buf.finish(0, [])
    with pytest.raises(TandemError, match=r"other groups: \[1\]"):
        buf.finish(0, group(0) + group(1))
    buf.finish(0, group(0))
    with pytest.raises(TandemError, match="finished twice"):
        buf.finish(0, group(0))
    buf.start(1, 0)
    with pytest.raises(TandemError, match="admissible"):
        buf.start(2, 0)
    with pytest.raises(TandemError, match="must be an int >= 0"):
        buf.admissible(-1)
    buf.finish(1, group(1))
    with pytest.raises(TandemError, match="exactly one batch"):
        buf.next_batch(1)
    buf.next_batch(0)
    with pytest.raises(TandemError, match="already trained"):
        buf.finish(0, group(0))
    buf.start(0, 1)  # an id may come back once its group was trained (a new epoch)


def test_load_state_dict_rejects_other_settings():
    state = RolloutBuffer(2, 1).state_dict()
    with pytest.raises(TandemError, match="max_staleness"):
        RolloutBuffer(2, 2).load_state_dict(state)


# ---------------------------------------------------------------- resume


def script(buf: RolloutBuffer, part: int) -> list:
    """A run in two parts; returns what the buffer answered."""
    out: list = []
    if part == 0:
        start_all(buf, range(6), 0)
        for gid in (3, 1, 5):
            buf.finish(gid, group(gid, versions=[0, 1]))
        out.append(ids(buf.next_batch(0)))
        buf.finish(2, group(2, versions=[0]))
    else:
        start_all(buf, range(6, 8), 1)
        for gid in (7, 0, 4, 6):
            version = buf.consumed // buf.batch_size
            out += [buf.blocking(version), buf.next_batch(version)]
            buf.finish(gid, group(gid, versions=[1]))
        out += [buf.next_batch(buf.consumed // buf.batch_size), buf.stats()]
    return out


def test_state_dict_round_trip_continues_identically():
    a = RolloutBuffer(2, 2)
    script(a, 0)
    state = json.loads(json.dumps(a.state_dict()))  # plain data only
    b = RolloutBuffer(2, 2)
    b.load_state_dict(state)
    assert b.in_flight_ids == a.in_flight_ids == [0, 4]
    assert script(b, 1) == script(a, 1)
    assert b.state_dict() == a.state_dict()


# ---------------------------------------------------------------- a simulated controller


@dataclass
class Run:
    trained: list[tuple[int, list[list[Sample]]]] = field(default_factory=list)  # (version, batch)
    start_versions: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    dropped: set[int] = field(default_factory=set)


def simulate(
    buf,
    *,
    n: int,
    steps: int,
    gen_time: Callable[[int], int],
    train_time: Callable[[int], int],
    publish_time: Callable[[int], int],
    continue_updates: bool = False,
    max_running: int | None = None,
    drops: Callable[[int], bool] = lambda gid: False,
) -> Run:
    """Discrete-event controller: admit while allowed, train when a batch is ready, publish later.

    With `continue_updates`, a running group's later tokens take the version published by then.
    A group for which `drops(gid)` is true is dropped when it finishes (DAPO's dynamic sampling).
    """
    run, t, version, published = Run(), 0, 0, 0
    history = [(0, 0)]  # (time, published version)
    events: list[tuple[int, int, str, int]] = []
    order = itertools.count()
    training = False
    started_at: dict[int, int] = {}
    gids = itertools.count()
    for _ in range(100_000):
        running = buf.started - len(run.finished)
        free = buf.admissible(published)
        if max_running is not None:
            free = min(free, max_running - running)
        for gid in itertools.islice(gids, free):
            buf.start(gid, published)
            run.start_versions[gid], started_at[gid] = published, t
            heapq.heappush(events, (t + max(1, gen_time(gid)), next(order), "finish", gid))
        assert buf.started <= (published + buf.max_staleness + 1) * buf.batch_size
        if not training:
            batch = buf.next_batch(version)
            if batch is not None:
                run.trained.append((version, batch))
                training = True
                heapq.heappush(events, (t + train_time(version), next(order), "trained", version))
            else:
                assert set(buf.blocking(version)) <= set(run.start_versions) - run.finished
        if len(run.trained) == steps:
            return run
        assert events, f"deadlock at t={t}, version {version}, published {published}"
        t, _, kind, arg = heapq.heappop(events)
        if kind == "finish" and drops(arg):
            buf.drop(arg)
            run.dropped.add(arg)
        elif kind == "finish":
            start = (run.start_versions[arg], started_at[arg])
            buf.finish(arg, make_group(arg, n, start, t, history, continue_updates))
            run.finished.add(arg)
        elif kind == "trained":
            version, training = arg + 1, False
            heapq.heappush(events, (t + publish_time(arg), next(order), "publish", version))
        else:
            published = max(published, arg)
            history.append((t, published))
    raise AssertionError("the simulation did not finish")


def make_group(gid, n, start, end_t, history, continue_updates) -> list[Sample]:
    """n samples of 1-3 tokens produced evenly over the group's run; start = (version, time)."""
    start_version, start_t = start

    def version_at(when: int) -> int:
        return max(v for at, v in history if at <= when)

    samples = []
    for i in range(n):
        length = 1 + (gid + i) % 3
        times = [start_t + (end_t - start_t) * (j + 1) // length for j in range(length)]
        versions = [max(start_version, version_at(x)) if continue_updates else start_version for x in times]
        samples.append(group(gid, 1, versions)[0])
        samples[-1].index = i
    return samples


def max_staleness_seen(run: Run) -> int:
    return max(v - min(s.versions) for v, batch in run.trained for g in batch for s in g)


def check_run(buf: RolloutBuffer, run: Run, n: int, steps: int) -> None:
    assert [v for v, _ in run.trained] == list(range(steps))
    trained_ids: list[int] = []
    for version, batch in run.trained:
        assert len(batch) == buf.batch_size
        for g in batch:
            gid = g[0].group_id
            trained_ids.append(gid)
            assert [s.group_id for s in g] == [gid] * n and [s.index for s in g] == list(range(n))
            for s in g:
                assert sorted(s.versions) == s.versions and s.versions[0] >= run.start_versions[gid]
                assert 0 <= version - s.versions[0] <= buf.max_staleness
    assert len(trained_ids) == len(set(trained_ids))  # nothing trained twice
    trained_at = {gid: version for version, batch in run.trained for gid in ids(batch)}
    for gid, start in run.start_versions.items():
        if start + buf.max_staleness < steps and gid not in run.dropped:  # due by now: trained, and in time
            assert trained_at.get(gid, steps) <= start + buf.max_staleness
    if buf.whole_batches and not run.dropped:  # batch v is the v-th admitted batch
        b = buf.batch_size
        assert [sorted(ids(batch)) for _, batch in run.trained] == [
            list(range(v * b, (v + 1) * b)) for v in range(steps)
        ]
    in_flight = set(run.start_versions) - run.finished - run.dropped
    ready = run.finished - set(trained_ids)
    assert set(buf.in_flight_ids) == in_flight
    assert set(trained_ids) | in_flight | ready | run.dropped == set(run.start_versions)  # nothing lost
    assert not run.dropped & set(trained_ids)
    started = len(run.start_versions) - len(run.dropped)
    assert (buf.started, buf.consumed) == (started, len(trained_ids))
    assert (buf.in_flight, buf.ready) == (len(in_flight), len(ready))


GEN_TIMES = [1, 1, 1, 2, 2, 3, 5, 8, 40]  # heavy tail: now and then a very slow group


@settings(deadline=None, max_examples=150)
@given(
    batch_size=st.integers(1, 4),
    n=st.integers(1, 3),
    k=st.integers(0, 3),
    whole=st.booleans(),
    steps=st.integers(1, 6),
    speeds=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    continue_updates=st.booleans(),
    cap=st.none() | st.integers(1, 8),
    drop_every=st.sampled_from([0, 2, 3]),
    data=st.data(),
)
def test_simulated_controller_keeps_the_bound(
    batch_size, n, k, whole, steps, speeds, continue_updates, cap, drop_every, data
):
    buf = RolloutBuffer(batch_size, k, whole_batches=whole)
    base = data.draw(st.lists(st.sampled_from(GEN_TIMES), min_size=1, max_size=40), label="gen times")
    train = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=6), label="train times")
    publish = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=6), label="publish times")
    run = simulate(
        buf,
        n=n,
        steps=steps,
        gen_time=lambda gid: base[gid % len(base)] * speeds[gid % len(speeds)],
        train_time=lambda v: train[v % len(train)],
        publish_time=lambda v: publish[v % len(publish)],
        continue_updates=continue_updates,
        max_running=None if whole else cap,
        drops=lambda gid: bool(drop_every) and gid % drop_every == 1,
    )
    check_run(buf, run, n, steps)


# ---------------------------------------------------------------- why the fence and the window


class FifoBatches:
    """Admission as RolloutBuffer, but a batch is simply the first groups to finish."""

    def __init__(self, batch_size: int, max_staleness: int):
        self.admission = RolloutBuffer(batch_size, max_staleness)
        self.batch_size, self.max_staleness = batch_size, max_staleness
        self.done: deque[list[Sample]] = deque()

    @property
    def started(self) -> int:
        return self.admission.started

    def admissible(self, published_version: int) -> int:
        return self.admission.admissible(published_version)

    def start(self, group_id: int, version: int) -> None:
        self.admission.start(group_id, version)

    def finish(self, group_id: int, samples: list[Sample]) -> None:
        self.done.append(samples)

    def next_batch(self, version: int) -> list[list[Sample]] | None:
        if len(self.done) < self.batch_size:
            return None
        return [self.done.popleft() for _ in range(self.batch_size)]

    def blocking(self, version: int) -> list[int]:
        return []


class FenceOnly(RolloutBuffer):
    """The fence without the window: any finished group may fill a batch."""

    def _window(self):
        return list(self._groups.values())


def slow_first(gid: int) -> int:
    return 10 if gid == 0 else 1


def test_fifo_batching_breaks_the_bound_and_the_fence_keeps_it():
    timing = dict(n=1, steps=8, gen_time=slow_first, train_time=lambda v: 1, publish_time=lambda v: 1)
    assert max_staleness_seen(simulate(FifoBatches(1, 1), **timing)) > 1
    buf = RolloutBuffer(1, 1)
    run = simulate(buf, **timing)
    check_run(buf, run, 1, 8)
    assert max_staleness_seen(run) == 1


def test_fence_without_window_overflows_at_staleness_two():
    slow_pair = lambda gid: 100 if gid in (1, 2) else 1
    timing = dict(n=1, steps=5, gen_time=slow_pair, train_time=lambda v: 1, publish_time=lambda v: 1)
    with pytest.raises(TandemError, match="more than one batch holds"):
        simulate(FenceOnly(1, 2), **timing)
    buf = RolloutBuffer(1, 2)
    run = simulate(buf, **timing)
    check_run(buf, run, 1, 5)
    assert max_staleness_seen(run) == 2
