"""Weight sync: bucket layout, the staging dual buffer, and the contract every WeightTransport keeps.

The first half is pure torch (no Ray). The second starts Ray once for the module, with one sender
and two receivers reused by every transport, and checks that after a push and a swap every receiver
parameter equals the sender's bit for bit.
"""

import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import tiny_model

from tandem.errors import TandemError
from tandem.sync import (
    TRANSPORTS,
    BroadcastTransport,
    BucketPlan,
    ObjectStoreHandle,
    ObjectStoreTransport,
    StagingBuffer,
    TensorSpec,
    pack_bucket,
    read_header,
    unpack_bucket,
)
from tandem.sync.plan import HEADER_BYTES, MB

KB = 1 / 1024  # MB


def mixed_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 and bfloat16 of odd sizes, a scalar, an empty tensor and an int64 one."""
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(3, 5, generator=g),
        "b": torch.randn(7, generator=g).bfloat16(),
        "c": torch.randn((), generator=g),
        "d": torch.randn(5, 3, generator=g).bfloat16(),
        "e": torch.arange(11) * (seed + 1),
        "f": torch.empty(0, 4),
        "g": torch.randn(300, generator=g).bfloat16(),
        "h": torch.randn(129, generator=g),
    }


def plan_for(tensors: dict[str, torch.Tensor], produce_mb: float, consume_mb: float = 0) -> BucketPlan:
    return BucketPlan.from_named_tensors(tensors.items(), produce_mb, consume_mb)


def pack_all(plan: BucketPlan, tensors: dict[str, torch.Tensor], version: int) -> list[torch.Tensor]:
    return [pack_bucket(plan, i, tensors, version).clone() for i in range(plan.num_buckets)]


def stage(staging: StagingBuffer, buckets: list[torch.Tensor]) -> None:
    for b in buckets:
        staging.write(b)


# ---- bucket plan, pack, unpack ---------------------------------------------------------------


@pytest.mark.parametrize("produce_mb", [0, 0.5 * KB, 1.0])
def test_pack_unpack_round_trip(produce_mb):
    tensors = mixed_tensors()
    plan = plan_for(tensors, produce_mb)
    seen = {}
    for i, bucket in enumerate(pack_all(plan, tensors, version=7)):
        header = read_header(bucket)
        assert (header.version, header.index, header.num_buckets) == (7, i, plan.num_buckets)
        assert bucket.numel() == plan.bucket_nbytes[i]
        seen.update(unpack_bucket(plan, bucket, version=7))
    assert list(seen) == list(tensors)
    for name, t in tensors.items():
        assert seen[name].dtype == t.dtype and torch.equal(seen[name], t), name


def test_bucket_boundaries():
    tensors = mixed_tensors()
    per_tensor = plan_for(tensors, produce_mb=16 / MB)  # 16 bytes: smaller than most tensors
    assert per_tensor.num_buckets == len(tensors)
    assert plan_for(tensors, produce_mb=1.0).num_buckets == 1
    mid = plan_for(tensors, produce_mb=256 / MB)
    assert 1 < mid.num_buckets < len(tensors)
    for slots, nbytes in zip(mid.buckets, mid.bucket_nbytes, strict=True):
        assert nbytes - HEADER_BYTES <= mid.produce_bytes or len(slots) == 1  # a big tensor goes alone
        assert all(s.offset % 64 == 0 for s in slots)
    assert [s.name for s in mid.specs] == [s.spec.name for b in mid.buckets for s in b]


def test_pack_casts_to_the_plans_dtype():
    tensors = {"w": torch.randn(5, 7), "i": torch.arange(3)}
    plan = BucketPlan.from_named_tensors(tensors.items(), 1.0, 0, dtype=torch.bfloat16)
    out = unpack_bucket(plan, pack_bucket(plan, 0, tensors, 1))
    assert out["w"].dtype == torch.bfloat16 and torch.equal(out["w"], tensors["w"].bfloat16())
    assert out["i"].dtype == torch.int64  # only floating tensors change dtype


def test_mismatched_plans_name_the_difference():
    base = [TensorSpec("a", (3, 5), torch.float32), TensorSpec("b", (7,), torch.bfloat16)]
    plan = BucketPlan(base, 1.0, 0)
    others = {
        "b (8,)": [base[0], TensorSpec("b", (8,), torch.bfloat16)],
        "b (7,) float32": [base[0], TensorSpec("b", (7,), torch.float32)],
        "c (7,)": [base[0], TensorSpec("c", (7,), torch.bfloat16)],
        "2 tensors": base[:1],
    }
    for expected, specs in others.items():
        other = BucketPlan(specs, 1.0, 0)
        assert other.fingerprint != plan.fingerprint
        with pytest.raises(TandemError, match=re.escape(expected)):
            plan.check_same_layout(other)
    with pytest.raises(TandemError, match="produce_bucket_mb"):
        plan.check_same_layout(BucketPlan(base, 2.0, 0))
    assert BucketPlan(base, 1.0, 0.25).fingerprint == plan.fingerprint  # consume size is local
    foreign = BucketPlan(
        [TensorSpec("a", (3, 5), torch.float32), TensorSpec("b", (8,), torch.bfloat16)], 1.0, 0
    )
    bucket = pack_bucket(foreign, 0, {"a": torch.zeros(3, 5), "b": torch.zeros(8)}, 1)
    with pytest.raises(TandemError, match="another sync plan"):
        StagingBuffer(plan).write(bucket, worker="rollout-3")


def test_send_checks_names_and_shapes():
    tensors = mixed_tensors()
    t = ObjectStoreTransport(plan_for(tensors, 1.0), "trainer-0")
    with pytest.raises(TandemError, match="missing \\['h'\\]"):
        t.send([(n, x) for n, x in tensors.items() if n != "h"], 1)
    with pytest.raises(TandemError, match="shape"):
        t.send({**tensors, "a": torch.zeros(5, 3)}.items(), 1)


@pytest.mark.parametrize("consume_mb", [100 / MB, 0.5 * KB, 0])
def test_consumer_chunks_are_bounded_and_cover_every_byte(consume_mb):
    tensors = mixed_tensors()
    plan = plan_for(tensors, produce_mb=1.0, consume_mb=consume_mb)
    covered = {s.name: torch.zeros(s.nbytes, dtype=torch.int32) for s in plan.specs}
    for chunk in plan.chunks:
        if plan.consume_bytes:
            assert chunk.end - chunk.start <= plan.consume_bytes
        for p in chunk.pieces:
            assert 0 <= p.src and p.src + p.nbytes <= chunk.end - chunk.start
            covered[p.name][p.dst : p.dst + p.nbytes] += 1
    assert all(bool((c == 1).all()) for c in covered.values())
    if consume_mb == 100 / MB:
        assert len(plan.chunks) > 4  # the 600-byte and 516-byte tensors are cut
    live = {n: torch.zeros_like(t) for n, t in tensors.items()}
    staging = StagingBuffer(plan)
    stage(staging, pack_all(plan, tensors, 3))
    assert staging.swap_into(live) == 3
    assert all(torch.equal(live[n], t) for n, t in tensors.items())


# ---- staging --------------------------------------------------------------------------------


def test_staging_keeps_live_weights_until_swap():
    v1, v2 = mixed_tensors(1), mixed_tensors(2)
    plan = plan_for(v1, produce_mb=256 / MB, consume_mb=128 / MB)
    live = {n: torch.zeros_like(t) for n, t in v1.items()}
    staging = StagingBuffer(plan)
    b1 = pack_all(plan, v1, 1)
    stage(staging, b1[:-1])
    assert staging.ready_version is None
    with pytest.raises(TandemError, match="version 1: .* buckets"):
        staging.swap_into(live)
    assert staging.swap_if_ready(live) is None
    assert all(not t.any() for t in live.values())  # incomplete: live weights untouched
    staging.write(b1[-1])
    assert staging.ready_version == 1 and all(not t.any() for t in live.values())
    stage(staging, pack_all(plan, v2, 2)[:1])  # v2 starts streaming in; v1 stays swappable
    assert staging.swap_into(live) == 1 and staging.live_version == 1
    assert all(torch.equal(live[n], t) for n, t in v1.items())
    with pytest.raises(TandemError, match="not fully staged"):
        staging.swap_into(live)


def test_staging_newer_version_replaces_older():
    vs = {v: mixed_tensors(v) for v in (1, 2, 3, 4)}
    plan = plan_for(vs[1], produce_mb=256 / MB)
    buckets = {v: pack_all(plan, t, v) for v, t in vs.items()}
    live = {n: torch.zeros_like(t) for n, t in vs[1].items()}
    staging = StagingBuffer(plan)
    stage(staging, buckets[1][:2])  # incomplete v1 ...
    stage(staging, buckets[2][:1])  # ... is dropped when v2 starts
    assert staging.replaced == 1
    with pytest.raises(TandemError, match="arrived after version 2"):
        staging.write(buckets[1][2])  # buckets of two versions never mix
    stage(staging, buckets[2][1:])
    stage(staging, buckets[3])  # both v2 and v3 staged: the newest wins the swap
    assert staging.ready_version == 3
    stage(staging, buckets[4][:1])  # a third version takes the oldest ready one's area
    assert staging.replaced == 2
    with pytest.raises(TandemError, match="version 2 is not fully staged"):
        staging.swap_into(live, version=2)
    assert staging.swap_into(live) == 3
    assert all(torch.equal(live[n], t) for n, t in vs[3].items())
    assert staging.ready_version is None


def test_staging_swap_and_receive_on_two_threads_never_mix():
    """One thread stages versions 1..N (every weight = its version) while another swaps."""
    shapes = {"w0": (33, 7), "w1": (5,), "w2": (64, 64), "w3": (3,), "w4": (129,), "w5": (17, 2)}
    plan = BucketPlan([TensorSpec(n, s, torch.float32) for n, s in shapes.items()], 8 * KB, KB)
    live = {n: torch.zeros(s) for n, s in shapes.items()}
    staging = StagingBuffer(plan)
    last = 30

    def receive():
        for v in range(1, last + 1):
            stage(staging, pack_all(plan, {n: torch.full(s, float(v)) for n, s in shapes.items()}, v))

    writer = threading.Thread(target=receive)
    writer.start()
    swapped = []
    while writer.is_alive() or staging.ready_version is not None:
        v = staging.swap_if_ready(live)
        if v is not None:
            swapped.append(v)
            assert all(bool((t == v).all()) for t in live.values()), f"version {v} mixed"
    writer.join()
    assert swapped == sorted(swapped) and swapped[-1] == last and len(swapped) > 1


def test_failed_receive_drops_the_partial_version_and_a_retry_works():
    tensors = mixed_tensors()
    plan = plan_for(tensors, produce_mb=256 / MB)
    buckets = pack_all(plan, tensors, 4)
    staging = StagingBuffer(plan)
    staging.write(buckets[0])
    with pytest.raises(RuntimeError, match="timed out"):
        with staging.receiving(4, 1, worker="rollout-1"):
            raise RuntimeError("timed out")  # as a network receive would
    stage(staging, buckets[1:])
    assert staging.ready_version is None  # bucket 0 went with the failed attempt
    staging.write(buckets[0])
    live = {n: torch.zeros_like(t) for n, t in tensors.items()}
    assert staging.swap_into(live) == 4
    assert all(torch.equal(live[n], t) for n, t in tensors.items())


@pytest.mark.gpu
def test_swap_into_cuda_parameters_from_pinned_staging():
    tensors = mixed_tensors()
    plan = plan_for(tensors, produce_mb=256 / MB, consume_mb=128 / MB)
    staging = StagingBuffer(plan)
    assert staging.pin_memory
    stage(staging, pack_all(plan, tensors, 1))
    live = {n: torch.zeros_like(t, device="cuda") for n, t in tensors.items()}
    assert staging.swap_into(live) == 1
    assert all(torch.equal(live[n].cpu(), t) for n, t in tensors.items())


def test_wait_ready_times_out_with_the_worker_name():
    staging = StagingBuffer(plan_for(mixed_tensors(), 1.0))
    start = time.monotonic()
    with pytest.raises(TandemError, match="rollout-2: no weight version"):
        staging.wait_ready(0.2, worker="rollout-2")
    assert time.monotonic() - start < 2


def test_the_broadcast_transport_without_a_sync_group_says_so():
    plan = plan_for(mixed_tensors(), 1.0)
    with pytest.raises(TandemError, match="rollout-3: the broadcast transport needs the weight-sync group"):
        BroadcastTransport(plan, "rollout-3", group=None)


def test_importing_tandem_sync_does_not_import_ray():
    code = "import sys, tandem.sync; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the transport contract, on Ray -----------------------------------------------------------

ray = pytest.importorskip("ray")


@ray.remote(max_concurrency=2)  # receive on one thread while another could swap
class Peer:
    """A trainer rank 0 or a rollout worker: a tiny model, a staging buffer and one transport."""

    def __init__(self, name: str, seed: int):
        from tandem.sync import dist

        self.name, self.seed, self.dist = name, seed, dist
        self.model = tiny_model(seed)
        self.plan = BucketPlan.from_named_tensors(self.model.named_parameters(), 4 * KB, 2 * KB)
        self.groups = {}

    def rendezvous(self) -> tuple[str, int, int]:
        return "127.0.0.1", self.dist.free_port(), self.dist.free_port()

    def join(self, rank: int, world: int, addr: str, port: int, pair_port: int) -> None:
        """The weight-sync groups, after (on receivers) a default torch.distributed world of one,
        which is what vLLM makes in a rollout worker's process: the sync group must live beside it."""
        if rank > 0:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{self.dist.free_port()}", rank=0, world_size=1
            )
        self.groups["all"] = self.dist.sync_group(rank, world, addr, port, timeout_s=30)
        if rank < 2:  # sender + first receiver
            self.groups["pair"] = self.dist.sync_group(rank, 2, addr, pair_port, timeout_s=30)

    def use(self, transport: str, group: str = "all") -> None:
        """Fresh weights from this peer's seed, a fresh staging buffer, the named transport."""
        self.model = tiny_model(self.seed)
        self.staging = StagingBuffer(self.plan)
        self.transport = TRANSPORTS.get(transport)(
            self.plan, self.name, group=self.groups[group], timeout_s=30
        )

    def send(self, version: int):
        return self.transport.send(((n, p.detach()) for n, p in self.model.named_parameters()), version)

    def receive(self, handle, version: int, timeout_s: float = 30) -> None:
        self.transport.receive(handle, version, self.staging, timeout_s)

    def swap(self) -> int:
        return self.staging.swap_into(dict(self.model.named_parameters()))

    def step(self, seed: int) -> None:
        """An optimizer-like in-place update of every parameter."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=g), alpha=1e-2)

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


@pytest.fixture(scope="module")
def peers():
    if ray.is_initialized():
        ray.shutdown()
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = {"PYTHONPATH": tests_dir}
    ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env={"env_vars": env})
    sender = Peer.remote("trainer-0", seed=0)
    receivers = [Peer.remote(f"rollout-{i}", seed=10 + i) for i in range(2)]
    addr, port, pair_port = ray.get(sender.rendezvous.remote())
    everyone = [sender, *receivers]
    ray.get([p.join.remote(rank, len(everyone), addr, port, pair_port) for rank, p in enumerate(everyone)])
    yield sender, receivers
    ray.shutdown()


def push(sender, receivers, version: int, collective: bool) -> None:
    """What the driver does: start the send, hand its result (or None) to every receive, wait."""
    send_ref = sender.send.remote(version)
    receives = [r.receive.remote(None if collective else send_ref, version) for r in receivers]
    ray.get([send_ref, *receives])


def assert_same_weights(sender, receivers) -> None:
    expected = ray.get(sender.weights.remote())
    for got in ray.get([r.weights.remote() for r in receivers]):
        assert list(got) == list(expected)
        for name, t in expected.items():
            assert torch.equal(got[name], t), name


@pytest.mark.ray
@pytest.mark.parametrize("transport", TRANSPORTS.names())
def test_transport_contract(peers, transport):
    sender, receivers = peers
    ray.get([p.use.remote(transport) for p in (sender, *receivers)])
    assert not torch.equal(
        *[ray.get(p.weights.remote())["model.embed_tokens.weight"] for p in (sender, receivers[0])]
    )
    collective = TRANSPORTS.get(transport).collective
    for version in (1, 2):
        if version == 2:
            ray.get(sender.step.remote(seed=version))
        push(sender, receivers, version, collective)
        assert ray.get([r.swap.remote() for r in receivers]) == [version] * len(receivers)
        assert_same_weights(sender, receivers)


@pytest.mark.ray
def test_object_store_receive_times_out_without_a_sender(peers):
    sender, _ = peers
    plan = BucketPlan([TensorSpec("w", (4,), torch.float32)], 1.0, 0)
    never = ray.ObjectRef.from_random()  # a ref that no sender will ever fill
    handle = ObjectStoreHandle(5, plan.fingerprint, plan.produce_bytes, tuple(plan.specs), (never,))
    start = time.monotonic()
    with pytest.raises(TandemError, match="rollout-7: bucket 1/1 of weight version 5 did not arrive"):
        ObjectStoreTransport(plan, "rollout-7").receive(handle, 5, StagingBuffer(plan), timeout_s=0.5)
    assert time.monotonic() - start < 5


@pytest.mark.ray
def test_broadcast_receive_times_out_without_a_sender(peers):
    sender, receivers = peers
    ray.get([p.use.remote("broadcast", group="pair") for p in (sender, receivers[0])])
    start = time.monotonic()
    with pytest.raises(TandemError, match="rollout-0: timed out .* of weight version 9"):
        ray.get(receivers[0].receive.remote(None, 9, timeout_s=1.0))
    assert time.monotonic() - start < 8
    with pytest.raises(TandemError, match="unusable"):
        ray.get(receivers[0].receive.remote(None, 10, timeout_s=1.0))
