"""Built-in engine vs transformers' generate: same model, prompts and sampling settings.

    python bench/engine.py [--model builtin:addition] [--new-tokens 64] [--json PATH]

Prints tokens/s of both at batch 8 and 64 and their ratio. Both sample (temperature 1) and ignore
EOS so they produce exactly batch x new-tokens tokens; the two runs alternate, best of --repeats.
Then the RL workload of the default run — 32 prompts x 8 samples that stop at EOS — in responses/s
(`num_return_sequences` for transformers; the built-in engine prefills each prompt once).
"""

import argparse
import json
import time

import torch
import transformers

from tandem.data import encode_prompts, load_tokenizer, prompts_from_rows
from tandem.data.tasks import TASKS
from tandem.model import load_model, resolve_model_path
from tandem.rollout import BuiltinEngine, SamplingParams, make_groups


def prompt_batch(tokenizer, batch: int) -> tuple[list, list[list[int]]]:
    """`batch` distinct held-out addition prompts (distinct, so no engine can share a prefill)."""
    rows = TASKS.get("addition")().make_rows(4 * batch, seed=1, split="test")
    distinct = list({r["prompt"][0]["content"]: r for r in rows}.values())[:batch]
    prompts = prompts_from_rows(distinct)
    return prompts, encode_prompts(tokenizer, prompts, 64)


def time_tandem(engine: BuiltinEngine, prompts, ids, new_tokens: int) -> float:
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    samples = make_groups(prompts, ids, n=1)
    start = time.perf_counter()
    engine.generate(samples, params)
    elapsed = time.perf_counter() - start
    assert all(len(s.response_ids) == new_tokens for s in samples)
    return len(samples) * new_tokens / elapsed


def hf_generate(hf, ids: list[list[int]], pad: int, new_tokens: int, **extra) -> tuple[torch.Tensor, float]:
    """transformers' generate on left-padded prompts, sampling at temperature 1 -> (output, seconds)."""
    width = max(map(len, ids))
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            pad_token_id=pad,
            **extra,
        )
    return out[:, width:], time.perf_counter() - start


def time_hf(hf, ids: list[list[int]], pad: int, new_tokens: int) -> float:
    out, elapsed = hf_generate(hf, ids, pad, new_tokens, min_new_tokens=new_tokens)
    assert out.shape[1] == new_tokens
    return len(ids) * new_tokens / elapsed


def time_groups(engine: BuiltinEngine, hf, prompts, ids, pad: int, eos: int, n: int, new_tokens: int):
    """The RL workload: n samples per prompt, stopping at EOS -> (tandem, hf) responses per second."""
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    start = time.perf_counter()
    engine.generate(make_groups(prompts, ids, n=n), params)
    ours = len(ids) * n / (time.perf_counter() - start)
    _, elapsed = hf_generate(hf, ids, pad, new_tokens, num_return_sequences=n, eos_token_id=eos)
    return ours, len(ids) * n / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:addition")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the figures as one flat JSON object")
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    pad = tokenizer.pad_token_id
    engine = BuiltinEngine(load_model(path), [tokenizer.eos_token_id], pad, max_batch_size=1024)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    figures: dict[str, float] = {}
    print(f"model {args.model}, {args.new_tokens} new tokens, {torch.get_num_threads()} threads")
    print(f"{'batch':>6} {'tandem tok/s':>14} {'hf tok/s':>12} {'ratio':>7}")
    for b in args.batches:
        prompts, ids = prompt_batch(tokenizer, b)
        time_tandem(engine, prompts, ids, 4)  # warm up both
        time_hf(hf, ids, pad, 4)
        ours, theirs = 0.0, 0.0
        for _ in range(args.repeats):  # alternate, so machine noise hits both alike
            ours = max(ours, time_tandem(engine, prompts, ids, args.new_tokens))
            theirs = max(theirs, time_hf(hf, ids, pad, args.new_tokens))
        figures.update(
            {f"tokens_per_s_b{b}": ours, f"hf_tokens_per_s_b{b}": theirs, f"ratio_b{b}": ours / theirs}
        )
        print(f"{b:>6} {ours:>14.0f} {theirs:>12.0f} {ours / theirs:>6.2f}x")
    prompts, ids = prompt_batch(tokenizer, 32)
    ours, theirs = 0.0, 0.0
    for _ in range(args.repeats):
        o, h = time_groups(engine, hf, prompts, ids, pad, tokenizer.eos_token_id, n=8, new_tokens=8)
        ours, theirs = max(ours, o), max(theirs, h)
    figures.update({"rl_responses_per_s": ours, "hf_rl_responses_per_s": theirs, "rl_ratio": ours / theirs})
    print(
        f"RL workload (32 prompts x 8 samples, stop at EOS): {ours:.0f} vs {theirs:.0f} responses/s, "
        f"{ours / theirs:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
