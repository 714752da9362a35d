"""LoRA against full weights on the Qwen2-0.5B-shaped random model of bench/engine.py: what a weight
push, the optimizer and a train step cost, and what an adapter costs the engine's decode.

    python bench/lora.py [--rank 16] [--dtype auto] [--layers 24] [--train-layers 24] [--repeats 2]
                         [--train-length 8] [--new-tokens 12] [--device cpu] [--json PATH]

Side by side in one run, adapters of rank --rank (alpha 2 x rank) on attention + MLP (q, k, v, o,
gate, up, down projections), everything in --dtype (auto: bf16 on a CPU with native bf16 matmuls,
else fp32, as train.dtype=auto chooses; the trainer keeps fp32 masters):
1. Push bytes: the bucket plan of an adapter-only push (`adapter_shapes`, what a LoRA run's engine
   plans from the config) against a full push, both in --dtype on the wire -> push_bytes_ratio.
2. Push time: what the driver waits for and then the swap. The trainer packs its fp32 tensors and
   puts the buckets in Ray's object store (`ObjectStoreTransport`, here in one process); the
   rollout side gets and stages them and swaps them into the built-in engine, which, for the
   adapters, merges them into its weights (`merge_s` of it). Both pushes land in one LoRA engine,
   the full one by name into its weights, as a full-weights run's engine takes it. Medians of
   --repeats after a warm-up -> push_time_ratio.
3. Optimizer: AdamW's state of a LoRA train worker against a full one at full depth, 2 fp32 moments
   per trained parameter (checked against the real optimizers of 4) -> optimizer_bytes_ratio.
4. Train step: `TrainWorker` on 8 sequences of --train-length (8) prompt + as many response
   tokens, LoRA then all weights, each alone in memory (a full worker holds ~8 GB in fp32:
   weights, gradients, AdamW state), on the first --train-layers layers -> train_step_ratio
   (medians of --repeats after a warm-up).
5. Decode: the built-in engine's tokens/s over the decode steps of a batch of 8 (prompts of 8
   random tokens, --new-tokens sampled, EOS ignored; the prefill left out), taking turns: the base
   against the adapter merged (the engines' way) -> decode_with_adapter_ratio; then against the
   adapter unmerged (PEFT's layer, `LoraLinear`, on unfused projections) -> unmerged_decode_ratio,
   and the unfused base -> unfused_decode_ratio. The same on builtin:addition, the default run's
   model, with 4 x --new-tokens: addition_*. Best of --repeats after a warm-up.

`--json` writes one flat object of these figures and their parts. The CPU (lscpu's model name) is
printed and written; nothing here needs a GPU, and only part 2 starts Ray (in this process).
`--device cuda` runs the model, the engines and the train workers on the GPU (its name printed and
written; auto dtype: bf16) and leaves out part 2 where Ray is not installed (the GPU machines have
none), saying so.
"""

import argparse
import copy
import gc
import importlib.util
import json
import math
import random
import resource
import statistics
import subprocess
import time
from contextlib import nullcontext
from dataclasses import replace

import torch
from engine import RANDOM_MODELS

from tandem import devices
from tandem.config import AlgoConfig, LoraConfig, TrainConfig
from tandem.model.checkpoint import load_model
from tandem.model.config import ModelConfig, resolve_model_path
from tandem.model.decoder import CausalLM, init_weights
from tandem.model.lora import adapter_shapes, adapters_off, apply_lora
from tandem.rollout.engine import BuiltinEngine
from tandem.rollout.group import make_groups
from tandem.sample import Prompt, Sample, SamplingParams, Status
from tandem.sync import BucketPlan, ObjectStoreTransport, StagingBuffer
from tandem.train.worker import TrainWorker

MB = 1 << 20
PRODUCE_MB, CONSUME_MB = 512.0, 128.0  # sync.produce_bucket_mb / consume_bucket_mb defaults
BATCH = 8


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line), "?")


DEVICE = torch.device("cpu")  # --device


def random_model(cfg: ModelConfig, dtype: torch.dtype) -> CausalLM:
    model = CausalLM(cfg)
    init_weights(model, seed=0)
    return model.to(DEVICE, dtype)


def adapter_tensors(cfg: ModelConfig, lora: LoraConfig, seed: int = 1) -> dict[str, torch.Tensor]:
    """A trained-looking adapter in fp32 (the trainer's masters): A as PEFT draws it, B non-zero."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in adapter_shapes(cfg, lora).items():
        bound = 1 / shape[1] ** 0.5 if name.endswith("lora_A.weight") else 0.01
        out[name] = (torch.rand(shape, generator=g) * 2 - 1) * bound
    return out


# ---------------------------------------------------------------- 1-3. push bytes, time; optimizer


class Pusher:
    """A push of `sender` into `params` (an engine's `named_weights()`, or its model's parameters by
    name for a full push), with a plan, a transport at each end and a staging buffer built once, as
    the actors build them; `engine` applies it."""

    def __init__(self, sender: dict[str, torch.Tensor], params: dict, engine: BuiltinEngine, dtype):
        self.sender, self.params, self.engine = sender, params, engine
        self.adapters = params is engine.named_weights()
        plan = BucketPlan.from_named_tensors(sender.items(), PRODUCE_MB, CONSUME_MB, dtype)
        mine = BucketPlan.from_named_tensors(params.items(), PRODUCE_MB, CONSUME_MB, dtype)
        mine.check_same_layout(plan)
        self.out, self.into = ObjectStoreTransport(plan, "trainer-0"), ObjectStoreTransport(mine, "rollout-0")
        self.staging, self.bytes = StagingBuffer(mine), plan.payload_bytes

    def __call__(self, version: int) -> float:
        """Push, stage, swap and apply `version` -> seconds."""
        start = time.perf_counter()
        self.into.receive(self.out.send(self.sender.items(), version), version, self.staging, timeout_s=600)
        if self.adapters:  # swapped, then merged
            self.engine.set_pending_update(version, lambda: self.staging.swap_into(self.params, version))
            self.engine.apply_pending()
        else:  # all weights, into the same model by name: a full-weights engine applies nothing more
            self.staging.swap_into(self.params, version)
        return time.perf_counter() - start


def push_figures(cfg: ModelConfig, lora: LoraConfig, dtype: torch.dtype, engine: BuiltinEngine, repeats: int):
    """Adapter and full pushes into one LoRA engine, taking turns."""
    import ray

    ray.init(
        address="local",
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=3 * 2**30,
    )
    weights = {n: p.detach() for n, p in engine.model.named_parameters()}
    masters = {n: t.float() for n, t in weights.items()}  # the trainer's fp32 (no copy in fp32)
    pushers = {
        "adapter": Pusher(adapter_tensors(cfg, lora), engine.named_weights(), engine, dtype),
        "full": Pusher(masters, weights, engine, dtype),
    }
    times: dict[str, list[float]] = {k: [] for k in pushers}
    for version in range(repeats + 1):  # version 0 warms up
        for kind, push in pushers.items():
            seconds = push(version)
            if version:
                times[kind].append(seconds)
    sizes = {k: p.bytes for k, p in pushers.items()}
    del pushers, masters
    ray.shutdown()
    start = time.perf_counter()
    engine.adapters.merge()
    merge_s = time.perf_counter() - start
    t = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"push: adapters {sizes['adapter'] / MB:.1f} MB in {t['adapter']:.3f} s (merging {merge_s:.3f} s "
        f"of it), all weights {sizes['full'] / MB:.0f} MB in {t['full']:.3f} s: "
        f"{sizes['adapter'] / sizes['full']:.4f}x the bytes, {t['adapter'] / t['full']:.3f}x the time"
    )
    return {
        "push_bytes_ratio": sizes["adapter"] / sizes["full"],
        "push_time_ratio": t["adapter"] / t["full"],
        "adapter_push_bytes": sizes["adapter"],
        "full_push_bytes": sizes["full"],
        "adapter_push_s": t["adapter"],
        "full_push_s": t["full"],
        "merge_s": merge_s,
    }


def optimizer_figures(cfg: ModelConfig, lora: LoraConfig) -> dict:
    """AdamW keeps two fp32 moments per trained parameter (and a step count per tensor)."""
    with torch.device("meta"):
        full = sum(p.numel() for p in CausalLM(cfg).parameters())
    adapter = sum(math.prod(shape) for shape in adapter_shapes(cfg, lora).values())
    print(
        f"AdamW state: {8 * adapter / MB:.0f} MB for the adapters ({adapter / 1e6:.1f}M parameters), "
        f"{8 * full / MB:.0f} MB for all weights ({full / 1e6:.0f}M): {adapter / full:.4f}x"
    )
    return {"optimizer_bytes_ratio": adapter / full, "adapter_parameters": adapter, "parameters": full}


# ---------------------------------------------------------------- 4. train step


def batch(vocab: int, length: int = 8, seed: int = 0) -> list[Sample]:
    """8 sequences (2 groups of 4) of `length` prompt and `length` response tokens, rewards mixed in
    each group."""
    rng = random.Random(seed)
    samples = []
    for g in range(2):
        prompt = [rng.randrange(vocab) for _ in range(length)]
        for i in range(4):
            samples.append(
                Sample(
                    prompt=Prompt(text=""),
                    prompt_ids=prompt,
                    group_id=g,
                    index=i,
                    response_ids=[rng.randrange(vocab) for _ in range(length)],
                    logprobs=[-1.0] * length,
                    versions=[0] * length,
                    loss_mask=[1] * length,
                    reward=float(i % 2),
                    status=Status.FINISHED,
                    finish_reason="length",
                )
            )
    return samples


def step_seconds(
    kind: str, cfg: ModelConfig, lora: LoraConfig, dtype: torch.dtype, repeats: int, length: int
):
    """One train worker's median step -> (seconds, AdamW state bytes, trained parameters)."""
    model = random_model(cfg, torch.float32)
    if kind == "lora":
        apply_lora(model, lora)
    worker = TrainWorker(model, AlgoConfig(), TrainConfig(), pad_token_id=0, device=DEVICE, dtype=dtype)
    samples, times = batch(cfg.vocab_size, length), []
    for _ in range(repeats + 1):  # the first warms up
        start = time.perf_counter()
        worker.train_step(copy.deepcopy(samples))
        times.append(time.perf_counter() - start)
    state = worker.learner.optimizer.state.values()
    nbytes = sum(t.nbytes for s in state for t in s.values() if t.dim())  # the moments, not the steps
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return statistics.median(times[1:]), nbytes, trained


def train_figures(
    cfg: ModelConfig, lora: LoraConfig, dtype: torch.dtype, layers: int, repeats: int, length: int
) -> dict:
    """LoRA, then all weights (one at a time: a full worker of the 0.5B model holds ~8 GB)."""
    cfg = replace(cfg, num_hidden_layers=layers)
    t, state, trained = {}, {}, {}
    for kind in ("lora", "full"):
        t[kind], state[kind], trained[kind] = step_seconds(kind, cfg, lora, dtype, repeats, length)
        gc.collect()
    assert all(state[k] == 8 * trained[k] for k in t), (state, trained)  # part 3's count
    print(
        f"train step ({layers} layers, 8 x {2 * length} tokens, {str(dtype).removeprefix('torch.')}): "
        f"LoRA {t['lora']:.2f} s, "
        f"full {t['full']:.2f} s: {t['lora'] / t['full']:.2f}x; AdamW state {state['lora'] / MB:.1f} vs "
        f"{state['full'] / MB:.0f} MB"
    )
    figures = {"train_step_ratio": t["lora"] / t["full"], "lora_step_s": t["lora"], "full_step_s": t["full"]}
    return figures | {"train_tokens": 16 * length}


# ---------------------------------------------------------------- 5. decode


def decode_rate(engine: BuiltinEngine, vocab: int, new_tokens: int) -> float:
    """Tokens/s of the decode steps of one call (from the first sampled token to the last)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (BATCH, 8), generator=g).tolist()
    stamps: list[float] = []
    engine.on_step = lambda step: stamps.append(time.perf_counter())
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(make_groups([Prompt(text="")] * BATCH, ids, 1), params)
    engine.on_step = None
    return BATCH * (len(stamps) - 1) / (stamps[-1] - stamps[0])


def best_rates(engines: dict, vocab: int, new_tokens: int, repeats: int) -> dict[str, float]:
    """Each engine's best decode rate, the engines taking turns (a callable sets the model up first)."""
    best = dict.fromkeys(engines, 0.0)
    for i in range(repeats + 1):  # the first warms up
        for name, (engine, context) in engines.items():
            with context():
                rate = decode_rate(engine, vocab, new_tokens)
            if i:
                best[name] = max(best[name], rate)
    return best


def unmerged(engine: BuiltinEngine, lora: LoraConfig, adapters: dict[str, torch.Tensor]) -> BuiltinEngine:
    """The engine's model made to add s · (x Aᵀ) Bᵀ at every adapted projection, as PEFT's layer
    does (`LoraLinear`): unfused first (a fused weight would pass the adapters by)."""
    for layer in engine.model.model.layers:
        layer.self_attn.fused = layer.mlp.fused = None
    apply_lora(engine.model, lora)
    with torch.no_grad():
        for name, t in adapters.items():
            engine.model.get_parameter(name).copy_(t)
    return engine


def decode_figures(label: str, base: BuiltinEngine, lora: LoraConfig, new_tokens: int, repeats: int) -> dict:
    """`base` (an engine without adapters) against the adapter merged, then against it unmerged
    and the unfused base: two copies of the weights at a time."""
    cfg = base.model.cfg
    adapters = adapter_tensors(cfg, lora)
    merged = BuiltinEngine(copy.deepcopy(base.model), [0], 0, lora=lora)
    merged.load_weights(adapters.items(), version=1)
    engines = {"base": (base, nullcontext), "merged": (merged, nullcontext)}
    rates = best_rates(engines, cfg.vocab_size, new_tokens, repeats)
    del engines, merged
    gc.collect()
    other = unmerged(BuiltinEngine(copy.deepcopy(base.model), [0], 0), lora, adapters)
    engines = {
        "base": (base, nullcontext),
        "unmerged": (other, nullcontext),
        "unfused": (other, lambda: adapters_off(other.model)),
    }
    again = best_rates(engines, cfg.vocab_size, new_tokens, repeats)
    ratios = {
        "decode_with_adapter_ratio": rates["merged"] / rates["base"],
        "unmerged_decode_ratio": again["unmerged"] / again["base"],
        "unfused_decode_ratio": again["unfused"] / again["base"],
        "decode_tokens_per_s_b8": rates["base"],
    }
    print(
        f"decode ({label}, batch {BATCH}): base {rates['base']:.1f} tok/s; merged adapter "
        f"{ratios['decode_with_adapter_ratio']:.2f}x, unmerged {ratios['unmerged_decode_ratio']:.2f}x, "
        f"unfused base {ratios['unfused_decode_ratio']:.2f}x"
    )
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--layers", type=int, default=24, help="the model's depth (24: Qwen2-0.5B's)")
    ap.add_argument("--train-layers", type=int, default=24, help="layers of the train-step model")
    ap.add_argument("--train-length", type=int, default=8, help="prompt and response tokens of each sequence")
    ap.add_argument("--new-tokens", type=int, default=12, help="tokens each decode call samples")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    ap.add_argument("--json", help="write the figures as one flat JSON object")
    args = ap.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    # auto: train.dtype=auto's rule on a CPU; bf16 without native bf16 matmuls crawls (an LM head's
    # input gradient, 64 tokens x 152k x 896, took 109 s on an AMD EPYC without AVX512-BF16)
    native = DEVICE.type == "cuda" or devices.cpu_has_native_bf16()
    auto = "bfloat16" if native else "float32"
    dtype = getattr(torch, auto if args.dtype == "auto" else args.dtype)
    cfg = replace(RANDOM_MODELS["qwen2-0.5b-random"], num_hidden_layers=args.layers)
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)  # q, k, v, o, gate, up, down
    cpu = cpu_name()
    gpu = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else ""
    print(
        f"{gpu or cpu}, {torch.get_num_threads()} threads; Qwen2-0.5B-shaped random model "
        f"({args.layers} layers), LoRA rank {args.rank} on attention + MLP, {dtype}"
    )
    figures: dict = {
        "cpu": cpu,
        "device": gpu or "cpu",
        "rank": args.rank,
        "dtype": str(dtype).removeprefix("torch."),
        "layers": args.layers,
    }
    figures["train_layers"] = args.train_layers
    figures.update(optimizer_figures(cfg, lora))
    base = BuiltinEngine(random_model(cfg, dtype), [0], 0)
    figures.update(decode_figures("Qwen2-0.5B-shaped", base, lora, args.new_tokens, args.repeats))
    engine = BuiltinEngine(base.model, [0], 0, lora=lora)  # its weights: the adapters' base
    del base
    if importlib.util.find_spec("ray"):
        figures.update(push_figures(cfg, lora, dtype, engine, args.repeats))
    else:
        print("push: left out, Ray is not installed here (part 2 puts the buckets in Ray's object store)")
    del engine
    gc.collect()
    figures.update(train_figures(cfg, lora, dtype, args.train_layers, args.repeats, args.train_length))
    addition = BuiltinEngine(load_model(resolve_model_path("builtin:addition"), dtype, DEVICE), [0], 0)
    small = decode_figures("builtin:addition", addition, lora, 4 * args.new_tokens, args.repeats)
    figures.update({f"addition_{k}": v for k, v in small.items()})
    figures["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(", ".join(f"{k} {v:.4f}" for k, v in figures.items() if k.endswith("ratio")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
