"""The run's timeline: spans of work per worker, written as a Chrome trace (opens in Perfetto).

Actors time their own work (`Span`, wall-clock seconds) and hand the spans back with their
results; the driver collects them here, logs each role's idle fraction per step, and writes
`timeline.json` at the end.
"""

import json
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Span:
    name: str  # generate | reward | ref | logp | train | sync | val
    worker: str  # "<role>/<rank>", e.g. "rollout/0"
    start: float  # time.time() seconds
    end: float

    @property
    def role(self) -> str:
        return self.worker.split("/")[0]


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class Timeline:
    def __init__(self, workers: dict[str, list[str]], start: float | None = None):
        """workers: role -> its worker names; a role with no span in a window was idle in all of it.
        start: the trace's time zero (default now; the simulator's clock starts at 0)."""
        self.workers = workers
        self.spans: list[Span] = []
        self.start = time.time() if start is None else start

    def add(self, *spans: Span) -> None:
        self.spans.extend(spans)

    def idle_ratios(self, since: float, until: float) -> dict[str, float]:
        """-> {"perf/idle_ratio/<role>": share of the window [since, until] its workers sat idle}."""
        window = max(until - since, 1e-9)
        out = {}
        for role, names in self.workers.items():
            busy = 0.0
            for name in names:
                mine = [
                    (max(s.start, since), min(s.end, until))
                    for s in self.spans
                    if s.worker == name and s.end > since and s.start < until
                ]
                busy += _busy(mine)
            out[f"perf/idle_ratio/{role}"] = 1.0 - busy / (window * max(len(names), 1))
        return out

    def seconds_by_name(self, since: float, until: float) -> dict[str, float]:
        """-> {"timing_s/<span name>": worker-seconds spent on it within [since, until]}."""
        out: dict[str, float] = {}
        for s in self.spans:
            if s.end > since and s.start < until:
                key = f"timing_s/{s.name}"
                out[key] = out.get(key, 0.0) + min(s.end, until) - max(s.start, since)
        return out

    def write(self, path: Path) -> None:
        """Chrome trace format: one process per role, one thread per worker, complete ("X") events.
        Spans of a worker the loop does not call (the driver's start-up) get a row of their own."""
        workers = {role: list(names) for role, names in self.workers.items()}
        for s in self.spans:
            if s.worker not in workers.setdefault(s.role, []):
                workers[s.role].append(s.worker)
        roles = sorted(workers)
        pids = {role: i + 1 for i, role in enumerate(roles)}
        tids = {name: j + 1 for role in roles for j, name in enumerate(workers[role])}
        events: list[dict] = []
        for role in roles:
            events.append({"ph": "M", "name": "process_name", "pid": pids[role], "args": {"name": role}})
            for name in workers[role]:
                events.append(
                    {
                        "ph": "M",
                        "name": "thread_name",
                        "pid": pids[role],
                        "tid": tids[name],
                        "args": {"name": name},
                    }
                )
        for s in self.spans:
            events.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "pid": pids.get(s.role, 0),
                    "tid": tids.get(s.worker, 0),
                    "ts": (s.start - self.start) * 1e6,
                    "dur": (s.end - s.start) * 1e6,
                }
            )
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
