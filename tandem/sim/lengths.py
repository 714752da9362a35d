"""Response lengths of the simulated workload: lognormal, Pareto, fitted to a run's metrics.jsonl,
or drawn from a file of measured lengths.

Each sample's length is a pure function of (seed, group id, index), so every simulated mode (and a
partial response continued on another worker) decodes the same responses. Lengths are capped at
rollout.max_new_tokens, as the engines cap them; what the cap cuts is `response_length/clip_ratio`.
"""

import json
import math
import random
from pathlib import Path

from tandem.config import Config
from tandem.errors import TandemError
from tandem.sample import Sample

KINDS = ("lognormal", "pareto", "metrics:PATH", "file:PATH")
LENGTH_KEYS = ("response_length", "length")  # a JSON row's length, by the first of these it has


class ResponseLengths:
    def __init__(self, kind: str, mean: float, sigma: float, alpha: float, cap: int, seed: int, batch: int):
        """kind: lognormal (mean, sigma of its log), pareto (shape alpha, scale chosen for the
        mean), metrics:PATH (a lognormal fitted to a run's response_length/mean and /max), or
        file:PATH (the measured lengths in PATH, each equally likely: `read_lengths`)."""
        self.cap, self.seed = cap, seed
        if kind.startswith("file:"):
            self.kind, self.measured = "file", read_lengths(Path(kind.removeprefix("file:")))
            return
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
        if self.kind == "file":
            draw = rng.choice(self.measured)
        elif self.kind == "lognormal":
            draw = rng.lognormvariate(self.mu, self.sigma)
        else:
            draw = self.scale * (1.0 - rng.random()) ** (-1 / self.alpha)
        return max(1, min(self.cap, round(draw)))


def response_lengths(cfg: Config) -> ResponseLengths:
    """The run's sim.lengths, capped at rollout.max_new_tokens (a metrics fit over a step's samples)."""
    s, r = cfg.sim, cfg.rollout
    batch = r.batch_size * r.n
    return ResponseLengths(
        s.lengths, s.length_mean, s.length_sigma, s.length_alpha, r.max_new_tokens, cfg.run.seed, batch
    )


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


def read_lengths(path: Path) -> list[int]:
    """The measured response lengths in `path`: a JSON list, or one entry a line (blank lines and
    `#` comments skipped). An entry is a positive integer, or a JSON object carrying one under
    response_length or length. TandemError naming the file and the entry when one is not."""
    if not path.is_file():
        raise TandemError(
            f"Config 'sim.lengths': {path} does not exist (file:PATH names a file of measured response "
            "lengths: one integer a line, a JSON list, or JSON lines with a response_length)."
        )
    lengths = [_length(entry, where) for where, entry in _entries(path)]
    if not lengths:
        raise TandemError(f"Config 'sim.lengths': {path} holds no response lengths.")
    return lengths


def _entries(path: Path) -> list[tuple[str, object]]:
    """(where, entry) of each entry: a JSON list's items, else each line's JSON object or its text
    before a `#`, as an integer where it reads as one."""
    text = path.read_text()
    listed = _json_list(text)
    if listed is not None:
        return [(f"{path} item {i}", item) for i, item in enumerate(listed, 1)]
    out: list[tuple[str, object]] = []
    for n, line in enumerate(text.splitlines(), 1):
        where, line = f"{path} line {n}", line.strip()
        if line.startswith("{"):
            out.append((where, _json_row(line, where)))
        elif entry := line.split("#", 1)[0].strip():
            out.append((where, _integer(entry)))
    return out


def _json_list(text: str) -> list | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, list) else None


def _integer(text: str) -> int | str:
    """A line's text as the integer it reads as, else as it is (for the error to show)."""
    try:
        return int(text)
    except ValueError:
        return text


def _json_row(line: str, where: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise TandemError(f"Config 'sim.lengths': {where} is not valid JSON ({e.msg}).") from None


def _length(entry: object, where: str) -> int:
    """An entry's response length: the entry itself, or a JSON object's LENGTH_KEYS value."""
    if isinstance(entry, dict):
        key = next((k for k in LENGTH_KEYS if k in entry), None)
        if key is None:
            raise TandemError(
                f"Config 'sim.lengths': {where} has no {' or '.join(LENGTH_KEYS)} key (a run's "
                "metrics.jsonl goes to metrics:PATH)."
            )
        entry = entry[key]
    if not isinstance(entry, int) or isinstance(entry, bool) or entry < 1:
        raise TandemError(
            f"Config 'sim.lengths': {where} is {entry!r}, not a response length (a positive whole "
            "number of tokens)."
        )
    return entry
