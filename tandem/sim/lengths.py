"""Response lengths of the simulated workload: lognormal, Pareto, or fitted to a run's metrics.jsonl.

Each sample's length is a pure function of (seed, group id, index), so every simulated mode (and a
partial response continued on another worker) decodes the same responses. Lengths are capped at
rollout.max_new_tokens, as the engines cap them; what the cap cuts is `response_length/clip_ratio`.
"""

import json
import math
import random
from pathlib import Path

from tandem.errors import TandemError
from tandem.sample import Sample

KINDS = ("lognormal", "pareto", "metrics:PATH")


class ResponseLengths:
    def __init__(self, kind: str, mean: float, sigma: float, alpha: float, cap: int, seed: int, batch: int):
        """kind: lognormal (mean, sigma of its log), pareto (shape alpha, scale chosen for the
        mean), or metrics:PATH (a lognormal fitted to a run's response_length/mean and /max)."""
        self.cap, self.seed = cap, seed
        if kind.startswith("metrics:"):
            mean, sigma = fit_metrics(Path(kind.removeprefix("metrics:")), batch)
            kind = "lognormal"
        if kind not in ("lognormal", "pareto"):
            raise TandemError(f"Config 'sim.lengths' is {kind!r}; valid: {', '.join(KINDS)}.")
        if mean <= 0:
            raise TandemError(f"Config 'sim.length_mean' must be > 0 tokens, got {mean:g}.")
        self.kind = kind
        if kind == "lognormal":
            if sigma <= 0:
                raise TandemError(f"Config 'sim.length_sigma' must be > 0, got {sigma:g}.")
            self.mu, self.sigma = math.log(mean) - sigma * sigma / 2, sigma
        else:
            if alpha <= 1:
                raise TandemError(f"Config 'sim.length_alpha' must be > 1 (a finite mean), got {alpha:g}.")
            self.alpha, self.scale = alpha, mean * (alpha - 1) / alpha

    def of(self, sample: Sample) -> int:
        """The sample's full response length (at least 1 token, at most the cap)."""
        rng = random.Random(hash((self.seed, sample.group_id, sample.index)))
        if self.kind == "lognormal":
            draw = rng.lognormvariate(self.mu, self.sigma)
        else:
            draw = self.scale * (1.0 - rng.random()) ** (-1 / self.alpha)
        return max(1, min(self.cap, round(draw)))


def fit_metrics(path: Path, batch: int) -> tuple[float, float]:
    """(mean, sigma) of the lognormal whose mean is the run's mean response length and whose
    expected maximum over a step's `batch` samples is the run's mean response_length/max."""
    if not path.is_file():
        raise TandemError(f"Config 'sim.lengths': {path} does not exist (metrics:PATH names a metrics.jsonl)")
    means, maxes = [], []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "response_length/mean" in row and "response_length/max" in row:
            means.append(row["response_length/mean"])
            maxes.append(row["response_length/max"])
    if not means:
        raise TandemError(f"Config 'sim.lengths': {path} has no step with response_length/mean and /max.")
    mean, top = sum(means) / len(means), sum(maxes) / len(maxes)
    # E[max of N] of a lognormal ~ exp(mu + sigma z_N), z_N = sqrt(2 ln N); mu = ln(mean) - sigma²/2:
    # sigma² / 2 - z_N sigma + ln(top / mean) = 0, the smaller root.
    z = math.sqrt(2 * math.log(max(batch, 2)))
    r = math.log(max(top / mean, 1.0 + 1e-9))
    disc = z * z - 2 * r
    sigma = z - math.sqrt(disc) if disc > 0 else z
    return mean, max(sigma, 1e-3)
