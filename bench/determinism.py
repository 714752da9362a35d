"""What `run.deterministic` costs and what it buys, side by side in one run.

    python bench/determinism.py [--model builtin:addition] [--dtype auto] [--device cpu]
                                [--repeats 3] [--json PATH]

On one model (the default task's, in the run's dtype: bf16 on a CPU with native bf16 matmuls):

1. Engine: tokens/s of the built-in engine generating --batch (64) held-out prompts x 8 samples,
   --new-tokens (16) each with EOS ignored, with the batch-invariant forward off and on; the two
   alternate, best of --repeats. `overhead_engine` = tokens/s off / tokens/s on.
2. Train step: one train step (recompute of π_old, then the update) on those samples, off and on,
   alternating, best of --repeats. `overhead_train` = step time on / step time off.
3. Greedy repeatability: one greedy request submitted --greedy (1,000) times, mixed into batches of
   random sizes (1..64) among random other prompts (up to a quarter of a batch its copies), on
   the built-in and the paged engine with the forward on; `unique_greedy_completions` is the
   number of distinct completions over both (1 = every copy returned the same tokens),
   `unique_greedy_completions_off` the same with it off.
4. Mismatch: max |engine logprob - trainer logprob| over the sampled tokens of (1) at the same
   weights, off and on (`mismatch_max_off`, `mismatch_max_on`; on must be exactly 0).

`--json` writes those keys as one flat object. No Ray: it runs on a GPU machine with torch only
(`--device cuda`).
"""

import argparse
import json
import random
import time

import torch

from tandem.config import AlgoConfig, TrainConfig
from tandem.data.dataset import prompts_from_rows
from tandem.data.tasks import TASKS
from tandem.data.template import encode_prompts
from tandem.data.tokenizer import load_tokenizer
from tandem.determinism import machine
from tandem.devices import cpu_has_native_bf16
from tandem.dtypes import DTYPES
from tandem.model.checkpoint import load_model
from tandem.model.config import resolve_model_path
from tandem.rollout.engine import BuiltinEngine
from tandem.rollout.group import make_groups
from tandem.rollout.paged_engine import PagedEngine
from tandem.sample import SamplingParams
from tandem.train.worker import TrainWorker


def prompts(tokenizer, count: int, seed: int):
    rows = TASKS.get("addition")().make_rows(4 * count, seed=seed, split="test")
    distinct = list({r["prompt"][0]["content"]: r for r in rows}.values())[:count]
    chosen = prompts_from_rows(distinct)
    return chosen, encode_prompts(tokenizer, chosen, 64)


def best_of(repeats: int, runs: dict) -> dict[str, float]:
    """Each callable `repeats` times, alternating -> its best seconds."""
    best = {name: float("inf") for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def greedy_completions(engines: list, tokenizer, copies: int, seed: int) -> int:
    """One greedy request `copies` times among random others, in batches of random sizes (1..64),
    each batch holding 1 to a quarter of its size copies at random places -> the number of distinct
    completions it got. Several copies a batch, so 1,000 copies take ~200 batches, not 1,000 (the
    bench did not finish in 15 minutes on an AVX2 CPU with one a batch)."""
    rng = random.Random(seed)
    pool, pool_ids = prompts(tokenizer, 64, seed)  # pool[0] is the request
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    seen, done, calls = set(), 0, 0
    while done < copies:
        size = rng.randint(1, 64)
        mine = min(rng.randint(1, max(1, size // 4)), copies - done)
        chosen = [rng.randrange(1, 64) for _ in range(size - mine)] + [0] * mine
        rng.shuffle(chosen)  # the copies sit anywhere in their batch
        samples = make_groups([pool[i] for i in chosen], [pool_ids[i] for i in chosen], n=1)
        engines[calls % len(engines)].generate(samples, params)
        seen |= {tuple(s.response_ids) for s, i in zip(samples, chosen, strict=True) if i == 0}
        done, calls = done + mine, calls + 1
    return len(seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:addition")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--greedy", type=int, default=1000)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    native = args.device == "cuda" or cpu_has_native_bf16()  # what train.dtype=auto picks
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if native else "float32")
    dtype = DTYPES[dtype_name]
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or tokenizer.eos_token_id
    engine_model = load_model(path, dtype=dtype, device=args.device)
    engine = BuiltinEngine(engine_model, [eos], pad, max_batch_size=1024)
    trainer = TrainWorker(
        load_model(path, dtype=torch.float32, device=args.device),
        AlgoConfig(),
        TrainConfig(dtype=dtype_name),
        pad,
        device=torch.device(args.device),
        dtype=dtype,
    )
    batch_prompts, ids = prompts(tokenizer, args.batch, seed=1)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True)

    def batch():
        samples = make_groups(batch_prompts, ids, n=8)
        for i, s in enumerate(samples):
            s.seed = i  # the same tokens off and on, so both train steps see the same batch
        return samples

    def set_mode(on: bool) -> None:
        engine_model.batch_invariant = on
        trainer.model.batch_invariant = on
        trainer.compute.batch_invariant = on

    results: dict[str, float] = {}
    samples: dict[bool, list] = {}
    for on in (False, True):  # 4. the mismatch, at the same weights
        set_mode(on)
        samples[on] = engine.generate(batch(), params)
        engine_lp = torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(s.logprobs) for s in samples[on]], batch_first=True
        )
        trainer_lp = trainer.compute_logprobs(samples[on])[:, : engine_lp.shape[1]]
        mask = torch.nn.utils.rnn.pad_sequence(
            [torch.ones(len(s.logprobs)) for s in samples[on]], batch_first=True
        ).bool()
        results[f"mismatch_max_{'on' if on else 'off'}"] = float((engine_lp - trainer_lp).abs()[mask].max())

    def generate(on: bool):
        def run():
            set_mode(on)
            engine.generate(batch(), params)

        return run

    def train(on: bool):
        def run():
            set_mode(on)
            for s in samples[on]:
                s.reward = float(s.index % 2)  # any rewards: the cost does not depend on them
            # The samples' version (the engine's, 0): every step on-policy, π_old from the step's own
            # forward, as in a sync run. Left to advance, only the first step would be: the others
            # recompute π_old (one more forward), and the best "off" step would be the one that did not.
            trainer.version = engine.version
            trainer.train_step(samples[on])

        return run

    tokens = args.batch * 8 * args.new_tokens
    gen = best_of(args.repeats, {"off": generate(False), "on": generate(True)})
    results["engine_tokens_per_s_off"], results["engine_tokens_per_s_on"] = (
        tokens / gen["off"],
        tokens / gen["on"],
    )
    results["overhead_engine"] = gen["on"] / gen["off"]
    step = best_of(args.repeats, {"off": train(False), "on": train(True)})
    results["train_step_s_off"], results["train_step_s_on"] = step["off"], step["on"]
    results["overhead_train"] = step["on"] / step["off"]

    for on in (False, True):
        set_mode(on)
        engines = [engine, PagedEngine(engine_model, [eos], pad, max_num_seqs=64)]
        key = "unique_greedy_completions" + ("" if on else "_off")
        results[key] = float(greedy_completions(engines, tokenizer, args.greedy, seed=2))

    where = f"{machine(args.device)}, {torch.get_num_threads()} threads"
    print(f"model {args.model}, {dtype_name}, {args.device} ({where})")
    print("off -> on (batch-invariant forward)")
    print(
        f"engine   {results['engine_tokens_per_s_off']:9.0f} -> {results['engine_tokens_per_s_on']:9.0f} "
        f"tokens/s   overhead {results['overhead_engine']:.2f}x"
    )
    print(
        f"train    {results['train_step_s_off']:9.3f} -> {results['train_step_s_on']:9.3f} s/step     "
        f"overhead {results['overhead_train']:.2f}x"
    )
    unique_off, unique_on = results["unique_greedy_completions_off"], results["unique_greedy_completions"]
    print(f"greedy   {unique_off:9.0f} -> {unique_on:9.0f} unique completions of {args.greedy}")
    print(f"mismatch {results['mismatch_max_off']:.3g} -> {results['mismatch_max_on']:.3g} max |Δlogprob|")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
