"""Buckets on the wire: packing tensors into flat uint8 buffers and reading them back (pure torch).

A bucket is one flat uint8 tensor laid out by the BucketPlan (tandem/sync/plan.py):

    [ 64-byte header: magic, version, index, num_buckets, fingerprint, nbytes | tensor bytes ... ]

so every bucket says which policy version it belongs to, which bucket it is, and under which plan
it was packed; a receiver with another plan, or expecting another version, refuses it.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.errors import TandemError
from tandem.sync.plan import HEADER_BYTES, BucketPlan

MAGIC = 0x7461_6E64_656D_5753  # "tandemWS"


@dataclass(frozen=True)
class BucketHeader:
    version: int
    index: int
    num_buckets: int
    fingerprint: int
    nbytes: int


def collect(plan: BucketPlan, named_tensors: Iterable[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """The sender's tensors by name, checked against the plan: same names, same shapes."""
    tensors = dict(named_tensors)
    missing = [s.name for s in plan.specs if s.name not in tensors]
    extra = [n for n in tensors if n not in plan.slots]
    if missing or extra:
        raise TandemError(
            f"Weights to send do not match the sync plan: missing {missing[:5]}, unexpected {extra[:5]}."
        )
    for s in plan.specs:
        if tuple(tensors[s.name].shape) != s.shape:
            raise TandemError(
                f"Weight {s.name} has shape {tuple(tensors[s.name].shape)}; the sync plan says {s.shape}."
            )
    return tensors


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor: a DTensor shard is all-gathered (collective: every rank calls it in turn).
    Duck-typed, so importing this module does not import torch.distributed.tensor (~0.8 s)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def pack_bucket(
    plan: BucketPlan, index: int, tensors: Mapping[str, Tensor], version: int, out: Tensor | None = None
) -> Tensor:
    """-> (plan.bucket_nbytes[index],) uint8: the header, then each tensor's bytes at its slot.

    `out` (uint8, at least that long) is reused when given, on its device; tensors are cast to the
    plan's dtype on the way in. Padding between tensors is zeroed so the bytes are deterministic.
    A sharded tensor (FSDP2's DTensor) is gathered here, one at a time, in bucket order: no more
    than one whole tensor beside the bucket exists at once.
    """
    size = plan.bucket_nbytes[index]
    if out is None:
        device = tensors[plan.buckets[index][0].spec.name].device if plan.buckets[index] else "cpu"
        out = torch.empty(size, dtype=torch.uint8, device=device)
    out = out[:size]
    write_header(plan, index, version, out)
    end = HEADER_BYTES
    for slot in plan.buckets[index]:
        spec = slot.spec
        out[end : slot.offset].zero_()
        end = slot.offset + spec.nbytes
        out[slot.offset : end].view(spec.dtype).view(spec.shape).copy_(full_tensor(tensors[spec.name]))
    return out


def write_header(plan: BucketPlan, index: int, version: int, bucket: Tensor) -> None:
    """Write bucket `index`'s header for `version` into the first 64 bytes of `bucket` (uint8)."""
    header = [MAGIC, version, index, plan.num_buckets, plan.fingerprint, plan.bucket_nbytes[index], 0, 0]
    bucket[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor(header, dtype=torch.int64))


def read_header(bucket: Tensor) -> BucketHeader:
    """The header of a bucket (uint8 (nbytes,)); raises TandemError if it is not one."""
    if bucket.dtype != torch.uint8 or bucket.dim() != 1 or bucket.numel() < HEADER_BYTES:
        raise TandemError(f"Not a weight bucket: {bucket.dtype} tensor of shape {tuple(bucket.shape)}.")
    magic, version, index, num_buckets, fingerprint, nbytes, _, _ = (
        bucket[:HEADER_BYTES].clone().view(torch.int64).tolist()  # clone: aligned for the view
    )
    if magic != MAGIC:
        raise TandemError("Not a weight bucket: its header does not start with tandem's magic number.")
    return BucketHeader(version, index, num_buckets, fingerprint, nbytes)


def check_header(
    plan: BucketPlan, header: BucketHeader, index: int, version: int, worker: str = "receiver"
) -> None:
    """Raise a TandemError unless the header is bucket `index` of `version` under this plan."""
    if header.fingerprint != plan.fingerprint or header.num_buckets != plan.num_buckets:
        raise TandemError(
            f"{worker}: bucket {header.index} of version {header.version} was packed under another "
            f"sync plan (fingerprint {header.fingerprint:#x}, {header.num_buckets} buckets; this "
            f"worker's plan: {plan.fingerprint:#x}, {plan.num_buckets} buckets). The models' names, "
            "shapes or dtypes, or sync.produce_bucket_mb, differ; BucketPlan.check_same_layout says where."
        )
    if not 0 <= index < plan.num_buckets:
        raise TandemError(f"{worker}: bucket index {index} is outside the plan's {plan.num_buckets} buckets.")
    if header.version != version or header.index != index:
        raise TandemError(
            f"{worker}: expected bucket {index} of version {version}, got bucket {header.index} "
            f"of version {header.version}; buckets of two versions never mix."
        )
    if header.nbytes != plan.bucket_nbytes[index]:
        raise TandemError(
            f"{worker}: bucket {index} has {header.nbytes} bytes, the plan says {plan.bucket_nbytes[index]}."
        )


def unpack_bucket(plan: BucketPlan, bucket: Tensor, version: int | None = None) -> dict[str, Tensor]:
    """Bucket uint8 (nbytes,) -> {name: tensor} as views into it (no copy), header checked."""
    header = read_header(bucket)
    check_header(plan, header, header.index, header.version if version is None else version)
    return {
        s.spec.name: bucket[s.offset : s.offset + s.spec.nbytes].view(s.spec.dtype).view(s.spec.shape)
        for s in plan.buckets[header.index]
    }
