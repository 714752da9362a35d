"""A recipe's runs side by side: each `sim.runs` entry at each `sim.gpus` count, speedups against
`sim.baseline`, as a table and as flat JSON figures."""

from dataclasses import dataclass
from pathlib import Path

from tandem.config import Config
from tandem.errors import TandemError
from tandem.runtime.startup import load_config
from tandem.sim.costs import Calibration
from tandem.sim.run import Result, simulate_run

DEFAULT_RUNS = [
    ["sync", "run.mode=sync", "placement.groups=[]", "placement.ratios=[]"],
    ["one_step_off", "run.mode=one_step_off"],
    ["async", "run.mode=async"],
]
ROOT = Path(__file__).resolve().parents[2]  # the checkout: the shipped recipes/ are here


@dataclass
class Comparison:
    results: list[Result]
    baseline: str

    def speedup(self, r: Result) -> float:
        """r's steady-state samples/s over the baseline's at the same GPU count."""
        base = next(b for b in self.results if b.label == self.baseline and b.gpus == r.gpus)
        return r.samples_per_s / base.samples_per_s

    def run_speedup(self, r: Result) -> float:
        """The same over the whole runs (validations and the pipeline's filling included)."""
        base = next(b for b in self.results if b.label == self.baseline and b.gpus == r.gpus)
        return r.run_samples_per_s / base.run_samples_per_s

    def table(self) -> str:
        roles = sorted({role for r in self.results for role in r.idle})
        head = f"{'gpus':>5} {'run':<18} {'split':<28} {'step s':>8} "
        head += f"{'wait s':>7} {'logp s':>7} {'update s':>8} {'samples/s':>10} {'tokens/s':>10} "
        head += " ".join(f"{'idle ' + role:>12}" for role in roles)
        head += f" {'stale mean/max':>15} {'speedup':>8} {'whole run':>9}"
        lines = [head]
        for r in self.results:
            idle = " ".join(f"{r.idle.get(role, 0.0):>12.2f}" for role in roles)
            lines.append(
                f"{r.gpus or 'cpu':>5} {r.label:<18} {r.split:<28} {r.step_s:>8.2f} {r.wait_s:>7.2f} "
                f"{r.logp_s:>7.2f} {r.update_s:>8.2f} {r.samples_per_s:>10.2f} "
                f"{r.tokens_per_s:>10.0f} {idle} {r.staleness_mean:>9.2f}/{r.staleness_max:<5.0f} "
                f"{self.speedup(r):>7.2f}x {self.run_speedup(r):>8.2f}x"
            )
        return "\n".join(lines)

    def figures(self) -> dict[str, float]:
        """speedup_<label>_<gpus>_gpus (or _cpu; the run labelled async also as speedup_<gpus>_gpus),
        and each run's samples_per_s_*, step_s_*, its phases (wait_s_*, logp_s_*, update_s_*) and
        idle_<role>_*."""
        out = {}
        for r in self.results:
            where = f"{r.gpus}_gpus" if r.gpus else "cpu"
            out[f"speedup_{r.label}_{where}"] = self.speedup(r)
            if r.label == "async":
                out[f"speedup_{where}"] = self.speedup(r)
            out[f"run_speedup_{r.label}_{where}"] = self.run_speedup(r)
            out[f"samples_per_s_{r.label}_{where}"] = r.samples_per_s
            out[f"step_s_{r.label}_{where}"] = r.step_s
            for phase in ("wait", "logp", "update"):
                out[f"{phase}_s_{r.label}_{where}"] = getattr(r, f"{phase}_s")
            out |= {f"idle_{role}_{r.label}_{where}": v for role, v in r.idle.items()}
        return out


def runs_of(cfg: Config) -> list[list[str]]:
    return cfg.sim.runs or DEFAULT_RUNS


def calibration(cfg: Config, recipe: str | None) -> Calibration:
    """sim.calibration, found as given, next to the recipe, or in this checkout."""
    given = Path(cfg.sim.calibration)
    for path in (given, Path(recipe).parent / given if recipe else given, ROOT / given):
        if path.is_file():
            return Calibration.load(path)
    raise TandemError(
        f"Config 'sim.calibration': {given} does not exist (looked here, next to the recipe and in "
        f"{ROOT}). The shipped ones are recipes/sim-calibration-*.yaml."
    )


def compare(recipe: str | None, overrides: list[str], progress=None) -> Comparison:
    """Every run of the recipe at every GPU count -> the comparison. `progress(line)` hears of each."""
    base = load_config(recipe, overrides)
    cal = calibration(base, recipe)
    results = []
    for gpus in base.sim.gpus or [0]:
        for label, *more in runs_of(base):
            cfg = load_config(recipe, [*overrides, *more])
            results.append(simulate_run(cfg, label, gpus, cal))
            if progress is not None:
                progress(f"simulated {label} on {gpus or 'the CPUs'}{' GPUs' if gpus else ''}")
    return Comparison(results, base.sim.baseline)
