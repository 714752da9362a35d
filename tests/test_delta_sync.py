"""Delta pushes (`sync.delta=true`, tandem/sync/delta.py): after real optimizer steps every receiver
holds the trainer's weights bit for bit, on both transports; a receiver that missed a version (or
a fresh one) gets a full push; a damaged delta fails its checksum; a bucket whose delta would not
be smaller travels whole.

All in this process, without Ray: the object store transport hands its arrays over in memory when
Ray is not running, and the broadcast transport's members are gloo groups on threads of this
process. Two tests (marked ray) take Ray's actors: the object store's chain reaching a restarted
worker, and a run's own actors (sync.delta=true) pushing over both transports.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import TINY, local_ray, random_samples, tiny_model, train_worker

from tandem import devices
from tandem.config import Config
from tandem.errors import TandemError
from tandem.runtime.startup import load_config
from tandem.sync import (
    TRANSPORTS,
    BucketPlan,
    DeltaEncoder,
    ObjectStoreTransport,
    StagingBuffer,
    TensorSpec,
    pack_bucket,
)
from tandem.sync.delta import apply, read_delta
from tandem.sync.dist import free_port, sync_group
from tandem.train.worker import TrainWorker

KB = 1 / 1024  # MB


class Peers:
    """A sender and `n` receivers of one transport, each receiver with its staging buffer."""

    def __init__(self, transport: str, plan: BucketPlan, n: int = 2):
        self.plan, self.collective = plan, TRANSPORTS.get(transport).collective
        groups = [None] * (1 + n)
        if self.collective:
            port = free_port()
            with ThreadPoolExecutor(1 + n) as pool:
                groups = list(
                    pool.map(lambda r: sync_group(r, 1 + n, "127.0.0.1", port, timeout_s=30), range(1 + n))
                )
        make = TRANSPORTS.get(transport)
        self.sender = make(plan, "trainer-0", group=groups[0], timeout_s=30, delta=True)
        self.receivers = [
            make(plan, f"rollout-{i}", group=groups[1 + i], timeout_s=30, delta=True) for i in range(n)
        ]
        self.staging = [StagingBuffer(plan) for _ in range(n)]

    def push(self, weights: dict[str, torch.Tensor], version: int, to: list[int] | None = None) -> int:
        """What the driver does (the object store's receivers get the send's handle, broadcast's run
        beside the send) -> the bytes the sender sent."""
        to = list(range(len(self.receivers))) if to is None else to
        if self.collective:
            with ThreadPoolExecutor(1 + len(to)) as pool:
                jobs = [pool.submit(self.sender.send, weights.items(), version)]
                jobs += [pool.submit(self.receive, i, None, version) for i in to]
                [job.result() for job in jobs]
        else:
            handle = self.sender.send(weights.items(), version)
            for i in to:
                self.receive(i, handle, version)
        return self.sender.sent_bytes

    def receive(self, i: int, handle, version: int) -> None:
        self.receivers[i].receive(handle, version, self.staging[i], timeout_s=30)

    def assert_hold(
        self, weights: dict[str, torch.Tensor], version: int, who: list[int] | None = None
    ) -> None:
        """Receivers `who` swap `version` into fresh parameters: equal to `weights` bit for bit."""
        for i in range(len(self.receivers)) if who is None else who:
            live = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in self.plan.specs}
            assert self.staging[i].swap_into(live, version) == version
            for name, t in weights.items():
                assert torch.equal(live[name], t), f"rollout-{i}: {name} of version {version}"


def stepped_trainer(lr: float) -> TrainWorker:
    return train_worker(tiny_model(seed=3), train={"lr": lr})


def pushed(trainer: TrainWorker, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What a push carries: the trainer's fp32 master weights rounded once to the wire dtype."""
    return {n: t.to(dtype) for n, t in trainer.named_weights()}


def plan_of(trainer: TrainWorker, dtype: torch.dtype) -> BucketPlan:
    return BucketPlan.from_named_tensors(trainer.named_weights(), 4 * KB, 2 * KB, dtype)


def full_bytes(plan: BucketPlan) -> int:
    return sum(plan.bucket_nbytes)


@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_deltas_after_optimizer_steps_arrive_bit_for_bit(transport):
    trainer = stepped_trainer(lr=1e-5)
    plan = plan_of(trainer, torch.bfloat16)
    peers = Peers(transport, plan)
    assert peers.push(pushed(trainer, torch.bfloat16), 0) == full_bytes(plan)  # nothing to diff against
    peers.assert_hold(pushed(trainer, torch.bfloat16), 0)
    for version in (1, 2, 3):
        trainer.train_step(random_samples(2, 4, seed=version))
        sent = peers.push(pushed(trainer, torch.bfloat16), version)
        assert sent < full_bytes(plan) / 2, "a small step in bf16 travels as deltas"
        peers.assert_hold(pushed(trainer, torch.bfloat16), version)


def test_object_store_receivers_that_missed_a_version_rebuild_it_from_the_last_full_push():
    trainer = stepped_trainer(lr=1e-5)
    plan = plan_of(trainer, torch.bfloat16)
    peers = Peers("object_store", plan, n=2)
    for version in (0, 1, 2, 3):
        if version:
            trainer.train_step(random_samples(2, 4, seed=version))
        peers.push(pushed(trainer, torch.bfloat16), version, to=[0] if version == 2 else [0, 1])
        assert peers.staging[1].held_version == (1 if version == 2 else version)
    # rollout-1 held version 1 when version 3 arrived as a delta against 2: it was rebuilt from the
    # handle's chain (the full push of version 0 and the deltas since), as a restarted worker is.
    assert [p.version for p in peers.sender._sent.chain] == [0, 1, 2]
    peers.assert_hold(pushed(trainer, torch.bfloat16), 3)
    restarted = StagingBuffer(plan)
    peers.receivers[1].receive(peers.sender._sent, 3, restarted, timeout_s=30)
    peers.staging[1] = restarted
    peers.assert_hold(pushed(trainer, torch.bfloat16), 3, who=[1])


def test_object_store_starts_a_new_full_push_once_the_deltas_add_up_to_one():
    trainer = stepped_trainer(lr=1e-4)  # large steps: each delta is a good part of a full push
    plan = plan_of(trainer, torch.bfloat16)
    peers = Peers("object_store", plan, n=1)
    sizes, chains = [], []
    for version in range(6):
        if version:
            trainer.train_step(random_samples(2, 4, seed=version))
        sizes.append(peers.push(pushed(trainer, torch.bfloat16), version))
        chains.append(len(peers.sender._sent.chain))
        peers.assert_hold(pushed(trainer, torch.bfloat16), version)
    restarts = [v for v, c in enumerate(chains) if c == 0]
    assert restarts[0] == 0 and len(restarts) > 1, chains
    for start, end in zip(restarts, restarts[1:], strict=False):
        assert sum(sizes[start + 1 : end - 1]) < sizes[start] <= sum(sizes[start + 1 : end])


def test_broadcast_to_a_fresh_receiver_or_from_a_resumed_sender_is_a_full_push():
    trainer = stepped_trainer(lr=1e-5)
    plan = plan_of(trainer, torch.bfloat16)
    peers = Peers("broadcast", plan, n=2)
    for version in range(5):
        if version:
            trainer.train_step(random_samples(2, 4, seed=version))
        if version == 2:
            peers.staging[1] = StagingBuffer(plan)  # a restarted rollout worker holds nothing
        if version == 4:  # a resumed run: the trainer's transport starts without a copy
            peers.sender.delta = DeltaEncoder(plan)
        sent = peers.push(pushed(trainer, torch.bfloat16), version)
        assert (sent == full_bytes(plan)) == (version in (0, 2, 4)), version
        peers.assert_hold(pushed(trainer, torch.bfloat16), version)


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(300, generator=g).bfloat16(), "b": torch.randn(40, 20, generator=g).bfloat16()}


def two_buckets() -> BucketPlan:
    return BucketPlan(
        [TensorSpec("a", (300,), torch.bfloat16), TensorSpec("b", (40, 20), torch.bfloat16)], 0, 0
    )


def test_a_bucket_whose_delta_is_not_smaller_travels_whole():
    plan, v1 = two_buckets(), tensors(1)
    v2 = {"a": tensors(2)["a"], "b": v1["b"].clone()}  # every element of a changes, one of b
    v2["b"][3, 4] += 1
    encoder = DeltaEncoder(plan)
    staging = StagingBuffer(plan)
    for version, weights in ((1, v1), (2, v2)):
        base = encoder.begin()
        for i in range(plan.num_buckets):
            message = encoder.encode(pack_bucket(plan, i, weights, version), base)
            is_delta = read_delta(message) is not None
            assert is_delta == (version == 2 and i == 1), (version, i)
            base_bucket = staging.base(1, i)
            with staging.receiving(version, i, "rollout-0") as dst:
                apply(plan, message, dst, base_bucket, "rollout-0")
        encoder.end(version)
    live = {n: torch.zeros_like(t) for n, t in v2.items()}
    assert staging.swap_into(live) == 2
    assert all(torch.equal(live[n], t) for n, t in v2.items())


def test_fp32_pushes_after_an_adam_step_travel_whole():
    trainer = stepped_trainer(lr=1e-4)
    plan = plan_of(trainer, torch.float32)
    peers = Peers("object_store", plan, n=1)
    peers.push(pushed(trainer, torch.float32), 0)
    trainer.train_step(random_samples(2, 4, seed=1))
    assert peers.push(pushed(trainer, torch.float32), 1) == full_bytes(plan)
    peers.assert_hold(pushed(trainer, torch.float32), 1)


def staged_delta(damage: str) -> tuple[BucketPlan, StagingBuffer, torch.Tensor]:
    """Version 1 staged and installed, and bucket 0 of version 2 (b changed in one element) as a
    delta, damaged as told: "none", "value" (a changed element's bits on the way) or "base" (a
    byte of the receiver's copy of version 1)."""
    plan, v1 = two_buckets(), tensors(1)
    encoder, staging = DeltaEncoder(plan), StagingBuffer(plan)
    v2 = {"a": v1["a"].clone(), "b": v1["b"]}
    v2["a"][7] += 1
    for i in range(plan.num_buckets):
        staging.write(encoder.encode(pack_bucket(plan, i, v1, 1), encoder.begin()))
    encoder.end(1)
    staging.swap_into({n: torch.zeros_like(t) for n, t in v1.items()})
    message = encoder.encode(pack_bucket(plan, 0, v2, 2), encoder.begin())
    assert read_delta(message) is not None
    if damage == "value":
        message[64] ^= 1  # the first changed element's value, lowest bit
    if damage == "base":
        staging.base(1, 0)[64 + 100] ^= 1  # a's 51st element, not changed by the delta
    return plan, staging, message


@pytest.mark.parametrize("damage", ["value", "base"])
def test_a_damaged_delta_fails_its_checksum_and_the_version_is_dropped(damage):
    plan, staging, message = staged_delta(damage)
    base = staging.base(1, 0)
    with pytest.raises(TandemError, match="rollout-3: bucket 0 of weight version 2 .*failed its checksum"):
        with staging.receiving(2, 0, "rollout-3") as dst:
            apply(plan, message, dst, base, "rollout-3")
    assert staging.held_version is None and staging.base(1, 0) is None  # rebuilt in place, then dropped


def test_an_intact_delta_passes_its_checksum():
    plan, staging, message = staged_delta("none")
    base = staging.base(1, 0)  # before receiving: from then on the bucket is being written
    with staging.receiving(2, 0, "rollout-3") as dst:
        apply(plan, message, dst, base, "rollout-3")
    assert staging.base(2, 0) is not None and staging.base(1, 1) is not None


def test_a_delta_never_writes_over_a_version_still_waiting_to_be_installed():
    plan, v1 = two_buckets(), tensors(1)
    v2 = {n: t.clone() for n, t in v1.items()}
    v2["b"][0, 0] += 1
    encoder, staging = DeltaEncoder(plan), StagingBuffer(plan)
    for version, weights in ((1, v1), (2, v2)):  # version 1 stays ready, not swapped
        base = encoder.begin()
        for i in range(plan.num_buckets):
            message = encoder.encode(pack_bucket(plan, i, weights, version), base)
            base_bucket = None if base is None else staging.base(base, i)
            with staging.receiving(version, i, "rollout-0") as dst:
                apply(plan, message, dst, base_bucket, "rollout-0")
        encoder.end(version)
    live = {n: torch.zeros_like(t) for n, t in v1.items()}
    for version, weights in ((1, v1), (2, v2)):
        assert staging.swap_into(live, version=version) == version
        assert all(torch.equal(live[n], t) for n, t in weights.items())


def test_sync_delta_is_off_by_default():
    assert Config().sync.delta is False


class Member:
    """A trainer's rank 0 (fp32 masters, sends in bf16) or a rollout worker, as a Ray actor."""

    def __init__(self, name: str):
        self.master = tiny_model(seed=3)
        self.plan = BucketPlan.from_named_tensors(
            self.master.named_parameters(), 4 * KB, 2 * KB, torch.bfloat16
        )
        self.transport = ObjectStoreTransport(self.plan, name, delta=True)
        self.staging = StagingBuffer(self.plan)

    def step(self, seed: int) -> None:
        """An Adam-sized step: every master weight moves by 1e-5, up or down."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.master.parameters():
                p.add_(torch.randn(p.shape, generator=g).sign(), alpha=1e-5)

    def pushed(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().bfloat16() for n, p in self.master.named_parameters()}

    def send(self, version: int):
        return self.transport.send(self.pushed().items(), version)

    def receive(self, handle, version: int) -> dict[str, torch.Tensor]:
        """Stage and install `version` -> the installed weights."""
        self.transport.receive(handle, version, self.staging, timeout_s=30)
        live = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in self.plan.specs}
        self.staging.swap_into(live, version)
        return live


@pytest.mark.ray
def test_object_store_deltas_reach_a_restarted_worker_through_ray(ray_local):
    ray = local_ray()  # started again if a module before stopped the session's
    actor = ray.remote(Member)
    sender, worker = actor.remote("trainer-0"), actor.remote("rollout-0")
    for version in range(3):
        if version:
            ray.get(sender.step.remote(version))
        send = sender.send.remote(version)  # passed on as the driver does: the receive gets the handle
        got, expected = ray.get([worker.receive.remote(send, version), sender.pushed.remote()])
        assert all(torch.equal(got[n], t) for n, t in expected.items()), version
    assert [p.version for p in ray.get(send).chain] == [0, 1]  # version 2 went as a delta against 1
    restarted = actor.remote("rollout-0")
    got = ray.get(restarted.receive.remote(send, 2))
    assert all(torch.equal(got[n], t) for n, t in expected.items())


@pytest.mark.ray
@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_a_run_s_actors_push_deltas_that_land_bit_for_bit(ray_local, transport):
    from tandem.runtime.cluster import RayCluster

    ray = local_ray()  # started again if a module before stopped the session's
    options = [f"sync.transport={transport}", "sync.delta=true", "rollout.dtype=bfloat16", "train.lr=1e-6"]
    cluster = RayCluster.start(devices.resolve(load_config(None, [*TINY, *options]), 0))
    try:
        trainer, rollout = cluster.trainers[0], cluster.rollouts[0]
        for version in (1, 2):  # 1: a full push (the trainer has no copy yet); 2: deltas against 1
            ray.get(trainer.train_step.remote(random_samples(4, 4, seed=version)))
            send = trainer.send_weights.remote(version)
            ray.get(
                [send, rollout.receive_weights.remote(send if transport == "object_store" else None, version)]
            )
            assert ray.get(rollout.apply_pending.remote()) == version
            engine, after = ray.get(rollout.weights.remote())[1], ray.get(trainer.weights.remote())
            assert all(torch.equal(engine[n], after[n].bfloat16()) for n in after), version
        if transport == "object_store":
            assert [p.version for p in ray.get(send)[0].chain] == [1]
    finally:
        cluster.close()
