"""`tandem simulate --search`: the split of the GPUs and the staleness bound that maximise throughput.

For each GPU count, async (the recipe's `async` run, else run.mode=async) is simulated with the
trainer and the rollout in task groups of their own, the rollout's share taken from
sim.search_ratios (splits that leave no whole engine are skipped) and run.max_staleness from
sim.search_staleness; the best is compared with the baseline run.
"""

from dataclasses import dataclass

from tandem.errors import TandemError
from tandem.runtime.startup import load_config
from tandem.sim.compare import calibration, runs_of
from tandem.sim.run import Result, simulate_run


@dataclass
class Best:
    gpus: int
    ratio: float  # the rollout's share of the GPUs
    staleness: int
    result: Result
    baseline: Result
    tried: int

    @property
    def speedup(self) -> float:
        return self.result.samples_per_s / self.baseline.samples_per_s

    def figures(self) -> dict[str, float]:
        where = f"{self.gpus}_gpus" if self.gpus else "cpu"
        return {
            f"search_speedup_{where}": self.speedup,
            f"search_rollout_ratio_{where}": self.ratio,
            f"search_max_staleness_{where}": float(self.staleness),
        }

    def line(self) -> str:
        r = self.result
        idle = ", ".join(f"{k} {v:.2f}" for k, v in r.idle.items())
        return (
            f"{self.gpus or 'cpu':>5} GPUs: placement.ratios=[{1 - self.ratio:g},{self.ratio:g}] "
            f"(train, generate) run.max_staleness={self.staleness}: {r.samples_per_s:.2f} samples/s, "
            f"{self.speedup:.2f}x {self.baseline.label} (idle {idle}; best of {self.tried})"
        )


def search(recipe: str | None, overrides: list[str], progress=None) -> list[Best]:
    base = load_config(recipe, overrides)
    cal = calibration(base, recipe)
    runs = {label: more for label, *more in runs_of(base)}
    async_run = runs.get("async", ["run.mode=async"])
    out = []
    for gpus in base.sim.gpus or [0]:
        baseline = simulate_run(
            load_config(recipe, [*overrides, *runs[base.sim.baseline]]), base.sim.baseline, gpus, cal
        )
        best, tried = None, 0
        for ratio in base.sim.search_ratios:
            for k in base.sim.search_staleness:
                split = [
                    "placement.groups=[[actor_train],[generate]]",
                    f"placement.ratios=[{1 - ratio:g},{ratio:g}]",
                ]
                try:
                    cfg = load_config(recipe, [*overrides, *async_run, *split, f"run.max_staleness={k}"])
                    r = simulate_run(cfg, "async", gpus, cal)
                except TandemError:  # no whole engine in this split
                    continue
                tried += 1
                if best is None or r.samples_per_s > best.result.samples_per_s:
                    best = Best(gpus, ratio, k, r, baseline, 0)
        if best is None:
            raise TandemError(
                f"No split in sim.search_ratios gives {gpus} GPUs whole engines of sim.tensor_parallel."
            )
        best.tried = tried
        out.append(best)
        if progress is not None:
            progress(best.line())
    return out
