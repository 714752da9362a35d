"""The rollout buffer: admission control by staleness, a version fence, whole-group batches."""

from tandem.buffer.buffer import RolloutBuffer

__all__ = ["RolloutBuffer"]
