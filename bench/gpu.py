"""GPU check: the trainer's speed and MFU, engine vs trainer logprobs, logits vs transformers.

    python bench/gpu.py [--json PATH] [--steps N] [--layers N] [--model PATH]

One process, no Ray (nothing from tandem.controller or the Ray actors is imported), on `cuda`:
1. Train step: a random Qwen2-0.5B-shaped model (--layers overrides its 24 layers) trained by
   `TrainWorker` under train.strategy=fsdp2 with world size 1, compute dtype fp32 then bf16, each on
   a fresh model and worker. A step is 16 groups x 8 samples of 256 prompt + 768 response tokens
   (131,072 tokens), micro_batch_tokens=16384; one warm-up step, then --steps timed steps. Every
   sample carries the worker's current version, so each step is exactly on-policy: one forward and
   one backward per token, no separate π_old forward. tokens/s = tokens per step / seconds per step.
   MFU = flops per token x tokens/s / peak, where, per token (forward + backward = 3 x forward):
       flops = 6 N + 6 L d T
   N: parameters of the decoder layers, the final norm and lm_head (the embedding lookup is no
   matmul; tied embeddings count once, as lm_head); L layers; d = heads x head_dim; T = 1024, the
   sequence length. Attention's QK^T and AV cost 4 d flops per key in the forward and a causal query
   sees T/2 keys on average: 3 x 4 d T/2 = 6 d T per layer. Both dtypes are divided by the GPU's
   dense bf16 peak (TFLOP/s: H100 SXM and H200 989, H100 NVL 835, H100 PCIe 756, A100 312; another
   GPU gets no MFU). fp32 matmuls run as torch's defaults leave them (TF32 if allowed: the table
   says). Peak memory: torch.cuda.max_memory_allocated over the warm-up and timed steps.
2. Mismatch: the built-in engine on the random model (std 0.02) in bf16 samples 64 tokens for 16
   random prompts of 32 tokens x 4; a bf16 fsdp2 `TrainWorker` on the same weights recomputes their
   logprobs; `mismatch_metrics` compares the two (KL(μ ‖ π) by k3 over the sampled tokens, max and
   mean |Δ log p|).
3. Logits vs transformers: the same width with 2 layers, written by `save_model` and read by
   `AutoModelForCausalLM`, on the same 2 x 128 random ids, in fp32 and in bf16: max |Δ logit|.
4. Engine: the paged engine with CUDA graphs (`rollout.cuda_graphs`) in bf16 on the full model
   against transformers' `generate` on the same weights: batch 8 and 64 random prompts of 32
   tokens, 128 new tokens each, sampled (temperature 1), EOS ignored; one warm-up call each (the
   engine records its graphs there), then the best of 3 alternating runs, in tokens/s. Then sleep
   and wake: the bytes the engine frees (`memory/engine_bytes`), the device memory that comes
   back to the driver (torch.cuda.mem_get_info), and the seconds of sleep() and of the wake with
   the weight push that refills it.

`--model PATH` (a checkpoint directory, or `builtin:<name>` such as builtin:smollm2-135m-instruct)
runs every part on that model's shape and weights instead of the random Qwen2-0.5B-shaped one: the
train step and the mismatch check on its weights (the token ids stay random), the logits check on
the whole model read by transformers from the directory itself, and the engine on its weights.

`--json PATH` writes one flat object (a figure that cannot be computed is null). Without CUDA the
script exits with code 2; --allow-cpu runs it on the CPU with a tiny model, to test the script.
"""

import argparse
import copy
import gc
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import transformers

from tandem.algo import mismatch_metrics
from tandem.config import AlgoConfig, TrainConfig
from tandem.model.checkpoint import load_model, save_model
from tandem.model.config import ModelConfig, model_dir
from tandem.model.decoder import CausalLM, init_weights
from tandem.rollout.engine import BuiltinEngine
from tandem.rollout.group import make_groups
from tandem.rollout.paged_engine import PagedEngine
from tandem.sample import Prompt, Sample, SamplingParams, Status
from tandem.sync.dist import free_port
from tandem.train.batch import pad_rows
from tandem.train.worker import TrainWorker

QWEN2_05B = ModelConfig(
    model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
    tie_word_embeddings=True, rope_theta=1000000.0,
)  # fmt: skip
TINY = ModelConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
)  # fmt: skip
# Dense bf16 TFLOP/s by a piece of torch.cuda.get_device_name(), most specific first.
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))


@dataclass(frozen=True)
class Workload:
    groups: int  # a train step's prompts, 8 samples each
    prompt_len: int
    response_len: int
    micro_batch_tokens: int
    gen_prompts: int  # the mismatch check's prompts, 4 samples each
    gen_tokens: int
    hf_len: int  # the logits check's sequence length
    engine_tokens: int  # new tokens per request of the engine vs generate check

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len


GPU_WORK = Workload(16, 256, 768, 16384, 16, 64, 128, 128)
CPU_WORK = Workload(2, 16, 16, 64, 4, 8, 16, 8)


@dataclass(frozen=True)
class Setup:
    cfg: ModelConfig
    work: Workload
    device: str
    steps: int  # timed train steps per dtype
    n_params: int  # N of the 6N rule
    peak: float | None  # dense bf16 TFLOP/s; None: no MFU
    model_dir: str | None = None  # a real checkpoint's directory; None: random weights


def random_model(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    """An fp32 model on the CPU, Normal(0, 0.02) weights."""
    model = CausalLM(cfg)
    init_weights(model, seed, std=0.02)
    return model


def fp32_model(s: "Setup", seed: int) -> CausalLM:
    """The checkpoint's model (--model), else a random one of s.cfg; fp32, on the CPU."""
    return load_model(s.model_dir) if s.model_dir else random_model(s.cfg, seed)


@contextmanager
def hf_dir(s: "Setup", model: CausalLM) -> Iterator[str]:
    """A directory transformers reads `model` from: the checkpoint itself, or `model` written out."""
    if s.model_dir:
        yield s.model_dir
        return
    with tempfile.TemporaryDirectory() as tmp:
        save_model(model, tmp)
        yield tmp


def matmul_params(cfg: ModelConfig) -> int:
    """N of the 6N rule: the layers, the final norm and lm_head, not the embedding lookup."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    parts = (model.model.layers, model.model.norm, model.lm_head)
    return sum(p.numel() for part in parts for p in part.parameters())


def peak_tflops(device: str) -> float | None:
    """The GPU's dense bf16 peak, or None for the CPU and GPUs not in PEAK_TFLOPS."""
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((tf for key, tf in PEAK_TFLOPS if key in name), None)


def train_samples(cfg: ModelConfig, work: Workload, gen: random.Random) -> list[Sample]:
    """work.groups x 8 finished samples of random tokens with 0/1 rewards."""

    def ids(n: int) -> list[int]:
        return [gen.randrange(cfg.vocab_size) for _ in range(n)]

    n = work.response_len
    return [
        Sample(prompt=Prompt(text="x"), prompt_ids=ids(work.prompt_len), group_id=g, index=i,
               response_ids=ids(n), logprobs=[-1.0] * n, versions=[0] * n, loss_mask=[1] * n,
               reward=float(gen.random() < 0.5), status=Status.FINISHED)
        for g in range(work.groups) for i in range(8)
    ]  # fmt: skip


def make_worker(model: CausalLM, dtype: torch.dtype, s: Setup) -> TrainWorker:
    train = TrainConfig(lr=1e-6, strategy="fsdp2", micro_batch_tokens=s.work.micro_batch_tokens)
    worker = TrainWorker(model, AlgoConfig(), train, pad_token_id=0, device=s.device, dtype=dtype)
    worker.parallelize(dist.group.WORLD)
    return worker


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def bench_train(s: Setup, dtype: torch.dtype) -> dict[str, float | None]:
    """-> tokens/s, MFU and peak memory (GB) of fsdp2 train steps in `dtype` (None: not known)."""
    free_memory(s.device)
    samples = train_samples(s.cfg, s.work, random.Random(0))
    worker = make_worker(fp32_model(s, seed=0), dtype, s)
    for step in range(s.steps + 1):  # step 0 warms up
        if step == 1:
            sync(s.device)
            start = time.perf_counter()
        for x in samples:  # this version sampled every token: the step is on-policy
            x.versions = [worker.version] * len(x.response_ids)
        worker.train_step(samples)
    sync(s.device)
    tokens_per_s = len(samples) * s.work.seq_len * s.steps / (time.perf_counter() - start)
    peak_mem = torch.cuda.max_memory_allocated() / 1e9 if s.device == "cuda" else None
    del worker, samples
    free_memory(s.device)
    return {"tokens_per_s": tokens_per_s, "mfu": mfu(s, tokens_per_s), "peak_mem_gb": peak_mem}


def mfu(s: Setup, tokens_per_s: float) -> float | None:
    """(6 N + 6 L d T) x tokens/s / peak: see the module docstring."""
    if s.peak is None:
        return None
    d = s.cfg.num_attention_heads * s.cfg.head_dim
    flops_per_token = 6 * s.n_params + 6 * s.cfg.num_hidden_layers * d * s.work.seq_len
    return flops_per_token * tokens_per_s / (s.peak * 1e12)


def bench_mismatch(s: Setup) -> dict[str, float]:
    """The engine's bf16 logprobs (μ) against the bf16 fsdp2 trainer's recompute of them."""
    cfg, gen = s.cfg, random.Random(1)
    model = fp32_model(s, seed=1)
    engine = BuiltinEngine(copy.deepcopy(model).to(s.device, torch.bfloat16), [cfg.vocab_size - 1], 0, seed=0)
    prompt_ids = [[gen.randrange(cfg.vocab_size) for _ in range(32)] for _ in range(s.work.gen_prompts)]
    samples = make_groups([Prompt(text="x")] * s.work.gen_prompts, prompt_ids, 4)
    engine.generate(samples, SamplingParams(temperature=1.0, max_new_tokens=s.work.gen_tokens))
    del engine
    worker = make_worker(model, torch.bfloat16, s)
    old = worker.compute_logprobs(samples)  # (B, R)
    del worker
    free_memory(s.device)
    width = old.shape[1]
    mask = pad_rows([x.loss_mask for x in samples], width)
    return mismatch_metrics(old, pad_rows([x.logprobs for x in samples], width), mask)


@torch.no_grad()
def bench_hf(s: Setup) -> dict[str, float]:
    """max |logits - transformers' logits| of a 2-layer model of the same width (--model: the whole
    checkpoint), fp32 and bf16."""
    model = fp32_model(s, 2) if s.model_dir else random_model(replace(s.cfg, num_hidden_layers=2), seed=2)
    ids = torch.randint(s.cfg.vocab_size, (2, s.work.hf_len), generator=torch.Generator().manual_seed(2))
    ids = ids.to(s.device)
    positions = torch.arange(ids.shape[1], device=s.device)[None].expand_as(ids)
    out = {}
    with hf_dir(s, model) as tmp:
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            ours = model.to(s.device, dtype)(ids, positions, torch.ones_like(ids, dtype=torch.bool))
            hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(s.device)
            out[name] = float((ours - hf(ids).logits.float()).abs().max())
            del hf
    return out


def device_free_bytes(device: str) -> int | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def timed(device: str, fn) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


@torch.no_grad()
def bench_engine(s: Setup, batches: tuple[int, ...] = (8, 64)) -> dict[str, float | None]:
    """Tokens/s of the paged engine with CUDA graphs and of transformers' generate, bf16, on the
    same weights; then what sleep frees and what sleep and wake (with the refilling push) cost."""
    model = fp32_model(s, seed=3)
    new, gen, out = s.work.engine_tokens, random.Random(3), {}
    with hf_dir(s, model) as tmp:
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).to(s.device).eval()
    blocks = max(batches) * ((32 + new) // 16 + 2)
    engine = PagedEngine(copy.deepcopy(model).to(s.device, torch.bfloat16), [s.cfg.vocab_size - 1], 0,
                         num_kv_blocks=blocks, max_num_seqs=max(batches), cuda_graphs=True)  # fmt: skip
    params = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True)
    for b in batches:
        ids = [[gen.randrange(1, s.cfg.vocab_size - 1) for _ in range(32)] for _ in range(b)]
        prompt = torch.tensor(ids, device=s.device)
        calls = {
            "engine": lambda ids=ids, b=b: engine.generate(make_groups([Prompt()] * b, ids, 1), params),
            "hf": lambda prompt=prompt: hf.generate(prompt, attention_mask=torch.ones_like(prompt),
                do_sample=True, max_new_tokens=new, min_new_tokens=new, pad_token_id=0),
        }  # fmt: skip
        for call in calls.values():  # warm-up: the engine records its graphs here
            timed(s.device, call)
        best = dict.fromkeys(calls, float("inf"))
        for _ in range(3):
            for name, call in calls.items():
                best[name] = min(best[name], timed(s.device, call))
        out[f"engine_tokens_per_s_b{b}"] = b * new / best["engine"]
        out[f"hf_tokens_per_s_b{b}"] = b * new / best["hf"]
        out[f"engine_vs_hf_b{b}"] = best["hf"] / best["engine"]
    weights = {n: p.detach().clone() for n, p in engine.named_weights().items()}
    before = device_free_bytes(s.device)
    slept = engine.sleep()
    after = device_free_bytes(s.device)
    out["engine_sleep_s"], out["engine_bytes"] = slept["perf/sleep_s"], slept["memory/engine_bytes"]
    out["engine_device_bytes_returned"] = None if before is None else float(after - before)
    out["engine_wake_and_push_s"] = timed(s.device, lambda: engine.load_weights(weights.items(), version=1))
    out["engine_wake_s"] = engine.last_wake_s
    return out


def measure(s: Setup) -> dict[str, str | float | None]:
    """-> the flat figures --json writes."""
    fp32, bf16 = bench_train(s, torch.float32), bench_train(s, torch.bfloat16)
    mismatch, hf, engine = bench_mismatch(s), bench_hf(s), bench_engine(s)
    return {
        **engine,
        "gpu": torch.cuda.get_device_name() if s.device == "cuda" else "cpu",
        "model": s.model_dir or f"random {s.cfg.model_type}",
        "train_tokens_per_s_fp32": fp32["tokens_per_s"],
        "train_tokens_per_s_bf16": bf16["tokens_per_s"],
        "bf16_vs_fp32_speedup": bf16["tokens_per_s"] / fp32["tokens_per_s"],
        "mfu_fp32": fp32["mfu"],
        "mfu_bf16": bf16["mfu"],
        "peak_mem_gb_fp32": fp32["peak_mem_gb"],
        "peak_mem_gb_bf16": bf16["peak_mem_gb"],
        "mismatch_kl_bf16": mismatch["mismatch/kl"],
        "mismatch_logprob_abs_diff_max_bf16": mismatch["mismatch/logprob_abs_diff_max"],
        "mismatch_logprob_abs_diff_mean_bf16": mismatch["mismatch/logprob_abs_diff_mean"],
        "hf_logits_max_abs_diff_fp32": hf["fp32"],
        "hf_logits_max_abs_diff_bf16": hf["bf16"],
    }


def show(r: dict, s: Setup) -> None:
    def fmt(v: float | None, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    tokens = s.work.groups * 8 * s.work.seq_len
    tf32 = torch.backends.cuda.matmul.allow_tf32
    print(
        f"device: {r['gpu']}  (dense bf16 peak: {fmt(s.peak, '.0f')} TFLOP/s; fp32 matmuls via TF32: {tf32})"
    )
    if s.peak is None and s.device == "cuda":
        print("unknown GPU, MFU not computed")
    print(f"model: {r['model']}: {s.cfg.model_type}, {s.cfg.num_hidden_layers} layers, "
          f"N = {s.n_params / 1e6:.1f}M matmul params; train step: {tokens} tokens, fsdp2, "
          "world size 1")  # fmt: skip
    print(f"{'train step':<32}{'fp32':>12}{'bf16':>12}")
    rows = (("tokens/s", "train_tokens_per_s", ".0f"), ("MFU (of the bf16 peak)", "mfu", ".1%"),
            ("peak memory (GB)", "peak_mem_gb", ".2f"))  # fmt: skip
    for label, key, spec in rows:
        print(f"  {label:<30}{fmt(r[key + '_fp32'], spec):>12}{fmt(r[key + '_bf16'], spec):>12}")
    print(f"  {'bf16 / fp32 speed':<30}{r['bf16_vs_fp32_speedup']:>23.2f}x")
    print("engine vs trainer logprobs, bf16: KL(k3) "
          f"{r['mismatch_kl_bf16']:.2e}, |Δ log p| max {r['mismatch_logprob_abs_diff_max_bf16']:.3g}, "
          f"mean {r['mismatch_logprob_abs_diff_mean_bf16']:.3g}")  # fmt: skip
    layers = "whole model" if s.model_dir else "2 layers"
    print(f"logits vs transformers ({layers}), max |Δ|: fp32 {r['hf_logits_max_abs_diff_fp32']:.3g}, "
          f"bf16 {r['hf_logits_max_abs_diff_bf16']:.3g}")  # fmt: skip
    for b in (8, 64):
        print(f"engine (paged, CUDA graphs, bf16) batch {b}: {r[f'engine_tokens_per_s_b{b}']:.0f} tokens/s, "
              f"generate {r[f'hf_tokens_per_s_b{b}']:.0f}: {r[f'engine_vs_hf_b{b}']:.2f}x")  # fmt: skip
    returned = r["engine_device_bytes_returned"]
    print(f"engine sleep: {r['engine_bytes'] / 2**20:.0f} MiB freed in {r['engine_sleep_s']:.3f} s "
          f"({fmt(None if returned is None else returned / 2**20, '.0f')} MiB back to the driver); "
          f"wake {r['engine_wake_s']:.3f} s, wake + push {r['engine_wake_and_push_s']:.3f} s")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the figures to this file as one flat JSON object")
    p.add_argument("--steps", type=int, default=3, help="timed train steps per dtype (after 1 warm-up)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers of the model (default 24)")
    p.add_argument("--model", help="a checkpoint directory or builtin:<name> to measure instead of random "
                   "Qwen2-0.5B-shaped weights")  # fmt: skip
    p.add_argument("--allow-cpu", action="store_true", help="without CUDA, run on the CPU with a tiny model: "
                   "for testing the script on a CPU")  # fmt: skip
    args = p.parse_args()
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("bench/gpu.py measures a CUDA GPU, and torch sees none on this machine (see --help).")
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base, work = (QWEN2_05B, GPU_WORK) if device == "cuda" else (TINY, CPU_WORK)
    path = str(model_dir(args.model)) if args.model else None
    if path:
        if args.layers:
            p.error("--layers sets the random model's depth; --model measures the checkpoint as it is")
        base = ModelConfig.load(path)
    cfg = replace(base, num_hidden_layers=args.layers or base.num_hidden_layers)
    setup = Setup(cfg, work, device, args.steps, matmul_params(cfg), peak_tflops(device), path)
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)  # fmt: skip
    try:
        results = measure(setup)
    finally:
        dist.destroy_process_group()
    show(results, setup)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
