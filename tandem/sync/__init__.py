"""Weight sync: bucketed, versioned transport of the policy from trainer to rollout workers.

docs/weight_sync.md tells the whole story. Importing this package does not import Ray.
"""

from tandem.sync import broadcast, object_store  # noqa: F401  (register the transports)
from tandem.sync.broadcast import BroadcastTransport
from tandem.sync.bucket import BucketHeader, pack_bucket, read_header, unpack_bucket
from tandem.sync.delta import DeltaEncoder
from tandem.sync.dist import SyncGroup, destroy_world, free_port, init_world, new_group, node_ip, sync_group
from tandem.sync.object_store import ObjectStoreHandle, ObjectStoreTransport
from tandem.sync.plan import BucketPlan, TensorSpec
from tandem.sync.protocol import TRANSPORTS, WeightTransport
from tandem.sync.staging import StagingBuffer

__all__ = [
    "TRANSPORTS",
    "BroadcastTransport",
    "BucketHeader",
    "BucketPlan",
    "DeltaEncoder",
    "ObjectStoreHandle",
    "ObjectStoreTransport",
    "StagingBuffer",
    "SyncGroup",
    "TensorSpec",
    "WeightTransport",
    "destroy_world",
    "free_port",
    "init_world",
    "new_group",
    "node_ip",
    "pack_bucket",
    "read_header",
    "sync_group",
    "unpack_bucket",
]
