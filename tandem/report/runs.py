"""A run directory read back for the report: its metrics lines and its timeline's spans."""

import json
from dataclasses import dataclass, field
from pathlib import Path

from tandem.errors import TandemError


@dataclass
class Span:
    worker: str  # "<role>/<rank>"
    name: str  # generate | reward | ref | logp | train | sync | val ...
    start: float  # seconds from the run's start
    end: float


@dataclass
class Run:
    """One run: `train` has a row per train step (with "version"), `val` a row per validation."""

    name: str
    train: list[dict] = field(default_factory=list)
    val: list[dict] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)

    def series(self, key: str, rows: str = "train") -> tuple[list[float], list[float]]:
        """-> (steps, values) of `key` over the train (or "val") rows that have it."""
        have = [r for r in getattr(self, rows) if isinstance(r.get(key), int | float)]
        return [r["step"] for r in have], [float(r[key]) for r in have]

    def wall_time(self) -> dict[int, float]:
        """step -> seconds since the run started when that step ended (the steps' timing_s/step
        added up; step 0, before the first, at 0)."""
        clock, at = 0.0, {0: 0.0}
        for r in self.train:
            clock += float(r.get("timing_s/step", 0.0))
            at[r["step"]] = clock
        return at

    def keys(self, prefix: str) -> list[str]:
        """The train rows' metric names that start with `prefix`, sorted."""
        return sorted({k for r in self.train for k in r if k.startswith(prefix)})


def load_run(path: str | Path) -> Run:
    """The run at `path` (a `runs/<name>/` directory); TandemError when it has no metrics.jsonl."""
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise TandemError(
            f"{path} is not a run directory: it has no metrics.jsonl (tandem train writes one to "
            "run.out_dir/run.name, e.g. runs/default)."
        )
    run = Run(path.name)
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # the last line of a killed run, cut mid-write
            continue
        if "version" in row:
            run.train.append(row)
        elif "val/accuracy" in row and "val/accuracy_final" not in row:
            run.val.append(row)
    run.spans = _spans(path / "timeline.json")
    return run


def _spans(trace: Path) -> list[Span]:
    """The Chrome trace's complete events ("X"), named by their process / thread metadata."""
    if not trace.is_file():
        return []
    events = json.loads(trace.read_text()).get("traceEvents", [])
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [
        Span(
            threads.get((e["pid"], e["tid"]), f"{e['pid']}/{e['tid']}"),
            e["name"],
            e["ts"],
            e["ts"] + e["dur"],
        )
        for e in events
        if e.get("ph") == "X"
    ]
    start = min((s.start for s in spans), default=0.0)
    return [Span(s.worker, s.name, (s.start - start) / 1e6, (s.end - start) / 1e6) for s in spans]
