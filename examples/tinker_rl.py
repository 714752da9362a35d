"""RL on two-digit addition, written only against the official `tinker` SDK, run on `tandem serve`.

    tandem serve                                   # in one terminal (loopback, port 8000)
    TINKER_API_KEY=tml-local python examples/tinker_rl.py

On the real model (SmolLM2-135M-Instruct, the `real-model` extra), with the settings of
recipes/smollm2-addition.yaml:

    tandem serve recipes/smollm2-addition.yaml
    TINKER_API_KEY=tml-local python examples/tinker_rl.py --model builtin:smollm2-135m-instruct \
        --max-tokens 32 --temperature 0.5 --batch 8 --rank 16 --lr 2e-4 --steps 10 \
        --system "You are a calculator. Answer with the number only."

The loop is the SDK's quick-start shape: sample a group of answers per prompt, reward them, turn
rewards into advantages, one forward_backward with the importance-sampling loss, one optim_step,
then save the weights for a new sampler. It starts from tandem's warm start (`builtin:addition`,
a tiny model that drops every carry) and prints the held-out accuracy before and after.

The problems are made here as tandem's default task makes them ("23+58=" -> "81", one problem in
ten held out by a hash of its text), so the held-out set is the one `tandem train` reports on. The
tokenizer comes from the service (TrainingClient.get_tokenizer, a local path it names).
"""

import argparse
import hashlib
import random
import re
import statistics
import time

import tinker
from tinker import types


def operand(rng: random.Random) -> int:
    digits = rng.randint(1, 2)
    return rng.randint(0 if digits == 1 else 10, 10**digits - 1)


def problems(n: int, split: str, seed: int) -> list[tuple[str, int]]:
    """n problems ("a+b=", a + b) of the split, as tandem's addition task draws them."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        a, b = operand(rng), operand(rng)
        canonical = f"{min(a, b)}+{max(a, b)}="
        bucket = int(hashlib.md5(canonical.encode()).hexdigest(), 16) % 10
        if ("test" if bucket == 0 else "train") == split:
            out.append((f"{a}+{b}=", a + b))
    return out


def reward(text: str, answer: int) -> float:
    """1 when the last integer in the response is the sum."""
    found = re.findall(r"-?\d+", text)
    return float(bool(found) and int(found[-1]) == answer)


def accuracy(sampler, tokenizer, prompts: list[list[int]], answers: list[int], max_tokens: int) -> float:
    """The share of problems answered right greedily."""
    greedy = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    futures = [sampler.sample(types.ModelInput.from_ints(p), 1, greedy) for p in prompts]
    texts = [tokenizer.decode(f.result().sequences[0].tokens, skip_special_tokens=True) for f in futures]
    return sum(reward(t, a) for t, a in zip(texts, answers, strict=True)) / len(answers)


def main(argv: list[str] | None = None) -> dict[str, float | None]:
    """The loop -> its figures: held-out accuracy before and after (None with --held-out 0), and the
    loop's seconds."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="builtin:addition")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=32, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument(
        "--rank", type=int, default=32, help="LoRA rank (tandem serve --full-weights: all weights)"
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-tokens", type=int, default=8, help="response tokens (a real model: 32)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling (a small real model: 0.5)")
    p.add_argument("--system", default="", help="a system turn before each problem")
    p.add_argument("--held-out", type=int, default=256, help="problems (0: no evaluation)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    service = tinker.ServiceClient(base_url=args.base_url)
    training = service.create_lora_training_client(
        base_model=args.model, rank=args.rank, seed=args.seed
    ).result()
    tokenizer = training.get_tokenizer()

    def encode(question: str) -> list[int]:
        chat = [{"role": "system", "content": args.system}] if args.system else []
        chat.append({"role": "user", "content": question})
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    test = problems(args.held_out, "test", args.seed + 1)
    test_prompts, test_answers = [encode(q) for q, _ in test], [a for _, a in test]
    train, rng = problems(20_000, "train", args.seed), random.Random(args.seed)
    sampler = service.create_sampling_client(base_model=args.model).result()
    before = accuracy(sampler, tokenizer, test_prompts, test_answers, args.max_tokens) if test else None
    if before is not None:
        print(f"held-out accuracy before: {before:.1%}", flush=True)

    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    adam = types.AdamParams(learning_rate=args.lr, beta1=0.9, beta2=0.999, eps=1e-8, grad_clip_norm=1.0)
    start = time.time()
    for step in range(args.steps):
        batch = rng.sample(train, args.batch)
        prompts = [encode(q) for q, _ in batch]
        futures = [sampler.sample(types.ModelInput.from_ints(p), args.group, params) for p in prompts]
        groups = [(p, a, f.result().sequences) for p, (_, a), f in zip(prompts, batch, futures, strict=True)]
        # The loss is a sum over tokens: dividing the advantages by the batch's response tokens makes
        # it a mean over them, as tandem's default loss aggregation (token-mean) is.
        tokens = sum(len(s.tokens) for _, _, seqs in groups for s in seqs)
        data, rewards = [], []
        for prompt, answer, seqs in groups:
            r = [reward(tokenizer.decode(s.tokens, skip_special_tokens=True), answer) for s in seqs]
            rewards += r
            mean, std = statistics.mean(r), statistics.stdev(r)
            if std == 0:  # every answer alike: no signal in this group (GRPO)
                continue
            for s, ri in zip(seqs, r, strict=True):
                advantage = (ri - mean) / (std + 1e-6) / tokens
                full = prompt + list(s.tokens)
                pad = [0.0] * (len(prompt) - 1)  # the prompt's positions: no loss
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={
                            "target_tokens": full[1:],
                            "logprobs": pad + list(s.logprobs),
                            "advantages": pad + [advantage] * len(s.tokens),
                        },
                    )
                )
        if data:
            backward = training.forward_backward(data, "importance_sampling")
            step_done = training.optim_step(adam)
            backward.result()
            step_done.result()
        sampler = training.save_weights_and_get_sampling_client().result()
        print(
            f"step {step + 1}: mean reward {statistics.mean(rewards):.3f} ({time.time() - start:.1f} s)",
            flush=True,
        )

    loop_s = time.time() - start
    after = accuracy(sampler, tokenizer, test_prompts, test_answers, args.max_tokens) if test else None
    if after is not None:
        print(f"held-out accuracy: {before:.1%} before -> {after:.1%} after {args.steps} steps")
    else:
        print(f"{args.steps} steps in {loop_s:.1f} s (no held-out accuracy: --held-out 0)")
    service.close("success").result()
    return {"accuracy_before": before, "accuracy_after": after, "loop_s": loop_s}


if __name__ == "__main__":
    main()
