"""WeightTransport: how packed weight buckets get from the trainer's rank 0 to the rollout workers.

Every transport is registered in TRANSPORTS under the name `sync.transport` uses, is built by the
same call on the sender and on each receiver,

    transport = TRANSPORTS.get(name)(plan, worker_name, group=group, src_rank=0, timeout_s=60, delta=False)

and passes the one contract test (tests/test_weight_sync.py). `group` and `src_rank` matter to
collective transports only; the others ignore them. `delta` (sync.delta) sends each bucket as its
delta against the version the receivers hold where that is smaller (tandem/sync/delta.py); what a
receiver stages is the same full bucket either way.
"""

from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Protocol

from torch import Tensor

from tandem.registry import Registry
from tandem.sync.plan import BucketPlan
from tandem.sync.staging import StagingBuffer


class WeightTransport(Protocol):
    """Sender side in the trainer's rank-0 actor, receiver side in each rollout actor.

    collective: False -> the driver waits for `send`'s handle and passes it to every `receive`
    (Ray resolves the send's ObjectRef when given as a top-level argument). True -> `send` and all
    `receive`s must run at the same time; the driver launches them together, and the handle is None.
    """

    name: ClassVar[str]
    collective: ClassVar[bool]
    plan: BucketPlan
    worker_name: str

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> Any:
        """Pack the weights (names and shapes as in the plan) as `version` and ship them -> handle."""
        ...

    def receive(self, handle: Any, version: int, staging: StagingBuffer, timeout_s: float) -> None:
        """Stage every bucket of `version`; TandemError naming the worker and version past timeout_s."""
        ...


TransportFactory = Callable[..., WeightTransport]

TRANSPORTS: Registry[TransportFactory] = Registry("weight transport")
