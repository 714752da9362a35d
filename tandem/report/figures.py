"""The report's plots, one function a figure: runs overlaid, one colour each. A plot none of the
runs has data for returns None and the page says so."""

from collections.abc import Callable
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from tandem.report.runs import Run  # noqa: E402

SPAN_COLORS = {
    "generate": "tab:blue", "val": "tab:cyan", "reward": "tab:orange", "val_reward": "gold",
    "ref": "tab:purple", "logp": "tab:olive", "train": "tab:green", "values": "tab:brown",
    "sync": "tab:red", "send": "tab:red", "receive": "tab:pink", "sleep": "tab:gray", "save": "black",
}  # fmt: skip


@dataclass
class Plot:
    name: str  # file stem
    title: str
    make: Callable[[list[Run]], Figure | None]


def _lines(runs: list[Run], panels: list[tuple[str, list[str], str]], x: str = "step") -> Figure | None:
    """One axis per (title, metric keys, rows) panel; each run's each key one line against the step
    (or the wall time, x="time") -> the figure, or None when no run has any of the keys."""
    if not any(run.series(k, rows)[0] for run in runs for _, keys, rows in panels for k in keys):
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.6), squeeze=False)
    for ax, (title, keys, rows) in zip(axes[0], panels, strict=True):
        for i, run in enumerate(runs):
            clock = run.wall_time()
            for j, key in enumerate(keys):
                steps, values = run.series(key, rows)
                if not steps:
                    continue
                xs = [clock.get(s, float("nan")) for s in steps] if x == "time" else steps
                label = run.name if len(keys) == 1 else f"{run.name}: {key}"
                ax.plot(
                    xs,
                    values,
                    color=f"C{i}",
                    linestyle=("-", "--", ":", "-.")[j % 4],
                    marker=".",
                    label=label,
                )
        ax.set_title(title)
        ax.set_xlabel("wall time (s)" if x == "time" else "step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def reward_and_accuracy(runs: list[Run]) -> Figure | None:
    return _lines(runs, [("training reward (critic/score/mean)", ["critic/score/mean"], "train"),
                         ("held-out accuracy (val/accuracy)", ["val/accuracy"], "val")])  # fmt: skip


def reward_and_accuracy_in_time(runs: list[Run]) -> Figure | None:
    panels = [("training reward against wall time", ["critic/score/mean"], "train"),
              ("held-out accuracy against wall time", ["val/accuracy"], "val")]  # fmt: skip
    return _lines(runs, panels, x="time")


def staleness(runs: list[Run]) -> Figure | None:
    return _lines(
        runs, [("staleness (versions behind the trained one)", ["staleness/mean", "staleness/max"], "train")]
    )


def mismatch(runs: list[Run]) -> Figure | None:
    panels = [("engine-trainer mismatch: KL(mu || pi_old)", ["mismatch/kl"], "train"),
              ("max |logprob engine - trainer|", ["mismatch/logprob_abs_diff_max"], "train")]  # fmt: skip
    if any(run.keys("mismatch/routing") for run in runs):
        panels.append(("MoE routing agreement", ["mismatch/routing_agreement"], "train"))
    return _lines(runs, panels)


def corrections(runs: list[Run]) -> Figure | None:
    keys = sorted({k for run in runs for k in run.keys("correction/")})
    return (
        _lines(runs, [("share of tokens each correction clipped or masked", keys, "train")]) if keys else None
    )


def throughput(runs: list[Run]) -> Figure | None:
    idle = sorted({k for run in runs for k in run.keys("perf/idle_ratio/")})
    return _lines(runs, [("samples per second", ["perf/samples_per_s"], "train"),
                         ("idle ratio per role", idle, "train")])  # fmt: skip


def lengths(runs: list[Run]) -> Figure | None:
    keys = ["response_length/mean", "response_length/max"]
    clipped = ("responses cut at max_new_tokens", ["response_length/clip_ratio"], "train")
    return _lines(runs, [("response length (tokens)", keys, "train"), clipped])


def timeline(runs: list[Run]) -> Figure | None:
    """Swimlanes: a row per worker, its spans coloured by what they were, one panel per run."""
    shown = [run for run in runs if run.spans]
    if not shown:
        return None
    rows = [sorted({s.worker for s in run.spans}) for run in shown]
    fig, axes = plt.subplots(len(shown), 1, figsize=(14, 1.0 + 0.45 * sum(map(len, rows))), squeeze=False)
    for ax, run, workers in zip(axes[:, 0], shown, rows, strict=True):
        for y, worker in enumerate(workers):
            for name in sorted({s.name for s in run.spans if s.worker == worker}):
                bars = [
                    (s.start, s.end - s.start) for s in run.spans if s.worker == worker and s.name == name
                ]
                ax.broken_barh(bars, (y - 0.4, 0.8), color=SPAN_COLORS.get(name, "black"), label=name)
        ax.set_yticks(range(len(workers)), workers)
        ax.set_xlabel("seconds since the run started")
        ax.set_title(f"timeline: {run.name}")
        names = sorted({s.name for s in run.spans})
        patches = [Patch(color=SPAN_COLORS.get(n, "black"), label=n) for n in names]
        ax.legend(handles=patches, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


PLOTS = [
    Plot("reward_accuracy", "Reward and held-out accuracy", reward_and_accuracy),
    Plot("reward_accuracy_time", "Against wall time", reward_and_accuracy_in_time),
    Plot("staleness", "Staleness", staleness),
    Plot("mismatch", "Engine-trainer mismatch", mismatch),
    Plot("corrections", "What the corrections clipped or masked", corrections),
    Plot("throughput", "Throughput and idle ratio per role", throughput),
    Plot("lengths", "Response lengths", lengths),
    Plot("timeline", "Timeline", timeline),
]
