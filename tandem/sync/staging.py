"""StagingBuffer: where a rollout worker receives the next weights while it keeps generating.

Dual buffering: the engine serves its live parameters while the buckets of version v land in a
staging area; once all of v's buckets have arrived, v is "ready", and `swap_into(params)` copies it
into the live parameters at a safe point the caller chooses (between generate calls or decode
steps), in chunks of `plan.consume_bytes`.

Two staging areas, allocated on first use (the second only when a version arrives while another
one is ready and not yet swapped), so a ready version is never overwritten by the next one:

- a newer version's first bucket drops any older version that is still incomplete (its remaining
  buckets will never come);
- a ready version stays swappable while the next one streams in; when a third version needs the
  space, the oldest ready one is dropped (counted in `replaced`, logged);
- `swap_into(params)` installs the newest ready version and drops everything older;
- a bucket older than the newest version seen raises: buckets of two versions never mix.

A swap leaves an area's bytes in place, and each area records which version every bucket of it
holds (`held_version`, `base`): a delta push (tandem/sync/delta.py) is rebuilt from them, so the
version last installed stays a base until a newer one is received over it, in place, each bucket's
old bytes read just before they are written.

Thread-safe: buckets are received on one thread (`receiving`, `write`) while another swaps; a lock
guards the bookkeeping, and bytes are copied into an area only while that area is not ready, so a
swap never reads bytes being written.
"""

import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tandem.errors import TandemError
from tandem.sync.bucket import check_header, read_header
from tandem.sync.plan import BucketPlan

log = logging.getLogger("tandem.sync")


@dataclass
class _Area:
    """One staging area: the concatenated buckets of one version, and which have arrived."""

    data: Tensor | None = None  # uint8 (plan.total_bytes,), allocated on first use
    version: int | None = None
    arrived: set[int] = field(default_factory=set)
    writers: int = 0  # receives in flight into this area
    held: dict[int, int] = field(default_factory=dict)  # bucket -> the version whose bytes it holds


class StagingBuffer:
    """Receives buckets (uint8 tensors from a transport) and installs complete versions.

    device: where staged bytes live (default CPU; pinned when CUDA is there, so chunks copy to the
    GPU asynchronously). Peak extra memory on the parameters' device during a swap: one chunk.
    """

    def __init__(self, plan: BucketPlan, device: str | torch.device = "cpu", pin_memory: bool | None = None):
        self.plan = plan
        self.device = torch.device(device)
        cpu = self.device.type == "cpu"
        self.pin_memory = (cpu and torch.cuda.is_available()) if pin_memory is None else pin_memory
        self.live_version: int | None = None  # the version last swapped into parameters
        self.replaced = 0  # versions dropped before they were swapped
        self._areas = [_Area(), _Area()]
        self._newest: int | None = None  # newest version seen, staged or live
        self._cond = threading.Condition()

    # ---- receiving -------------------------------------------------------------------------

    @contextmanager
    def receiving(self, version: int, index: int, worker: str = "receiver") -> Iterator[Tensor]:
        """Yield the uint8 (plan.bucket_nbytes[index],) tensor to receive bucket `index` of `version`
        into; on exit its header is checked and the bucket counts as arrived. On an exception the
        version's partial data is dropped and its area's memory replaced, since a timed-out network
        receive may still write into it later."""
        with self._cond:
            area = self._admit(version, worker)
            area.arrived.discard(index)
            area.held.pop(index, None)
            area.writers += 1
            start = self.plan.bucket_offsets[index]
            view = area.data[start : start + self.plan.bucket_nbytes[index]]
        try:
            yield view
        except BaseException:
            with self._cond:
                area.writers -= 1
                area.data, area.version = None, None
                area.arrived.clear()
                area.held.clear()
            raise
        with self._cond:
            area.writers -= 1
            if area.version != version:  # a failed receive on another thread dropped the version
                raise TandemError(f"{worker}: version {version} was dropped while bucket {index} arrived.")
            check_header(self.plan, read_header(view), index, version, worker)
            area.arrived.add(index)
            area.held[index] = version
            if len(area.arrived) == self.plan.num_buckets:
                log.debug("%s: version %d staged", worker, version)
                self._cond.notify_all()

    def write(self, bucket: Tensor, worker: str = "receiver") -> None:
        """Stage one packed bucket (uint8 (nbytes,)); its header says which version and index."""
        header = read_header(bucket)
        check_header(self.plan, header, header.index, header.version, worker)
        if bucket.numel() != header.nbytes:
            raise TandemError(
                f"{worker}: bucket {header.index} has {bucket.numel()} bytes, not {header.nbytes}."
            )
        with self.receiving(header.version, header.index, worker) as dst:
            dst.copy_(bucket)

    def _admit(self, version: int, worker: str) -> _Area:
        """The area that takes `version`'s buckets, making room when it is a new version. Lock held."""
        for area in self._areas:
            if area.version == version:
                return area
        if self._newest is not None and version < self._newest:
            raise TandemError(
                f"{worker}: a bucket of version {version} arrived after version {self._newest}; "
                "versions must arrive in increasing order and buckets of two versions never mix."
            )
        for area in self._areas:  # an older, incomplete version will never complete now
            if area.version is not None and not self._complete(area):
                if area.writers:
                    raise TandemError(
                        f"{worker}: version {version} arrived while a receive of "
                        f"version {area.version} is still running."
                    )
                log.info("%s: version %d replaces incomplete version %d", worker, version, area.version)
                self._drop(area)
        area = min(self._areas, key=lambda a: -1 if a.version is None else a.version)
        if area.version is not None:
            log.info(
                "%s: version %d replaces staged version %d, never swapped", worker, version, area.version
            )
            self._drop(area)
        if area.data is None:
            area.data = self._allocate()
        area.version, self._newest = version, version
        return area

    def _allocate(self) -> Tensor:
        return torch.empty(
            self.plan.total_bytes, dtype=torch.uint8, device=self.device, pin_memory=self.pin_memory
        )

    def _drop(self, area: _Area) -> None:
        self.replaced += 1
        area.version = None
        area.arrived.clear()

    def _complete(self, area: _Area) -> bool:
        return area.version is not None and len(area.arrived) == self.plan.num_buckets

    # ---- state -----------------------------------------------------------------------------

    @property
    def ready_version(self) -> int | None:
        """The newest version whose buckets have all arrived and that is not swapped yet."""
        with self._cond:
            return self._ready()

    def _ready(self) -> int | None:
        done = [a.version for a in self._areas if self._complete(a)]
        return max(done) if done else None

    def wait_ready(self, timeout_s: float, worker: str = "receiver") -> int:
        """Block until some version is ready -> that version; TandemError after timeout_s."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready() is not None, timeout=timeout_s):
                raise TandemError(f"{worker}: no weight version was staged within {timeout_s:g} s.")
            return self._ready()

    # ---- what is held, for deltas (tandem/sync/delta.py) ---------------------------------------

    @property
    def held_version(self) -> int | None:
        """The newest version whose every bucket's bytes are still in some area (swapped or not):
        what a delta push may be taken against; None when no whole version is held."""
        with self._cond:
            held = {v for a in self._areas for v in a.held.values()}
            return max((v for v in held if self._holds(v)), default=None)

    def base(self, version: int | None, index: int) -> Tensor | None:
        """Bucket `index` of `version` (uint8 (nbytes,), a view into the area holding it) -> the
        base a delta is applied to; None when no area holds it (or `version` is None). Take it
        before `receiving` the same bucket: from then on its bytes are being written. Receives run
        one at a time, and a swap only reads, so the view stays valid while the caller uses it."""
        with self._cond:
            for area in self._areas:
                if version is not None and area.held.get(index) == version:
                    start = self.plan.bucket_offsets[index]
                    return area.data[start : start + self.plan.bucket_nbytes[index]]
            return None

    def _holds(self, version: int) -> bool:
        return all(any(a.held.get(i) == version for a in self._areas) for i in range(self.plan.num_buckets))

    # ---- swapping --------------------------------------------------------------------------

    def swap_into(self, params: Mapping[str, Tensor], version: int | None = None) -> int:
        """Copy the newest ready version (or exactly `version`) into `params` -> that version.

        params: the live parameters by name (e.g. dict(model.named_parameters())), contiguous,
        with the plan's shapes and dtypes, all on one device. Older staged versions are dropped.
        Raises TandemError when nothing (or not `version`) is ready; the params are then untouched.
        """
        with self._cond:
            target = self._ready() if version is None else version
            area = next((a for a in self._areas if a.version == target and self._complete(a)), None)
            if area is None:
                raise TandemError(self._not_ready_message(version))
            _copy_chunks(self.plan, area.data, params)
            for a in self._areas:
                if a.version is not None and a.version <= target:
                    a.version = None
                    a.arrived.clear()
            self.live_version = target
            return target

    def swap_if_ready(self, params: Mapping[str, Tensor]) -> int | None:
        """swap_into when a version is ready -> its version; None (params untouched) otherwise."""
        with self._cond:
            return self.swap_into(params) if self._ready() is not None else None

    def _not_ready_message(self, version: int | None) -> str:
        staged = ", ".join(
            f"version {a.version}: {len(a.arrived)}/{self.plan.num_buckets} buckets"
            for a in self._areas
            if a.version is not None
        )
        wanted = "any version" if version is None else f"version {version}"
        return f"Cannot swap weights: {wanted} is not fully staged ({staged or 'nothing staged'})."


def _copy_chunks(plan: BucketPlan, staged: Tensor, params: Mapping[str, Tensor]) -> None:
    """Copy staged bytes (plan.total_bytes,) into params, one chunk of <= consume_bytes at a time."""
    flat = _byte_views(plan, params)
    device = next(iter(flat.values())).device if flat else staged.device
    with torch.no_grad():
        for chunk in plan.chunks:
            base = plan.bucket_offsets[chunk.bucket]
            src = staged[base + chunk.start : base + chunk.end]
            if src.device != device:
                src = src.to(device, non_blocking=staged.is_pinned())
            for p in chunk.pieces:
                flat[p.name][p.dst : p.dst + p.nbytes].copy_(src[p.src : p.src + p.nbytes])
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the pinned source may be rewritten once the lock is released


def _byte_views(plan: BucketPlan, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """{name: uint8 (nbytes,) view of the parameter}, checked against the plan."""
    missing = [s.name for s in plan.specs if s.name not in params]
    if missing:
        raise TandemError(f"Cannot swap weights: the model has no parameters {missing[:5]}.")
    views = {}
    for s in plan.specs:
        p = params[s.name].detach()
        if tuple(p.shape) != s.shape or p.dtype != s.dtype or not p.is_contiguous():
            raise TandemError(
                f"Cannot swap weights into {s.name}: it is {tuple(p.shape)} {p.dtype}"
                f"{'' if p.is_contiguous() else ' non-contiguous'}, the plan says {s}."
            )
        views[s.name] = p.reshape(-1).view(torch.uint8)
    return views
