"""One torch.distributed world across Ray actors, and subgroups cut from it.

The lead puts the trainer's data-parallel ranks and the rollout workers in ONE world, then makes a
DP group and a weight-sync group (trainer rank 0 + rollout workers) with `new_group`. Typical use:

    addr, port = ray.get(trainer0.rendezvous.remote())          # node_ip(), free_port() on rank 0
    ray.get([a.init_world.remote(rank, world, addr, port, "gloo", 60) for rank, a in enumerate(actors)])
    # then in EVERY actor, the same calls in the same order (new_group is collective over the world):
    sync_group = new_group([0, *rollout_ranks], timeout_s=60)

Ray is imported lazily (node_ip only), so importing this module does not import Ray.
"""

import socket
from datetime import timedelta

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
