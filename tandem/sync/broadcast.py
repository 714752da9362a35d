"""BroadcastTransport: buckets travel by torch.distributed broadcast from the trainer's rank 0.

One process group spans the sender (rank 0) and the R receivers (ranks 1..R): the weight-sync group
of tandem.sync.dist, its own group outside torch.distributed's default world (gloo for CPU tensors,
NCCL for CUDA tensors); the lead creates it and hands it here. The
plan is static, so no metadata travels: the sender broadcasts bucket 0, 1, ... in order, each with
its header, and every receiver takes them straight into its staging buffer. The sender packs bucket
i+1 while bucket i is on the wire (two pack buffers).

Delta pushes (`delta=True`, tandem/sync/delta.py; every member must be built with the same value):
before a push, one all-reduce tells every member the version each holds (the sender: the last it
sent; a receiver: the newest its staging buffer holds whole), and the buckets go as deltas against
it only when all hold the same one; else the push is full (a fresh member, a resumed run). Each
bucket's message is then preceded by its length: a delta is only sent when it is smaller than the
bucket, so a message as long as the bucket is the whole bucket, received straight into staging.

Every wait is `Work.wait(timeout)`: a missing peer raises a TandemError naming the worker and the
version instead of hanging. A timed-out collective leaves the group unusable (its queued operation
may still complete later), so the transport refuses further use and the lead must build a new group.
"""

import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from tandem.errors import TandemError
from tandem.sync.bucket import collect, pack_bucket
from tandem.sync.delta import DeltaEncoder, apply
from tandem.sync.dist import SyncGroup
from tandem.sync.plan import BucketPlan
from tandem.sync.protocol import TRANSPORTS
from tandem.sync.staging import StagingBuffer


@dataclass(frozen=True)
class _Clock:
    """One send's or receive's deadline, for every wait within it and its error message."""

    deadline: float
    timeout_s: float
    version: int


@TRANSPORTS.register("broadcast")
class BroadcastTransport:
    name: ClassVar[str] = "broadcast"
    collective: ClassVar[bool] = True

    def __init__(
        self,
        plan: BucketPlan,
        worker_name: str,
        group: SyncGroup | None = None,
        src_rank: int = 0,
        timeout_s: float = 300.0,
        delta: bool = False,
    ):
        """group: the weight-sync group (tandem.sync.dist.sync_group) holding this process and the
        sender; src_rank: the sender's rank in it; timeout_s: the sender's deadline for one send;
        delta: delta pushes (sync.delta), the same on every member."""
        if group is None:
            raise TandemError(
                f"{worker_name}: the broadcast transport needs the weight-sync group "
                "(tandem.sync.dist.sync_group), joined by the sender and every receiver first."
            )
        self.plan = plan
        self.worker_name = worker_name
        self.group = group
        self.src_rank = src_rank
        self.timeout_s = timeout_s
        self.device = group.device  # CUDA tensors go over NCCL, CPU tensors over gloo
        self.delta = DeltaEncoder(plan) if delta else None  # the sender's copy: allocated on send only
        self.sent_bytes = 0  # bytes the last push broadcast, headers included
        self._buffers: list[Tensor] = []
        self._broken: str | None = None

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Broadcast every bucket of `version` (or its delta); returns when the last one has left
        (handle None)."""
        self._check_usable(version)
        if self.group.rank != self.src_rank:
            raise TandemError(
                f"{self.worker_name}: send called on rank {self.group.rank}, "
                f"the sender is rank {self.src_rank}."
            )
        tensors = collect(self.plan, named_tensors)
        clock = _Clock(time.monotonic() + self.timeout_s, self.timeout_s, version)
        base = None if self.delta is None else self._agree(self.delta.begin(), clock)
        work, self.sent_bytes = None, 0
        n = self.plan.num_buckets
        for i in range(n):
            bucket = pack_bucket(self.plan, i, tensors, version, out=self._buffer(i % 2))
            message = bucket if self.delta is None else self.delta.encode(bucket, base).to(self.device)
            if work is not None:  # bucket i-1 leaves while bucket i was packed
                self._wait(work, clock, f"sending bucket {i}/{n}")
            if self.delta is not None:
                self._length(message.numel(), clock, f"sending bucket {i + 1}/{n}")
            work = self._broadcast(message)
            self.sent_bytes += message.numel()
        if work is not None:
            self._wait(work, clock, f"sending bucket {n}/{n}")
        if self.delta is not None:
            self.delta.end(version)

    def receive(self, handle: Any, version: int, staging: StagingBuffer, timeout_s: float) -> None:
        """Take part in the sender's broadcasts of `version` (handle ignored) into `staging`."""
        self._check_usable(version)
        clock = _Clock(time.monotonic() + timeout_s, timeout_s, version)
        base = None if self.delta is None else self._agree(staging.held_version, clock)
        n = self.plan.num_buckets
        for i in range(n):
            what = f"receiving bucket {i + 1}/{n}"
            size = self.plan.bucket_nbytes[i] if self.delta is None else self._length(0, clock, what)
            if size == self.plan.bucket_nbytes[i]:
                self._receive_bucket(i, staging, clock, what)
            else:
                self._receive_delta(i, size, staging.base(base, i), staging, clock, what)

    def _receive_bucket(self, i: int, staging: StagingBuffer, clock: _Clock, what: str) -> None:
        """Bucket i, whole, straight into its staging area (through a bounce buffer on another device)."""
        with staging.receiving(clock.version, i, self.worker_name) as dst:
            target = dst if dst.device == self.device else self._buffer(0)[: dst.numel()]
            self._wait(self._broadcast(target), clock, what)
            if target is not dst:
                dst.copy_(target)

    def _receive_delta(
        self, i: int, size: int, base: Tensor | None, staging: StagingBuffer, clock: _Clock, what: str
    ) -> None:
        """Bucket i's delta (`size` bytes), applied to `base` (the agreed version's bucket i)."""
        message = self._buffer(0)[:size]
        self._wait(self._broadcast(message), clock, what)
        with staging.receiving(clock.version, i, self.worker_name) as dst:
            apply(self.plan, message.cpu(), dst, base, self.worker_name)

    def _agree(self, held: int | None, clock: _Clock) -> int | None:
        """Every member's held version -> the one all hold, or None (a full push). One all-reduce
        of (v, -v) under MIN gives the lowest and the highest, so every member decides the same."""
        v = -1 if held is None else held
        both = torch.tensor([v, -v], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._wait(self.group.pg.allreduce([both], opts), clock, "agreeing on the delta's base")
        low, high = both[0].item(), -both[1].item()
        return low if low == high and low >= 0 else None

    def _length(self, nbytes: int, clock: _Clock, what: str) -> int:
        """The sender's `nbytes` of the next message -> on every member."""
        length = torch.tensor([nbytes], dtype=torch.int64, device=self.device)
        self._wait(self._broadcast(length), clock, what)
        return int(length.item())

    def _broadcast(self, tensor: Tensor) -> dist.Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = self.src_rank
        return self.group.pg.broadcast([tensor], opts)

    def _buffer(self, k: int) -> Tensor:
        """Pack / receive buffer k (0 or 1), as big as the largest bucket, on the group's device."""
        while len(self._buffers) <= k:
            size = max(self.plan.bucket_nbytes, default=0)
            self._buffers.append(torch.empty(size, dtype=torch.uint8, device=self.device))
        return self._buffers[k]

    def _wait(self, work: dist.Work, clock: _Clock, what: str) -> None:
        left = max(clock.deadline - time.monotonic(), 0.001)
        try:
            work.wait(timeout=timedelta(seconds=left))
        except RuntimeError as e:
            self._broken = f"{what} of version {clock.version} failed"
            raise TandemError(
                f"{self.worker_name}: timed out or failed after {clock.timeout_s:g} s {what} of weight "
                f"version {clock.version} (broadcast from rank {self.src_rank}): {e}. Is every peer of "
                "the group running its send/receive? This group is unusable now; build a new one."
            ) from e

    def _check_usable(self, version: int) -> None:
        if self._broken is not None:
            raise TandemError(
                f"{self.worker_name}: cannot move weight version {version}: {self._broken} "
                "earlier and left the process group unusable; build a new group."
            )
