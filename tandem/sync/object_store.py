"""ObjectStoreTransport: buckets travel as objects in Ray's object store.

The sender `ray.put`s each packed bucket (as a numpy uint8 array, which Ray stores without pickling
and a receiver on the same node reads with no copy) and returns an `ObjectStoreHandle` holding the
ObjectRefs. Receivers `ray.get` them one by one, with a deadline, into their staging buffer.

ObjectRef lifetime: the objects are owned by the sender's actor (the trainer's rank 0), which
keeps the handle of the last version it sent, so they outlive the method that put them, and Ray
counts the driver and the receivers as borrowers while they hold the handle. They are freed once
the next version has been sent and every borrower has dropped the handle. Pass the handle as it is
(the refs are nested in it, so Ray hands them over as refs and does not fetch them into the call);
if the sender actor dies, its objects are lost and `receive` says so.

Ray is imported inside `send` / `receive` only, so `import tandem.sync` does not import Ray. In a
run held in one process (`tandem.runtime.local.LocalCluster`, Ray not started) the "object" is the
bucket's array itself, handed from the trainer to the engine in memory.
"""

import sys
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from tandem.errors import TandemError
from tandem.sync.bucket import collect, pack_bucket
from tandem.sync.plan import MB, BucketPlan, TensorSpec
from tandem.sync.protocol import TRANSPORTS
from tandem.sync.staging import StagingBuffer


def _put(array: np.ndarray) -> Any:
    """`array` into Ray's object store -> its ObjectRef; a copy of it where Ray is not running (a
    run in one process)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.put(array)
    return array.copy()


@dataclass(frozen=True)
class ObjectStoreHandle:
    """What the driver passes from the sender to the receivers for one version."""

    version: int
    fingerprint: int
    produce_bytes: int
    specs: tuple[TensorSpec, ...]  # lets a receiver with another plan name the first difference
    refs: tuple[Any, ...]  # one ray.ObjectRef per bucket, in bucket order


@TRANSPORTS.register("object_store")
class ObjectStoreTransport:
    name: ClassVar[str] = "object_store"
    collective: ClassVar[bool] = False

    def __init__(
        self,
        plan: BucketPlan,
        worker_name: str,
        group: Any = None,
        src_rank: int = 0,
        timeout_s: float = 300.0,
    ):
        self.plan = plan
        self.worker_name = worker_name
        self.timeout_s = timeout_s  # unused: a put does not wait for anyone
        self._sent: ObjectStoreHandle | None = None  # keeps the last version's objects alive
        self._scratch: Tensor | None = None

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> ObjectStoreHandle:
        """Pack and put every bucket of `version` -> the handle for the receivers."""
        tensors = collect(self.plan, named_tensors)
        refs = []
        for i in range(self.plan.num_buckets):
            bucket = pack_bucket(self.plan, i, tensors, version, out=self._buffer(tensors))
            refs.append(_put(bucket.cpu().numpy()))  # put copies, so one scratch buffer serves all
        plan = self.plan
        self._sent = ObjectStoreHandle(
            version, plan.fingerprint, plan.produce_bytes, tuple(plan.specs), tuple(refs)
        )
        return self._sent

    def _buffer(self, tensors: dict[str, Tensor]) -> Tensor:
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        if self._scratch is None or self._scratch.device != device:
            self._scratch = torch.empty(
                max(self.plan.bucket_nbytes, default=0), dtype=torch.uint8, device=device
            )
        return self._scratch

    def receive(
        self, handle: ObjectStoreHandle, version: int, staging: StagingBuffer, timeout_s: float
    ) -> None:
        """Get every bucket of the handle into `staging` within timeout_s (one deadline for all)."""
        self._check_handle(handle, version)
        deadline = time.monotonic() + timeout_s
        for i, ref in enumerate(handle.refs):
            array = self._get(ref, i, version, deadline, timeout_s)
            with warnings.catch_warnings():  # the array is read-only shared memory; we only read it
                warnings.simplefilter("ignore", UserWarning)
                src = torch.from_numpy(array)
            with staging.receiving(version, i, self.worker_name) as dst:
                dst.copy_(src)

    def _get(self, ref: Any, index: int, version: int, deadline: float, timeout_s: float) -> np.ndarray:
        if isinstance(ref, np.ndarray):  # put in this process, Ray not running (`_put`)
            return ref
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        where = f"{self.worker_name}: bucket {index + 1}/{self.plan.num_buckets} of weight version {version}"
        try:
            return ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
        except GetTimeoutError:
            raise TandemError(
                f"{where} did not arrive from the object store within {timeout_s:g} s."
            ) from None
        except RayError as e:
            raise TandemError(f"{where} is lost (did the sender actor die?): {type(e).__name__}: {e}") from e

    def _check_handle(self, handle: ObjectStoreHandle, version: int) -> None:
        if not isinstance(handle, ObjectStoreHandle):
            raise TandemError(
                f"{self.worker_name}: object_store receive needs the handle send returned, "
                f"got {type(handle).__name__}."
            )
        if handle.version != version:
            raise TandemError(
                f"{self.worker_name}: asked to receive weight version {version}, "
                f"the handle is for version {handle.version}."
            )
        if handle.fingerprint != self.plan.fingerprint:
            sender = BucketPlan(handle.specs, handle.produce_bytes / MB, 0)
            self.plan.check_same_layout(sender, mine=self.worker_name, theirs="sender")
            raise TandemError(f"{self.worker_name}: the sender's sync plan differs from this worker's.")
