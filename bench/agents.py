"""Agents through the OpenAI-compatible endpoint against tandem's built-in agent loop, on one engine.

    python bench/agents.py [--model builtin:addition] [--engine builtin|paged] [--groups 16]
                           [--repeats 3] [--json PATH] [key=value ...]

`key=value` overrides go to both agents' config, e.g. for the real model:
`--model builtin:smollm2-135m-instruct rollout.max_new_tokens=32 data.max_prompt_length=128`.

One rollout worker per agent, built as `tandem train` builds them (`build_rollout`), on the same
model, engine kind and prompts (--groups prompts of the default task x 8 samples, the run's
sampling): the built-in `single_turn` agent against `openai:tandem.agent.examples:answer`, the same
episode written against the OpenAI API (one chat completion of the same prompt, rendered by the same
template, sampled the same way; every request through the worker's HTTP endpoint and the real
`openai` client). Their generate calls alternate, best of --repeats, in episodes/s:
`endpoint_vs_builtin` is the endpoint's over the built-in's. The shipped model is tiny, so this is
the endpoint's overhead against an engine call that costs little; with a real model the engine's
share grows and the ratio with it. (The tools agent is not the counterpart here: the shipped warm
start calls no tool in either format, so its episodes would differ in length, not in overhead.)

Then `openai:tandem.agent.examples:revise` (two chat turns, the second extending the first):
`prefix_reuse` is the share of the prompt tokens of all its requests that were the earlier turn's
prompt and completion ids, reused as they were (never re-tokenized).
"""

import argparse
import json
import time

from tandem import devices
from tandem.config.sampling import sampling_params
from tandem.data.dataset import prompts_from_rows
from tandem.data.tasks import TASKS
from tandem.data.template import encode_prompts
from tandem.rollout.group import make_groups
from tandem.runtime.roles import build_rollout
from tandem.runtime.startup import load_config

BUILTIN = ["rollout.agent=single_turn"]
ENDPOINT = ["rollout.agent=openai:tandem.agent.examples:answer"]
REVISE = [
    "rollout.agent=openai:tandem.agent.examples:revise",
    "rollout.max_new_tokens=64",
]  # room for 2 turns


def worker(args, agent: list[str]):
    common = [f"model.path={args.model}", f"rollout.engine={args.engine}", *args.overrides]
    cfg = devices.resolve(load_config(None, [*common, *agent]), 0)
    w, _ = build_rollout(cfg)
    return w, sampling_params(cfg, cfg.rollout.temperature), cfg.data.max_prompt_length


def episodes(w, groups: int, max_prompt_length: int):
    rows = TASKS.get("addition")().make_rows(groups, seed=3)
    prompts = prompts_from_rows(rows)
    return make_groups(prompts, encode_prompts(w.tokenizer, prompts, max_prompt_length), 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:addition")
    ap.add_argument("--engine", default="builtin", choices=["builtin", "paged"])
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for both agents")
    args = ap.parse_args()
    workers = {"builtin": worker(args, BUILTIN), "endpoint": worker(args, ENDPOINT)}
    n = args.groups * 8
    best = dict.fromkeys(workers, 0.0)
    for round_ in range(args.repeats + 1):  # round 0 warms both up (imports, the endpoint)
        for name, (w, params, length) in workers.items():
            samples = episodes(w, args.groups, length)
            start = time.perf_counter()
            w.generate(samples, params)
            if round_:
                best[name] = max(best[name], n / (time.perf_counter() - start))
    ratio = best["endpoint"] / best["builtin"]
    print(f"model {args.model}, engine {args.engine}, {n} episodes of the addition task")
    print(
        f"episodes/s: built-in single_turn {best['builtin']:.1f}, through the endpoint {best['endpoint']:.1f}"
    )
    overhead_ms = (1 / best["endpoint"] - 1 / best["builtin"]) * 1e3  # the call time it adds per episode
    print(
        f"endpoint_vs_builtin: {ratio:.2f} (the endpoint adds {overhead_ms:.1f} ms of the call per episode)"
    )
    w, params, length = worker(args, REVISE)
    samples = w.generate(episodes(w, args.groups, length), params)
    prompt = sum(s.agent_stats["prompt_tokens"] for s in samples)
    reused = sum(s.agent_stats["reused_prompt_tokens"] for s in samples)
    turns = sum(s.agent_stats["turns"] for s in samples) / len(samples)
    print(
        f"prefix_reuse: {reused / prompt:.2f} of {prompt:.0f} prompt tokens ({turns:.1f} turns per episode)"
    )
    if args.json:
        figures = {
            "builtin_episodes_per_s": best["builtin"],
            "endpoint_episodes_per_s": best["endpoint"],
            "endpoint_vs_builtin": ratio,
            "endpoint_overhead_ms_per_episode": overhead_ms,
            "prefix_reuse": reused / prompt,
            "episodes": n,
        }
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
