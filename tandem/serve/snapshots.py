"""Each sampler's weights, so that every sampler saved in a session still samples: what a push of
its model sent when it was saved (`ServeTrainer.snapshot`: a LoRA model's adapters, a few MB; a
full-weights model's every weight). The newest `resident` stay in memory; older ones are written
to disk (safetensors, under the service's run directory) and read back when sampled.

A snapshot belongs to the trainer shape it was taken on (`shape`, the service's count of resets):
an engine rebuilt for another LoRA shape cannot serve it, and says so.
"""

import hashlib
from collections import OrderedDict
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import Tensor

from tandem.paths import fsync

RESIDENT = 32  # LoRA snapshots of the real 135M model at rank 8: ~7 MB each in bf16


class Snapshots:
    def __init__(self, root: Path, resident: int = RESIDENT):
        self.root, self.resident = root, resident
        self.memory: OrderedDict[str, dict[str, Tensor]] = OrderedDict()  # newest last
        self.shapes: dict[str, int] = {}  # key -> the shape it was taken on (every key, on disk too)

    def __contains__(self, key: str) -> bool:
        return key in self.shapes

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
