"""How often a judge checkpoint agrees with the addition verifier, by the kind of claim it judges.

    python bench/judge.py [--judge runs/sft-judge] [--problems 400] [--json PATH]

The judge (`recipes/sft-judge.yaml` trains it) answers, greedily and through `JudgeWorker` as the
judge worker does (the template, parser and output length of recipes/judge.yaml), held-out
two-digit problems with three kinds of claim: the right sum, the sum with its carries dropped
(the warm-start policy's own mistake; only problems with a carry), and another wrong claim
(`tandem.data.tasks.wrong_sum`). Prints the agreement of each kind and a few disagreements;
`--json` writes `right`, `carry_dropped`, `other_wrong` (fractions agreeing), `n_right`,
`n_carry_dropped`, `n_other_wrong` and `cpu`.
"""

import argparse
import json
import random
from pathlib import Path

import torch

from tandem.data.dataset import prompts_from_rows
from tandem.data.tasks import Addition, wrong_sum
from tandem.data.tokenizer import load_tokenizer
from tandem.determinism import machine
from tandem.model.checkpoint import load_model
from tandem.model.config import model_dir
from tandem.reward.judge import JudgeWorker
from tandem.rollout.engine import BuiltinEngine
from tandem.runtime.startup import load_config
from tandem.sample import Sample

ROOT = Path(__file__).resolve().parents[1]


def claims(problems: int) -> dict[str, list[tuple[object, str, bool]]]:
    """kind -> (prompt, claim, whether it is right) on `problems` held-out problems."""
    task, rng = Addition(2), random.Random(0)
    rows = task.make_rows(problems, seed=123, split="test")
    kinds: dict[str, list[tuple[object, str, bool]]] = {"right": [], "carry_dropped": [], "other_wrong": []}
    for row, prompt in zip(rows, prompts_from_rows(rows), strict=True):
        truth, dropped = task.solution(row), task.flawed_solution(row, rng)
        kinds["right"].append((prompt, truth, True))
        if dropped != truth:
            kinds["carry_dropped"].append((prompt, dropped, False))
        kinds["other_wrong"].append((prompt, wrong_sum(int(truth), rng), False))
    return kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--judge", default="runs/sft-judge", help="the judge checkpoint")
    ap.add_argument("--problems", type=int, default=400)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    path = model_dir(args.judge)
    cfg = load_config(ROOT / "recipes/judge.yaml", [f"reward.judge.path={path}"])
    model, tokenizer = load_model(path).eval(), load_tokenizer(path)
    engine = BuiltinEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, seed=0)
    judge = JudgeWorker(engine, tokenizer, cfg.reward.judge, None, model.cfg.max_position_embeddings)
    figures: dict[str, object] = {"cpu": machine("cpu")}
    for kind, items in claims(args.problems).items():
        samples = [Sample(prompt=p, prompt_ids=[0], response_text=c) for p, c, _ in items]
        with torch.no_grad():
            verdicts = judge.verdicts(samples)
        agree = [
            not failed and (score >= 0.5) == right
            for (score, failed, _), (_, _, right) in zip(verdicts, items, strict=True)
        ]
        wrong = [
            f"{p.messages[-1]['content']}{c}?" for (p, c, _), ok in zip(items, agree, strict=True) if not ok
        ]
        figures[kind], figures[f"n_{kind}"] = sum(agree) / len(agree), len(agree)
        share = sum(agree) / len(agree)
        print(f"{kind:14s} {len(agree):4d} claims  agreement {share:.1%}  e.g. wrong on {wrong[:4]}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
