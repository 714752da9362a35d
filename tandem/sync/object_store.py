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

Delta pushes (`delta=True`, tandem/sync/delta.py): the sender cannot know which version each
receiver holds (a restarted worker is re-synced with the last handle), so every handle carries the
chain it needs: the refs of the last full push and of every delta push since, oldest first. A
receiver holding the newest push's base applies that one delta; any other (restarted, or it missed
a push) rebuilds the version from the chain, i.e. gets the full push. A push is full again once the
deltas since the last full one add up to its bytes, so the object store holds at most about two
versions' bytes for the chain (plus the previous chain until its receivers are done with it), and a
receiver rebuilding from it reads at most about that much.

Ray is imported inside `send` / `receive` only, so `import tandem.sync` does not import Ray. In a
run held in one process (`tandem.runtime.local.LocalCluster`, Ray not started) the "object" is the
bucket's array itself, handed from the trainer to the engine in memory; nothing keeps a full push's
arrays once the engines have them (the loop lets go of the last handle where no worker restarts).
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
from tandem.sync.delta import DeltaEncoder, apply
from tandem.sync.plan import MB, BucketPlan, TensorSpec
from tandem.sync.protocol import TRANSPORTS
from tandem.sync.staging import StagingBuffer


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _put(array: np.ndarray, owned: bool = False) -> Any:
    """`array` into Ray's object store -> its ObjectRef. Where Ray is not running (a run in one
    process): the array itself when it is the caller's to give away (`owned`), else a copy."""
    if _ray_running():
        return sys.modules["ray"].put(array)
    return array if owned else array.copy()


@dataclass(frozen=True)
class Push:
    """One earlier push of a delta chain: its version and its refs (a bucket or a delta each)."""

    version: int
    refs: tuple[Any, ...]


@dataclass(frozen=True)
class ObjectStoreHandle:
    """What the driver passes from the sender to the receivers for one version."""

    version: int
    fingerprint: int
    produce_bytes: int
    specs: tuple[TensorSpec, ...]  # lets a receiver with another plan name the first difference
    refs: tuple[Any, ...]  # one ray.ObjectRef per bucket, in bucket order: a bucket or its delta
    # Delta pushes: the pushes since the last full one, oldest first (chain[0] is that full push);
    # `refs` are deltas against chain[-1]. Empty for a full push.
    chain: tuple[Push, ...] = ()


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
        delta: bool = False,
    ):
        """delta: send each bucket as its delta against the last version sent where that is smaller
        (sync.delta); receivers need no setting, what arrives says what it is."""
        self.plan = plan
        self.worker_name = worker_name
        self.timeout_s = timeout_s  # unused: a put does not wait for anyone
        self.delta = DeltaEncoder(plan) if delta else None
        self.sent_bytes = 0  # bytes the last push put, headers included
        self._sent: ObjectStoreHandle | None = None  # keeps the last version's objects alive
        self._full_bytes = self._chain_bytes = 0  # the chain's full push, and its deltas since
        self._scratch: Tensor | None = None

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> ObjectStoreHandle:
        """Pack and put every bucket of `version` (or its delta) -> the handle for the receivers."""
        tensors = collect(self.plan, named_tensors)
        base = self._delta_base()
        refs, self.sent_bytes = [], 0
        # Ray's put copies, so one scratch buffer serves every bucket. In one process a full push
        # hands each bucket over as it is, packed into a buffer of its own: a scratch buffer would
        # hold another bucket's bytes (512 MB) for the whole run, beside the copies.
        scratch = _ray_running() or self.delta is not None
        for i in range(self.plan.num_buckets):
            out = self._buffer(tensors) if scratch else None
            bucket = pack_bucket(self.plan, i, tensors, version, out=out).cpu()
            message = bucket if self.delta is None else self.delta.encode(bucket, base)
            refs.append(_put(message.numpy(), owned=not scratch))
            self.sent_bytes += message.numel()
        chain = () if base is None else (*self._sent.chain, Push(self._sent.version, self._sent.refs))
        plan = self.plan
        sent = ObjectStoreHandle(
            version, plan.fingerprint, plan.produce_bytes, tuple(plan.specs), tuple(refs), chain
        )
        # Ray frees an object its owner lets go of, and a delta chain is built on the last push: both
        # keep it. A full push in one process is the buckets themselves, freed once the receivers
        # are done with the handle (as many bytes as the weights in the engines' dtype).
        self._sent = sent if scratch else None
        if self.delta is not None:
            self.delta.end(version)
            self._chain_bytes = 0 if base is None else self._chain_bytes + self.sent_bytes
            self._full_bytes = self.sent_bytes if base is None else self._full_bytes
        return sent

    def _delta_base(self) -> int | None:
        """The version this push's deltas are taken against: the last one sent, unless there is
        none (first push, or the last failed half way) or the chain has grown to a full push's
        bytes; None -> a full push, which starts a new chain."""
        if self.delta is None:
            return None
        base = self.delta.begin()
        return base if base is not None and self._chain_bytes < self._full_bytes else None

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
        """Get every bucket of the handle into `staging` within timeout_s (one deadline for all).
        A delta push is applied to the version this worker holds if that is its base; else the
        version is rebuilt from the handle's chain (the last full push, then each delta since)."""
        self._check_handle(handle, version)
        deadline = time.monotonic() + timeout_s
        pushes, base = _route(handle, staging.held_version)
        for i in range(self.plan.num_buckets):
            arrays = [self._get(p.refs[i], i, p.version, deadline, timeout_s) for p in pushes]
            start = None if base is None else staging.base(base, i)
            with staging.receiving(version, i, self.worker_name) as dst:
                for array in arrays:
                    apply(self.plan, _tensor(array), dst, start, self.worker_name)
                    start = dst  # the next delta of the chain applies to what this one rebuilt

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


def _route(handle: ObjectStoreHandle, held: int | None) -> tuple[tuple[Push, ...], int | None]:
    """(the pushes a receiver holding version `held` applies, oldest first; the version the first
    applies to, None when it is a full push)."""
    newest = Push(handle.version, handle.refs)
    if handle.chain and handle.chain[-1].version == held:
        return (newest,), held
    return (*handle.chain, newest), None


def _tensor(array: np.ndarray) -> Tensor:
    with warnings.catch_warnings():  # the array is read-only shared memory; we only read it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)
