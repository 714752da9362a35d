"""BroadcastTransport: buckets travel by torch.distributed broadcast from the trainer's rank 0.

One process group spans the sender (rank 0) and the R receivers (ranks 1..R): the weight-sync group
of tandem.sync.dist, its own group outside torch.distributed's default world (gloo for CPU tensors,
NCCL for CUDA tensors); the lead creates it and hands it here. The
plan is static, so no metadata travels: the sender broadcasts bucket 0, 1, ... in order, each with
its header, and every receiver takes them straight into its staging buffer. The sender packs bucket
i+1 while bucket i is on the wire (two pack buffers).

Every wait is `Work.wait(timeout)`: a missing peer raises a TandemError naming the worker and the
version instead of hanging. A timed-out collective leaves the group unusable (its queued operation
may still complete later), so the transport refuses further use and the lead must build a new group.
"""

import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from tandem.errors import TandemError
from tandem.sync.bucket import collect, pack_bucket
from tandem.sync.dist import SyncGroup
from tandem.sync.plan import BucketPlan
from tandem.sync.protocol import TRANSPORTS
from tandem.sync.staging import StagingBuffer


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
    ):
        """group: the weight-sync group (tandem.sync.dist.sync_group) holding this process and the
        sender; src_rank: the sender's rank in it; timeout_s: the sender's deadline for one send."""
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
        self._buffers: list[Tensor] = []
        self._broken: str | None = None

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Broadcast every bucket of `version`; returns when the last one has left (handle None)."""
        self._check_usable(version)
        if self.group.rank != self.src_rank:
            raise TandemError(
                f"{self.worker_name}: send called on rank {self.group.rank}, "
                f"the sender is rank {self.src_rank}."
            )
        tensors = collect(self.plan, named_tensors)
        deadline = time.monotonic() + self.timeout_s
        work = None
        n = self.plan.num_buckets
        for i in range(n):
            bucket = pack_bucket(self.plan, i, tensors, version, out=self._buffer(i % 2))
            if work is not None:  # bucket i-1 leaves while bucket i was packed
                self._wait(work, deadline, self.timeout_s, f"sending bucket {i}/{n}", version)
            work = self._broadcast(bucket)
        if work is not None:
            self._wait(work, deadline, self.timeout_s, f"sending bucket {n}/{n}", version)

    def receive(self, handle: Any, version: int, staging: StagingBuffer, timeout_s: float) -> None:
        """Take part in the sender's broadcasts of `version` (handle ignored) into `staging`."""
        self._check_usable(version)
        deadline = time.monotonic() + timeout_s
        for i in range(self.plan.num_buckets):
            with staging.receiving(version, i, self.worker_name) as dst:
                target = dst if dst.device == self.device else self._buffer(0)[: dst.numel()]
                work = self._broadcast(target)
                self._wait(
                    work, deadline, timeout_s, f"receiving bucket {i + 1}/{self.plan.num_buckets}", version
                )
                if target is not dst:
                    dst.copy_(target)

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

    def _wait(self, work: dist.Work, deadline: float, timeout_s: float, what: str, version: int) -> None:
        left = max(deadline - time.monotonic(), 0.001)
        try:
            work.wait(timeout=timedelta(seconds=left))
        except RuntimeError as e:
            self._broken = f"{what} of version {version} failed"
            raise TandemError(
                f"{self.worker_name}: timed out or failed after {timeout_s:g} s {what} of weight version "
                f"{version} (broadcast from rank {self.src_rank}): {e}. Is every peer of the group "
                "running its send/receive? This group is unusable now; build a new one."
            ) from e

    def _check_usable(self, version: int) -> None:
        if self._broken is not None:
            raise TandemError(
                f"{self.worker_name}: cannot move weight version {version}: {self._broken} "
                "earlier and left the process group unusable; build a new group."
            )
