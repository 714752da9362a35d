"""Async RL against sync RL on the same CPUs, model, task and number of steps.

Runs `sync` (roles colocated on every CPU, taking turns), `one_step_off` and `async`
(max_staleness=2; trainer on 3/4 of the CPUs and rollout worker on 1/4, working at the same time) one
after another in one process, with heavy-tailed generation lengths: every response keeps decoding
past its end for a Pareto-distributed number of tokens (`rollout.length_tail_alpha`), as reasoning
models' lengths are; those tokens cost generation and training compute but are neither scored nor
trained on. Prints samples/s of each mode against sync and each run's final held-out accuracy.

    python bench/async_vs_sync.py [--steps 20] [--cpus 2] [--json PATH]
"""

import argparse
import json
import tempfile
import time

import ray

from tandem.runtime.run import run_training
from tandem.runtime.startup import load_config

MODES = {
    "sync": ["run.mode=sync"],
    "one_step_off": ["run.mode=one_step_off", "run.generate_ahead_steps=1"],
    "async": ["run.mode=async", "run.max_staleness=2", "rollout.on_update=continue"],
}
# Training scales with threads and generation (overhead-bound at the tail) hardly does, so the
# trainer gets the larger share: 1.5 of 2 CPUs -> 2 threads, the rollout worker 1 thread.
SPLIT = ["placement.groups=[actor_train,generate]", "placement.ratios=[0.75,0.25]"]


def run(mode: str, args, out_dir: str) -> dict[str, float]:
    overrides = [
        *MODES[mode],
        *(SPLIT if mode != "sync" else []),
        f"run.out_dir={out_dir}",
        f"run.name={mode}",
        f"run.steps={args.steps}",
        "run.val_every=0",
        "run.progress=false",
        f"placement.num_cpus={args.cpus}",
        f"rollout.batch_size={args.batch_size}",
        "rollout.n=8",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.length_tail_alpha={args.alpha}",
        f"rollout.chunk_groups={args.chunk_groups}",
        f"train.lr={args.lr}",
        f"train.micro_batch_tokens={args.micro_batch_tokens}",
        # The same algorithm in every mode: PPO against the behaviour policy (bypass: no recompute).
        "algo.corrections=[bypass]",
        "data.val_size=128",
        "reward.num_workers=1",
    ]
    cfg = load_config(None, overrides)
    start = time.perf_counter()
    summary = run_training(cfg)
    summary["wall_s"] = time.perf_counter() - start
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16, help="prompts per step (8 samples each)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--alpha", type=float, default=1.0, help="Pareto shape of the response lengths")
    p.add_argument("--chunk-groups", type=int, default=8, help="async: prompt groups per generate call")
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--cpus", type=int, default=2, help="the CPU budget every mode gets")
    p.add_argument("--modes", default="sync,one_step_off,async")
    p.add_argument("--json", help="write the figures as one flat JSON object")
    args = p.parse_args()
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, logging_level="WARNING")
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for mode in args.modes.split(","):
            results[mode] = run(mode, args, out)
            r = results[mode]
            print(
                f"{mode:>13}: {r['perf/run_samples_per_s']:6.1f} samples/s, {r['wall_s']:5.1f} s, held-out "
                f"{100 * r['val/accuracy_start']:.1f}% -> {100 * r['val/accuracy_final']:.1f}%",
                flush=True,
            )
    base = results["sync"]["perf/run_samples_per_s"]
    figures = {}
    for mode, r in results.items():
        figures[f"acc_{mode}"] = r["val/accuracy_final"]
        figures[f"samples_per_s_{mode}"] = r["perf/run_samples_per_s"]
        if mode != "sync":
            figures[f"{mode}_vs_sync"] = r["perf/run_samples_per_s"] / base
            print(
                f"{mode} vs sync: {figures[f'{mode}_vs_sync']:.2f}x samples/s, accuracy "
                f"{100 * (r['val/accuracy_final'] - results['sync']['val/accuracy_final']):+.1f} points"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
