"""BucketPlan: the static layout of a model's weights on the wire and in a receiver's staging area.

Built once from the model's (name, shape, dtype) list, identically on the trainer and on every
rollout worker, so only bytes travel. Tensors are laid out in plan order, each at an offset aligned
to 64 bytes (so any dtype can be viewed in place), into buckets of at most `produce_mb` after a
64-byte header; a tensor larger than that gets a bucket of its own. The receiver copies staged
bytes into its parameters in chunks of at most `consume_mb` (a chunk may cut a tensor in two), so
the extra memory it needs on the parameters' device is one chunk. tandem/sync/bucket.py packs.
"""

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from tandem.errors import TandemError

MB = 1 << 20
ALIGN = 64  # byte alignment of every tensor in a bucket; a multiple of every dtype's size
HEADER_BYTES = 64


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{self.name} {tuple(self.shape)} {str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class Slot:
    """Where one tensor's bytes sit: bucket `bucket`, bytes [offset, offset + spec.nbytes)."""

    spec: TensorSpec
    bucket: int
    offset: int


@dataclass(frozen=True)
class Piece:
    """Copy `nbytes` from byte `src` of a chunk to byte `dst` of the flat tensor `name`."""

    name: str
    dst: int
    src: int
    nbytes: int


@dataclass(frozen=True)
class Chunk:
    """Bytes [start, end) of bucket `bucket`, copied to the parameters in one go."""

    bucket: int
    start: int
    end: int
    pieces: tuple[Piece, ...]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class BucketPlan:
    """The layout shared by sender and receivers: which bucket and offset holds each tensor.

    specs: the model's tensors in a fixed order (the sender packs, the receiver unpacks in it).
    produce_mb: bucket size the sender packs and sends (0: one tensor per bucket).
    consume_mb: chunk size the receiver copies into its parameters (0: a whole bucket at a time).
    Only the specs and produce_mb fix the wire layout (and the fingerprint); consume_mb is the
    receiver's own business and may differ between workers.
    """

    def __init__(self, specs: Iterable[TensorSpec], produce_mb: float, consume_mb: float):
        self.specs = list(specs)
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise TandemError("BucketPlan: parameter names repeat; each tensor must be named once.")
        if produce_mb < 0 or consume_mb < 0:
            raise TandemError(f"BucketPlan: bucket sizes must be >= 0 MB, got {produce_mb}, {consume_mb}.")
        self.produce_bytes = round(produce_mb * MB)
        self.consume_bytes = round(consume_mb * MB)
        self.buckets: list[list[Slot]] = _assign(self.specs, self.produce_bytes)
        self.bucket_nbytes = [b[-1].offset + b[-1].spec.nbytes if b else HEADER_BYTES for b in self.buckets]
        # Where each bucket sits in a receiver's staging area: all buckets back to back, aligned.
        self.bucket_offsets = list(accumulate((_align(n) for n in self.bucket_nbytes), initial=0))
        self.total_bytes = self.bucket_offsets.pop()
        self.slots = {s.spec.name: s for b in self.buckets for s in b}
        self.chunks = [c for b in self.buckets for c in _chunks(b, self.consume_bytes)]
        self.fingerprint = _fingerprint(self.specs, self.produce_bytes)

    @classmethod
    def from_named_tensors(
        cls,
        named_tensors: Iterable[tuple[str, Tensor]],
        produce_mb: float,
        consume_mb: float,
        dtype: torch.dtype | None = None,
    ) -> "BucketPlan":
        """A plan for these tensors; `dtype` sends floating tensors in that dtype (pack casts)."""
        specs = []
        for name, t in named_tensors:
            wire = dtype if dtype is not None and t.is_floating_point() else t.dtype
            specs.append(TensorSpec(name, tuple(t.shape), wire))
        return cls(specs, produce_mb, consume_mb)

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data, without headers and padding."""
        return sum(s.nbytes for s in self.specs)

    def check_same_layout(self, other: "BucketPlan", mine: str = "receiver", theirs: str = "sender") -> None:
        """Raise a TandemError naming the first tensor where the two plans disagree."""
        for i, (a, b) in enumerate(zip(self.specs, other.specs, strict=False)):
            if a != b:
                raise TandemError(
                    f"Weight sync plans differ at tensor #{i}: {mine} has {a}, {theirs} has {b}. "
                    "Both sides must describe the same model with the same dtypes."
                )
        if len(self.specs) != len(other.specs):
            raise TandemError(
                f"Weight sync plans differ: {mine} has {len(self.specs)} tensors, "
                f"{theirs} has {len(other.specs)}."
            )
        if self.produce_bytes != other.produce_bytes:
            raise TandemError(
                f"Weight sync plans differ: produce bucket size {self.produce_bytes} B on {mine}, "
                f"{other.produce_bytes} B on {theirs}; sync.produce_bucket_mb must be the same on both."
            )


def _assign(specs: list[TensorSpec], produce_bytes: int) -> list[list[Slot]]:
    """Greedy in order: a tensor joins the open bucket if the bucket stays <= produce_bytes."""
    buckets: list[list[Slot]] = []
    end = 0
    for spec in specs:
        offset = _align(end)
        if not buckets or (buckets[-1] and offset + spec.nbytes - HEADER_BYTES > produce_bytes):
            buckets.append([])
            offset = HEADER_BYTES
        buckets[-1].append(Slot(spec, len(buckets) - 1, offset))
        end = offset + spec.nbytes
    return buckets


def _chunks(slots: list[Slot], consume_bytes: int) -> list[Chunk]:
    """Split a bucket's bytes into ranges of <= consume_bytes (0: the whole bucket in one range)."""
    if not slots:
        return []
    limit = consume_bytes or slots[-1].offset + slots[-1].spec.nbytes
    ranges: list[tuple[int, int]] = []
    start = end = slots[0].offset
    for s in slots:
        s_end = s.offset + s.spec.nbytes
        if s_end - start <= limit:
            end = s_end
            continue
        if end > start:
            ranges.append((start, end))
        start = s.offset
        while s_end - start > limit:  # a tensor bigger than a chunk is cut into full chunks
            ranges.append((start, start + limit))
            start += limit
        end = s_end
    if end > start:
        ranges.append((start, end))
    bucket = slots[0].bucket
    return [Chunk(bucket, a, b, _pieces(slots, a, b)) for a, b in ranges]


def _pieces(slots: list[Slot], start: int, end: int) -> tuple[Piece, ...]:
    pieces = []
    for s in slots:
        lo, hi = max(start, s.offset), min(end, s.offset + s.spec.nbytes)
        if lo < hi:
            pieces.append(Piece(s.spec.name, lo - s.offset, lo - start, hi - lo))
    return tuple(pieces)


def _fingerprint(specs: list[TensorSpec], produce_bytes: int) -> int:
    """A 63-bit digest of the wire layout, the same in every process (unlike hash())."""
    text = ";".join(str(s) for s in specs) + f"|produce={produce_bytes}|align={ALIGN}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
