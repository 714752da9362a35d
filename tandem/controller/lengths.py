"""Benchmarks' heavy-tailed response lengths (rollout.length_tail_alpha > 0).

Each training response keeps decoding past its EOS up to a cap drawn from a Pareto(alpha) with a
scale of 4 tokens, capped at rollout.max_new_tokens: reasoning models' lengths are heavy-tailed, and
the tail is what leaves a synchronous run's trainer idle. The draws come from their own stream, so a
resumed run continues it.
"""

import math
import random
from typing import Any

from tandem.sample import Sample

SCALE_TOKENS = 4


class TailLengths:
    def __init__(self, alpha: float, cap: int, seed: int):
        self.alpha, self.cap = alpha, cap
        self.rng = random.Random(seed)

    def draw(self) -> int:
        """min(cap, ceil(4 * u^(-1/alpha))), u uniform on (0, 1]."""
        u = 1.0 - self.rng.random()
        return min(self.cap, math.ceil(SCALE_TOKENS * u ** (-1 / self.alpha)))

    def assign(self, samples: list[Sample]) -> None:
        """Each sample its own length cap, in order."""
        for s in samples:
            s.max_new_tokens = self.draw()

    def getstate(self) -> Any:
        return self.rng.getstate()

    def setstate(self, state: Any) -> None:
        self.rng.setstate(state)
