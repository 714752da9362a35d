"""On-policy distillation against GRPO from the same warm start, both curves measured in one run.

    python bench/distill.py [--steps N] [--json PATH]

1. The teacher: `tandem train` (the default run: GRPO on two-digit addition from builtin:addition),
   unless runs/default/checkpoints/final exists already.
2. GRPO: the default run again, validated after every step (run.val_every=1).
3. GRPO at the distillation recipe's lr (train.lr of recipes/distill.yaml), every step validated:
   the same step size.
4. Distillation: `tandem train recipes/distill.yaml`, every step validated.

Each is a process of its own, one after the other, on the same held-out prompts. Prints each curve
and the steps each needs to reach 95% held-out; `--json` writes `grpo_steps_to_95`,
`grpo_same_lr_steps_to_95`, `distill_steps_to_95`, `steps_ratio` (distill / the default GRPO
run), `steps_ratio_same_lr` (distill / GRPO at the recipe's lr), `lr`, `teacher_accuracy`, each
curve as `<run>_acc_<step>`, and `cpu`.
"""

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.95


def train(name: str, args: list[str], out: Path) -> list[float]:
    """`tandem train ARGS` as run `name` under `out` -> held-out accuracy after steps 0, 1, 2, ..."""
    cmd = [sys.executable, "-m", "tandem.cli.main", "train", *args, f"run.name={name}", f"run.out_dir={out}"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return [r["val/accuracy"] for r in rows if "val/accuracy" in r]


def steps_to(curve: list[float], target: float) -> int | None:
    return next((step for step, acc in enumerate(curve) if acc >= target), None)


def cpu() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="train steps of each run")
    ap.add_argument("--out", default="runs/bench-distill", help="where the runs are written")
    ap.add_argument("--json", help="write the figures as one flat JSON object")
    a = ap.parse_args()
    out = (ROOT / a.out).resolve()
    teacher = ROOT / "runs" / "default" / "checkpoints" / "final"
    if not teacher.is_dir():
        subprocess.run([sys.executable, "-m", "tandem.cli.main", "train"], cwd=ROOT, check=True)
    every = [f"run.steps={a.steps}", "run.val_every=1"]
    lr = float(yaml.safe_load((ROOT / "recipes" / "distill.yaml").read_text())["train"]["lr"])
    curves = {
        "grpo": train("grpo", every, out),
        "grpo_same_lr": train("grpo-same-lr", [*every, f"train.lr={lr}"], out),
        "distill": train("distill", ["recipes/distill.yaml", *every], out),
    }
    reach = {name: steps_to(c, TARGET) for name, c in curves.items()}
    summary = json.loads((teacher.parents[1] / "summary.json").read_text())
    figures: dict[str, object] = {f"{n}_steps_to_95": s for n, s in reach.items()}
    for key, grpo in (("steps_ratio", "grpo"), ("steps_ratio_same_lr", "grpo_same_lr")):
        ok = reach["distill"] is not None and reach[grpo]
        figures[key] = reach["distill"] / reach[grpo] if ok else None
    figures["lr"] = lr
    figures["teacher_accuracy"] = summary["val/accuracy_final"]
    figures["cpu"] = cpu()
    for name, curve in curves.items():
        figures.update({f"{name}_acc_{step}": acc for step, acc in enumerate(curve)})
        shown = " ".join(f"{acc:.0%}" for acc in curve)
        print(f"{name:>12}: {shown}  (>= {TARGET:.0%} at step {reach[name]})")
    same = figures["steps_ratio_same_lr"]
    print(f"teacher {summary['val/accuracy_final']:.1%}; steps to {TARGET:.0%}, distill / GRPO: "
          f"{figures['steps_ratio']} (GRPO's default lr), {same} (lr {lr:g})")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
