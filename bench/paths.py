"""Every training path on one recipe: does each learn, how fast, in how much memory.

    python bench/paths.py [recipe.yaml] [--paths recipe lora ...] [--steps 8] [--json PATH] [key=value ...]

Default recipe: recipes/smollm2-addition.yaml (SmolLM2-135M-Instruct, the `real-model` extra), cut
to --steps steps with validation before the first and after the last (the recipe's held-out set).
Each path is `tandem train` in a process of its own with the overrides below, one after the other
on the same cores; `resume` is two processes, the first stopped half way (its checkpoint), the
second continuing it to --steps. Prints, for each, held-out accuracy before -> after, the gain in
points, the wall time against the plain recipe's, the peak memory (summary.json), and where it has
one the engine/trainer mismatch. A path whose engine or package is missing is reported as refused,
with tandem's own message. `--json` writes `<path>_start`, `<path>_final`, `<path>_gain_points`,
`<path>_wall_s`, `<path>_wall_ratio`, `<path>_peak_gb` (and `<path>_mismatch_max` where logged),
`cpu`.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "recipes" / "smollm2-addition.yaml"
PATHS = {
    "recipe": [],
    # adapters only train and only they are pushed; a LoRA run wants a larger lr than full weights
    "lora": ["train.lora.rank=16", "train.lora.alpha=32", "train.lr=2.0e-4"],
    "async": ["run.mode=async"],
    "one_step_off": ["run.mode=one_step_off"],
    "deterministic": ["run.deterministic=true"],
    "vllm": ["rollout.engine=vllm"],
    "agent": ["rollout.agent=openai:tandem.agent.examples:answer"],
    "resume": [],  # two processes: see run_path
}


def train(recipe: str, overrides: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    cmd = [sys.executable, "-m", "tandem.cli.main", "train", recipe, "run.progress=false", *overrides]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    return time.perf_counter() - start, done


def run_path(name: str, recipe: str, steps: int, out: Path, common: list[str]) -> dict:
    before = None  # resume: the first process's held-out accuracy before its first step
    base = [f"run.out_dir={out}", f"run.name={name}", f"run.steps={steps}", "run.val_every=0", *common]
    if name == "resume":
        half = steps // 2
        first = [*base[:2], f"run.steps={half}", f"run.save_every={half}", "run.val_every=0", *common]
        wall1, done = train(recipe, first)
        if done.returncode:
            return {"refused": _reason(done)}
        before = json.loads((out / name / "summary.json").read_text())["val/accuracy_start"]
        wall2, done = train(recipe, [*base, "run.resume=auto"])
        wall = wall1 + wall2
    else:
        wall, done = train(recipe, [*base, *PATHS[name]])
    if done.returncode:
        return {"refused": _reason(done)}
    summary = json.loads((out / name / "summary.json").read_text())
    lines = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    start = summary["val/accuracy_start"] if before is None else before
    figures = {
        "start": start,
        "final": summary["val/accuracy_final"],
        "gain_points": 100 * (summary["val/accuracy_final"] - start),
        "wall_s": wall,
        "peak_gb": summary.get("memory/peak_gb"),
    }
    mismatch = [m["mismatch/logprob_abs_diff_max"] for m in lines if "mismatch/logprob_abs_diff_max" in m]
    if mismatch:
        figures["mismatch_max"] = max(mismatch)
    return figures


def _reason(done: subprocess.CompletedProcess) -> str:
    text = (done.stderr or done.stdout).strip().splitlines()
    errors = [line for line in text if "Error" in line or "error" in line]
    return (errors or text or ["(no output)"])[-1][:400]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("args", nargs="*", help="[recipe.yaml] [key=value ...]")
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="runs/bench-paths")
    ap.add_argument("--json")
    ns = ap.parse_args()
    recipe = next((a for a in ns.args if a.endswith((".yaml", ".yml"))), str(DEFAULT))
    common = [a for a in ns.args if "=" in a]
    out = Path(ns.out).resolve()
    from tandem.determinism import machine

    figures: dict = {"cpu": machine("cpu")}
    results = {}
    for name in ns.paths:
        results[name] = result = run_path(name, recipe, ns.steps, out, common)
        if "refused" in result:
            print(f"{name:14s} refused: {result['refused']}", flush=True)
            figures[f"{name}_refused"] = result["refused"]
            continue
        base = results.get("recipe", {}).get("wall_s")
        result["wall_ratio"] = result["wall_s"] / base if base else None
        extra = f", mismatch max {result['mismatch_max']:.3g}" if "mismatch_max" in result else ""
        ratio = f" ({result['wall_ratio']:.2f}x the recipe's)" if result["wall_ratio"] else ""
        print(
            f"{name:14s} {100 * result['start']:.1f}% -> {100 * result['final']:.1f}% "
            f"({result['gain_points']:+.1f} points), {result['wall_s']:.0f} s{ratio}, "
            f"peak {result['peak_gb']:.2f} GB{extra}",
            flush=True,
        )
        figures.update({f"{name}_{k}": v for k, v in result.items() if v is not None})
    print(f"on {figures['cpu']}, {ns.steps} steps each")
    if ns.json:
        Path(ns.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
