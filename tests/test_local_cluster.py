"""run.cluster: a sync run held in the driver's process (`LocalCluster`) runs the same workers as
the Ray actors and the same run, bit for bit; what cannot be held in one process is refused or
goes to Ray."""

import pytest
from test_determinism import _run

from tandem.controller.protocol import CallFailed
from tandem.errors import TandemError
from tandem.runtime.local import LocalCluster
from tandem.runtime.startup import in_one_process, load_config


@pytest.mark.parametrize(
    "overrides, local",
    [
        ([], True),  # the default run: sync, a worker per role
        (["algo.adv_estimator=gae"], True),  # a critic of one rank
        (["placement.groups=[[actor_train],ref_logp,generate]", "placement.ratios=[0.5,0.25,0.25]"], True),
        (["run.mode=async"], False),
        (["run.mode=one_step_off"], False),
        (["rollout.num_workers=2"], False),
        (["train.num_workers=2"], False),
        (["sync.transport=broadcast"], False),
        (["run.cluster=ray"], False),
    ],
)
def test_auto_holds_a_sync_run_of_one_worker_per_role_in_one_process(overrides, local):
    import ray

    assert not ray.is_initialized() or pytest.skip("Ray runs in this session: auto would take it")
    assert in_one_process(load_config(None, [*overrides, "algo.kl_coef=0.1"])) == local


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (["run.mode=async"], "run.mode=async overlaps generation and training"),
        (["train.num_workers=2", "train.strategy=ddp"], "train.num_workers=2"),
        (["train.strategy=fsdp2"], "fsdp2 needs a torch.distributed world"),
        (["sync.transport=broadcast"], "sync.transport=broadcast"),
    ],
)
def test_run_cluster_local_refuses_what_one_process_cannot_hold_with_the_reason(overrides, reason):
    with pytest.raises(TandemError, match=r"'run.cluster' is local .*which this run cannot be: .*" + reason):
        load_config(None, ["run.cluster=local", *overrides])


class Worker:
    def __init__(self):
        self.seen = []

    def keep(self, values: list[int]) -> list[int]:
        values.append(0)  # a worker's changes to its arguments stay its own
        self.seen.append(values)
        return values

    def refuse(self) -> None:
        raise TandemError("refused by name")

    def crash(self) -> None:
        raise ValueError("a bug")


def test_calls_cross_as_copies_and_fail_as_on_ray():
    cluster = LocalCluster({"reward/0": Worker()}, {"reward": ["reward/0"]})
    given = [1, 2]
    kept = cluster.submit("reward/0", "keep", given)
    assert given == [1, 2] and cluster.get([kept], 1) == [[1, 2, 0]]
    again = cluster.submit("reward/0", "keep", kept)  # a handle as an argument: its result
    assert cluster.wait_next([again], 1).result == [1, 2, 0, 0]
    refused, crashed = cluster.submit("reward/0", "refuse"), cluster.submit("reward/0", "crash")
    assert str(cluster.wait_next([refused, crashed], 1).error) == "refused by name"
    error = cluster.wait_next([crashed], 1).error
    assert isinstance(error, CallFailed) and "ValueError: a bug" in str(error)
    after = cluster.submit("reward/0", "keep", crashed)  # an argument that failed fails the call
    with pytest.raises(CallFailed, match="a bug"):
        cluster.get([after], 1)


class Payload:
    """A result that can be watched (weakref) for when it is freed."""

    def __init__(self):
        self.data = bytearray(1 << 20)


def test_a_call_s_result_is_freed_when_the_loop_drops_it_without_waiting_for_the_collector():
    # A weight push's buckets or a step's samples must go when the loop is done with them: a cycle
    # between a call and its `Done` held them until the garbage collector ran (0.27 GB at a time for
    # SmolLM2-135M's pushes).
    import gc
    import weakref

    class Maker:
        def make(self) -> Payload:
            return Payload()

    cluster = LocalCluster({"reward/0": Maker()}, {"reward": ["reward/0"]})
    gc.disable()
    try:
        call = cluster.submit("reward/0", "make")
        done = cluster.wait_next([call], 5)
        freed = weakref.ref(done.result)
        del call, done
        cluster.get([cluster.submit("reward/0", "make")], 5)  # the calls' thread has moved on
        assert freed() is None
    finally:
        gc.enable()


@pytest.mark.integration  # a run of its own (4 s): out of the unit tier
def test_a_push_in_one_process_is_freed_once_the_engine_has_it(tmp_path, monkeypatch):
    """A full push in one process is the buckets themselves (the weights in the engine's dtype):
    neither the sender nor the loop keeps them once the engine has swapped them in, so they are
    gone before the next push is packed (fp32, SmolLM2-135M: 0.54 GB lower peak)."""
    import weakref

    from tandem.sync import object_store
    from tandem.sync.object_store import ObjectStoreTransport

    # as in a process of its own: another test of the session may have started Ray here
    monkeypatch.setattr(object_store, "_ray_running", lambda: False)

    sent, alive_at_send = [], []
    send = ObjectStoreTransport.send

    def watched(self, named_tensors, version):
        alive_at_send.append(sum(ref() is not None for ref in sent))
        handle = send(self, named_tensors, version)
        sent.extend(weakref.ref(array) for array in handle.refs)
        return handle

    monkeypatch.setattr(ObjectStoreTransport, "send", watched)
    _run(tmp_path, ["run.cluster=local"])
    assert len(alive_at_send) >= 3 and alive_at_send == [0] * len(alive_at_send)


@pytest.mark.ray
def test_a_deterministic_run_in_one_process_equals_the_same_run_on_ray_bit_for_bit(tmp_path):
    """The same workers behind either cluster: every metric and the final weights."""
    local = _run(tmp_path / "local", ["run.cluster=local"])
    on_ray = _run(tmp_path / "ray", ["run.cluster=ray"])
    assert len(local[0]) == len(on_ray[0]) and sum("actor/pg_loss" in r for r in local[0]) == 4
    for a, b in zip(local[0], on_ray[0], strict=True):
        assert a == b, {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}
    assert local[1] == on_ray[1]
