"""Each sampler's weights, so that every sampler saved in a session still samples: what a push of
its model sent when it was saved (`ServeTrainer.snapshot`: a LoRA model's adapters, a few MB; a
full-weights model's every weight). The newest `resident` stay in memory; older ones are written
to disk (safetensors, under the service's run directory) and read back when sampled.

A snapshot belongs to the trainer shape it was taken on (`shape`, the service's count of resets):
an engine rebuilt for another LoRA shape cannot serve it, and says so.

One saved by name is a sampler checkpoint the REST side lists (`Named`: whose, when, its expiry and
user_metadata) and may delete; past its expiry it is dropped the next time it is looked up.
"""

import dataclasses
import hashlib
from collections import OrderedDict
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import Tensor

from tandem.paths import fsync
from tandem.serve.checkpoints import expired, stamp

RESIDENT = 32  # LoRA snapshots of the real 135M model at rank 8: ~7 MB each in bf16


@dataclasses.dataclass
class Named:
    """A sampler saved by name (`save_weights_for_sampler(name)`), as the REST side lists it."""

    model_id: str
    time: float  # when saved, seconds since the epoch
    expires_at: float | None
    user_metadata: dict[str, str]
    public: bool = False


class Snapshots:
    def __init__(self, root: Path, resident: int = RESIDENT):
        self.root, self.resident = root, resident
        self.memory: OrderedDict[str, dict[str, Tensor]] = OrderedDict()  # newest last
        self.shapes: dict[str, int] = {}  # key -> the shape it was taken on (every key, on disk too)
        self.named: dict[str, Named] = {}  # the sampler checkpoints among them, by path

    def __contains__(self, key: str) -> bool:
        if key in self.named and expired(self.named[key].expires_at):
            self.drop(key)
        return key in self.shapes

    def name(self, key: str, model_id: str, ttl_seconds: int | None, user_metadata: dict | None) -> None:
        """The snapshot `key` is a sampler checkpoint of `model_id`'s, saved now."""
        saved = stamp(ttl_seconds, user_metadata)
        self.named[key] = Named(model_id, saved["saved_at"], saved["expires_at"], saved["user_metadata"])

    def drop(self, key: str) -> None:
        """Forget the snapshot `key`, in memory and on disk."""
        self.memory.pop(key, None)
        self.shapes.pop(key, None)
        self.named.pop(key, None)
        self._file(key).unlink(missing_ok=True)

    def put(self, key: str, weights: dict[str, Tensor], shape: int) -> None:
        self.memory[key] = weights
        self.memory.move_to_end(key)
        self.shapes[key] = shape
        while len(self.memory) > self.resident:
            old, tensors = self.memory.popitem(last=False)
            self.root.mkdir(parents=True, exist_ok=True)
            save_file({n: t.contiguous() for n, t in tensors.items()}, self._file(old))
            fsync(self._file(old))

    def get(self, key: str) -> dict[str, Tensor]:
        """The weights saved under `key`, read back from disk when they are not resident."""
        if key not in self.memory:
            self.put(key, load_file(self._file(key)), self.shapes[key])
        return self.memory[key]

    def _file(self, key: str) -> Path:
        return self.root / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.safetensors"
