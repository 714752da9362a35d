"""torch.distributed for tandem: the trainers' world, and the weight-sync group beside it.

Two kinds of group, kept apart on purpose:
- The trainers' WORLD (`init_world`, then `new_group`): torch.distributed's default process group,
  joined by the trainer's data-parallel ranks only (DDP, FSDP2). Typical use:

      addr, port = ray.get(trainer0.rendezvous.remote())          # node_ip(), free_port() on rank 0
      ray.get([a.init_world.remote(rank, world, addr, port, "gloo", 60) for rank, a in enumerate(actors)])
      dp_group = new_group(list(range(world)), timeout_s=60)       # in EVERY rank, same order

- The weight-SYNC group (`sync_group`): the trainer's rank 0 (rank 0 here) and the rollout workers
  (ranks 1..R), a process group of its own on its own TCPStore, outside the default world. A rollout
  worker never joins torch.distributed's default group, so an engine that initialises
  torch.distributed for itself in that process (vLLM does, for its own tensor parallelism) keeps
  it; the trainer's rank 0 belongs to both. verl and OpenRLHF build their weight-sync groups the
  same way, for the same reason.

Ray is imported lazily (node_ip only), so importing this module does not import Ray.
"""

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.errors import TandemError


def free_port() -> int:
    """A TCP port free on this node now (call it on the rank-0 node, just before init_world)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_ip() -> str:
    """This node's address as Ray knows it (other nodes can reach it); 127.0.0.1 without Ray."""
    try:
        import ray.util

        return ray.util.get_node_ip_address()
    except ImportError:
        return "127.0.0.1"


def init_world(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> None:
    """Join the default process group; every collective in it then times out after timeout_s."""
    if dist.is_initialized():
        raise TandemError(f"rank {rank}: torch.distributed is already initialised in this process.")
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    except (RuntimeError, TimeoutError) as e:
        raise TandemError(
            f"rank {rank}/{world_size}: could not join the {backend} world at {master_addr}:{master_port} "
            f"within {timeout_s:g} s ({e}). Did every rank call init_world with the same address?"
        ) from e


def new_group(
    ranks: list[int], backend: str | None = None, timeout_s: float | None = None
) -> dist.ProcessGroup:
    """A subgroup of the world. Collective: every rank of the world calls it, members or not,
    in the same order; non-members get a handle they must not use."""
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    return dist.new_group(sorted(ranks), timeout=timeout, backend=backend)


def destroy_world() -> None:
    """Leave the world (and all its groups), so the process may join a new one. Collective: the
    barrier first lets every rank finish its last collective, because gloo aborts a rank whose peer
    closes its sockets while a send to it is still in flight."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@dataclass
class SyncGroup:
    """The weight-sync group as one member sees it: the process group, the store it met on (kept
    alive with it: rank 0's store is the server), and the device its broadcasts move tensors on."""

    pg: dist.ProcessGroup
    store: dist.Store
    device: torch.device

    @property
    def rank(self) -> int:
        return self.pg.rank()

    @property
    def size(self) -> int:
        return self.pg.size()


def sync_group(
    rank: int, size: int, addr: str, port: int, device: str = "cpu", timeout_s: float = 300.0
) -> SyncGroup:
    """Join the weight-sync group at addr:port as `rank` of `size` (rank 0 serves the store).

    device "cpu": gloo, buckets on the CPU. "cuda": NCCL on this process's current CUDA device
    (not run in this project: no machine here has two GPUs). Every collective then times out after
    timeout_s; joining waits as long for the other ranks."""
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(addr, port, size, is_master=rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore("tandem-sync", store)
        if device == "cuda":
            dev = torch.device("cuda", torch.cuda.current_device())
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            dev = torch.device("cpu")
            pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    except (RuntimeError, TimeoutError, dist.DistStoreError) as e:
        raise TandemError(
            f"sync rank {rank}/{size}: could not join the weight-sync group at {addr}:{port} within "
            f"{timeout_s:g} s ({e}). Did the trainer's rank 0 and every rollout worker join it?"
        ) from e
    return SyncGroup(pg, store, dev)
