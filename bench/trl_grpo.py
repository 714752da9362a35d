"""A whole recipe on tandem against TRL's GRPOTrainer: same model, task, prompts and hyper-parameters,
same cores, one after the other.

    python bench/trl_grpo.py [recipe.yaml] [key=value ...] [--json PATH] [--out DIR]

Default recipe: recipes/smollm2-addition.yaml (SmolLM2-135M-Instruct, the `real-model` extra).
Needs `pip install trl` (not a tandem dependency; tested with trl 1.16.0, which uses this
environment's torch). Each side runs as a process of its own, timed from its start to its exit
(loading, conversion cache warm, everything), and its peak memory is read from the process:

1. `tandem train RECIPE` (its summary.json: held-out accuracy before and after, peak memory);
2. TRL: a GRPOTrainer on the same converted checkpoint, given exactly the prompts tandem's loader
   hands out, in its order (`shuffle_dataset=False`), with the recipe's settings mapped one to one:
   rollout.batch_size x rollout.n completions a step (`per_device_train_batch_size`,
   `num_generations`), one optimizer step a step, `max_completion_length`, `temperature`, `top_p`,
   the lr at a constant schedule, AdamW's betas, weight decay and gradient clipping, the clip range
   (`epsilon`, `epsilon_high` = algo.clip_low / clip_high), no KL (`beta=0`, as algo.kl_coef=0),
   token-mean loss over the batch (`loss_type="dapo"`, tandem's `token-mean`), group-normalised
   advantages (`scale_rewards="group"`, algo.norm_by_std), bf16 compute with fp32 weights where
   tandem's train.dtype is bfloat16, no gradient checkpointing (tandem's default; TRL's is on), the
   same reward (the task's verifier);
3. `tandem eval` of TRL's final weights on the recipe's held-out prompts, greedy: the figure beside
   tandem's own val/accuracy_final, measured by the same code.

Prints the wall-time ratio tandem / TRL and both accuracies; `--json` writes `tandem_wall_s`,
`trl_wall_s`, `wall_ratio`, `val_accuracy_start`, `tandem_val_accuracy_final`,
`trl_val_accuracy_final`, `tandem_peak_gb`, `trl_peak_gb`, `cpu`.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "recipes" / "smollm2-addition.yaml"


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """Run `cmd` -> (wall seconds, its peak resident set in GB, its stdout); raises if it fails."""
    start = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(
            f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # RUSAGE_CHILDREN is the largest child so far: exact for the first, a lower bound after it
    return wall, max(peak, before) * 1024 / 1e9, done.stdout


def trl_worker(recipe: str, overrides: list[str], out: str) -> None:
    """The TRL side, in a process of its own."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from tandem import devices
    from tandem.model.config import resolve_model_path
    from tandem.reward.verifiers import VERIFIERS
    from tandem.runtime.roles import build_data
    from tandem.runtime.startup import load_config

    cfg = devices.resolve(load_config(recipe, overrides), 0, "this machine")
    data = build_data(cfg)
    r, t, a = cfg.rollout, cfg.train, cfg.algo
    order = data.train.upcoming(cfg.run.steps * r.batch_size)  # the prompts tandem trains on, in order
    prompts = [data.train.prompts[i] for i in order]
    rows = [
        {"prompt": p.messages, "ground_truth": str(p.ground_truth), "data_source": p.data_source}
        for p in prompts
    ]
    verifier = VERIFIERS.get(prompts[0].data_source)

    def reward(completions, ground_truth, **_) -> list[float]:
        out = []
        for c, truth in zip(completions, ground_truth, strict=True):
            score = verifier(c[0]["content"], truth, {})
            out.append(float(score[0] if isinstance(score, tuple) else score))
        return out

    path = str(resolve_model_path(cfg.model.path))
    torch.manual_seed(cfg.run.seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    args = GRPOConfig(
        output_dir=out,
        max_steps=cfg.run.steps,
        per_device_train_batch_size=r.batch_size * r.n,
        gradient_accumulation_steps=1,
        num_generations=r.n,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        learning_rate=t.lr,
        lr_scheduler_type="constant",
        adam_beta1=t.betas[0],
        adam_beta2=t.betas[1],
        weight_decay=t.weight_decay,
        max_grad_norm=t.grad_clip,
        epsilon=a.clip_low if a.clip_low is not None else 0.2,
        epsilon_high=a.clip_high if a.clip_high is not None else 0.28,
        beta=a.kl_coef,
        loss_type="dapo",
        scale_rewards="group" if a.norm_by_std else "none",
        num_iterations=t.epochs,
        bf16=cfg.train.dtype == "bfloat16",
        use_cpu=True,
        gradient_checkpointing=False,
        shuffle_dataset=False,
        seed=cfg.run.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model(f"{out}/final")
    tokenizer.save_pretrained(f"{out}/final")
    print(json.dumps({"log": trainer.state.log_history}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("args", nargs="*", help="[recipe.yaml] [key=value ...]")
    ap.add_argument("--out", default="runs/bench-trl", help="where both runs write")
    ap.add_argument("--json", help="write the figures as one flat JSON object")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    recipe = next((a for a in ns.args if a.endswith((".yaml", ".yml"))), str(DEFAULT))
    overrides = [a for a in ns.args if "=" in a]
    out = Path(ns.out).resolve()
    if ns.trl_worker:
        trl_worker(recipe, overrides, str(out / "trl"))
        return
    from tandem.determinism import machine

    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    tandem = [sys.executable, "-m", "tandem.cli.main"]
    run = [f"run.out_dir={out}", "run.name=tandem", "run.progress=false", *overrides]
    t_wall, t_peak, _ = timed([*tandem, "train", recipe, *run], env)
    summary = json.loads((out / "tandem" / "summary.json").read_text())
    print(
        f"tandem: {t_wall:.0f} s, held-out {summary['val/accuracy_start']:.3f} -> "
        f"{summary['val/accuracy_final']:.3f}, peak {summary['memory/peak_gb']:.2f} GB",
        flush=True,
    )
    r_wall, r_peak, _ = timed(
        [sys.executable, __file__, recipe, *overrides, "--out", str(out), "--trl-worker"], env
    )
    _, _, text = timed([*tandem, "eval", recipe, *overrides, f"model.path={out / 'trl' / 'final'}"], env)
    trl_acc = json.loads(text[text.index("{") :])["val/accuracy"]
    print(f"TRL:    {r_wall:.0f} s, held-out -> {trl_acc:.3f}, peak >= {r_peak:.2f} GB")
    figures = {
        "tandem_wall_s": t_wall,
        "trl_wall_s": r_wall,
        "wall_ratio": t_wall / r_wall,
        "val_accuracy_start": summary["val/accuracy_start"],
        "tandem_val_accuracy_final": summary["val/accuracy_final"],
        "trl_val_accuracy_final": trl_acc,
        "tandem_peak_gb": summary["memory/peak_gb"],
        "trl_peak_gb": r_peak,
        "cpu": machine("cpu"),
    }
    print(f"wall_ratio (tandem / TRL): {figures['wall_ratio']:.2f}x on {figures['cpu']}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
