"""The rollout engines against transformers' generate, and what bounds them.

    python bench/engine.py [--model builtin:addition | builtin:smollm2-135m-instruct | PATH
                                    | qwen2-0.5b-random] [--engine builtin graphs vllm]
                           [--batches 1 8 64] [--device cpu | cuda] [--dtype auto] [--layers N]
                           [--parts fixed rl ...] [--json PATH]

All in one run, on one model:
1. Fixed lengths: tokens/s of each --engine and of `generate` at each --batches size. All sample
   (temperature 1) and ignore EOS, so each run makes exactly batch x new-tokens tokens; the runs
   alternate, best of --repeats. Then the RL workload, --groups (32) prompts x 8 samples that stop
   at EOS, in responses/s (`num_return_sequences` for transformers; the engines prefill each
   prompt once).
2. Continuous vs static batching: --requests (256) requests of Pareto(1) lengths (scale 4 tokens,
   capped at --new-tokens; `Sample.max_new_tokens`, EOS ignored), at most 64 in flight:
   BuiltinEngine(max_batch_size=64) runs chunks of 64, each until its slowest request ends (it
   drops finished rows, but admits none); PagedEngine(max_num_seqs=64) admits a waiting request as
   soon as one ends. Also prints the forwards each made and their mean decode batch.
3. Prefix sharing: --groups random prompts of 48 tokens x 8 samples, 16 new tokens, EOS ignored;
   PagedEngine with group sharing and prefix caching vs both off. The prefix cache is reset before
   every run, so it serves only what the same call computed (distinct prompts, as in RL).
4. Peak fraction: GFLOP/s of plain matmuls (`F.linear`) of the model's projection shapes at
   M=--peak-m (2048) rows in the model's dtype (the machine's peak on this model's shapes), against
   the decode rate of the largest batch's row: 2 x (weights of every matmul, lm_head included) x
   new tokens/s. That counts neither the prefill, the attention over the cache, nor the sampling.
6. Memory: 64 random prompts x --new-tokens greedy tokens (EOS ignored) on a PagedEngine whose
   KV blocks hold a quarter of what the batch needs, against one that holds all of it: the small
   one must preempt and recompute, never fail, and give the same tokens.
5. Ceiling: the same matmuls at M = each batch size give the tokens/s of a decode step that
   cost nothing but its matmuls (no attention, norms, sampling, Python), and so the largest ratio
   to `generate` any engine could reach on this machine in this dtype (`ceiling_ratio_b8`, ...).
   And the machine's own ceiling, from two rates measured in the same run: a decode step can go
   no faster than reading its matmul weights once at the memory bandwidth (a sum over 512 MB),
   nor than its matmuls' FLOPs at the matmul peak of 4.; each engine's tokens/s as a share of it
   (`ceiling_tokens_per_s_b64`, `ceiling_share_b64`, `vllm_ceiling_share_b64`, ...).

The headline keys (issue 49): `b1_tok_s`, `b8_vs_vllm`, `b64_vs_vllm`, `rl_vs_vllm`,
`b64_ceiling_share` (the builtin engine, the default; `*_vs_vllm` only when vLLM ran), `cpu`.
`--dtype auto` is what `tandem train` computes in: bf16 on a GPU or a CPU with native bf16, else
fp32. The default engines are builtin, paged, graphs and, when it is installed, vllm.

`--model qwen2-0.5b-random` builds a random Qwen2-0.5B-shaped model (`--layers` overrides its
depth) and loads the same weights into transformers' Qwen2ForCausalLM; it is meant for --device
cuda. `--json` writes one flat object: the builtin engine's figures under the keys the first
version of this benchmark wrote, the other engines' under `paged_*`, `compiled_*`, `graphs_*`, and
the figures of 2-4. Nothing here needs Ray: it runs on a GPU machine that has only torch and
transformers (`pip install --no-deps -e .`).
"""

import argparse
import json
import math
import random
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import transformers
from torch import nn

from tandem.data.dataset import prompts_from_rows
from tandem.data.tasks import TASKS
from tandem.data.template import encode_prompts
from tandem.data.tokenizer import load_tokenizer
from tandem.determinism import machine
from tandem.devices import cpu_has_native_bf16
from tandem.model.checkpoint import load_model, save_model
from tandem.model.config import ModelConfig, resolve_model_path
from tandem.model.decoder import CausalLM, init_weights
from tandem.rollout.engine import BuiltinEngine
from tandem.rollout.group import make_groups
from tandem.rollout.paged_engine import PagedEngine
from tandem.sample import Prompt, Sample, SamplingParams

# compiled: the built-in engine with compile=True; graphs: the paged engine with cuda_graphs=True
# (CUDA graphs per batch-size bucket on cuda; on the CPU their fixed-shape decode, run eagerly);
# vllm: VLLMEngine on the installed vLLM (its CPU build on the CPU), with its torch.compile'd graph
ENGINES = ("builtin", "paged", "compiled", "graphs")
OPTIONAL = ("vllm",)  # not in the default list: it needs vLLM installed
# The parts of the docstring: 1 is "fixed" and "rl"; on a slow device `--parts fixed rl` is the table.
PARTS = ("fixed", "rl", "batching", "prefix", "peak", "ceiling", "memory")
RANDOM_MODELS = {
    "qwen2-0.5b-random": ModelConfig(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        rope_theta=1e6,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        eos_token_id=151645,
        pad_token_id=151643,
    )
}
IN_FLIGHT = 64  # the batch-size cap both engines get in the continuous vs static test
BLOCK = 16  # KV block size of every PagedEngine here


@dataclass
class Setup:
    """One model twice (tandem's and transformers'), its special tokens, and where prompts come from."""

    model: CausalLM
    hf: transformers.PreTrainedModel
    eos: int
    pad: int
    tokenizer: transformers.PreTrainedTokenizerBase | None  # None: random prompts everywhere
    path: str  # the checkpoint on disk (vLLM loads it from there)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def prompts(self, batch: int, seed: int = 1) -> tuple[list[Prompt], list[list[int]]]:
        """`batch` distinct prompts (no engine can share a prefill): held-out addition problems
        with a tokenizer, else random ones of 24 tokens."""
        if self.tokenizer is None:
            return self.random_prompts(batch, 24, seed)
        rows = TASKS.get("addition")().make_rows(4 * batch, seed=seed, split="test")
        distinct = list({r["prompt"][0]["content"]: r for r in rows}.values())[:batch]
        prompts = prompts_from_rows(distinct)
        return prompts, encode_prompts(self.tokenizer, prompts, 64)

    def random_prompts(self, batch: int, length: int, seed: int = 1) -> tuple[list[Prompt], list[list[int]]]:
        """`batch` prompts of `length` random tokens, none of them a special token."""
        specials = {self.eos, self.pad, *(self.tokenizer.all_special_ids if self.tokenizer else [])}
        allowed = torch.tensor([t for t in range(self.model.cfg.vocab_size) if t not in specials])
        g = torch.Generator().manual_seed(seed)
        ids = allowed[torch.randint(len(allowed), (batch, length), generator=g)].tolist()
        return [Prompt(text="") for _ in ids], ids

    def builtin(self, max_batch_size: int = 1024) -> BuiltinEngine:
        return BuiltinEngine(self.model, [self.eos], self.pad, max_batch_size=max_batch_size)

    def compiled(self) -> BuiltinEngine:
        """The built-in engine with compile=True, on its own copy of the model (compiling marks the
        model it runs)."""
        model = CausalLM(self.model.cfg).to(self.device, next(self.model.parameters()).dtype)
        model.load_state_dict(self.model.state_dict())
        return BuiltinEngine(model, [self.eos], self.pad, compile=True)

    def vllm(self, max_num_seqs: int):
        """vLLM on the same checkpoint, in this process, with as many threads as the other engines."""
        from tandem.rollout.vllm_engine import VLLMEngine

        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        no_tokenizer = {"skip_tokenizer_init": True} if self.tokenizer is None else {}
        return VLLMEngine(
            self.path, [self.eos], self.pad, dtype=dtype, max_num_seqs=max_num_seqs, engine_args=no_tokenizer
        )

    def paged(self, max_num_seqs: int, max_tokens: int, **kw) -> PagedEngine:
        """Blocks for max_num_seqs sequences of max_tokens tokens (+1 each for copy-on-write): no
        preemption, so the figures measure batching and sharing, not memory pressure."""
        blocks = max_num_seqs * (math.ceil(max_tokens / BLOCK) + 1)
        return PagedEngine(
            self.model,
            [self.eos],
            self.pad,
            num_kv_blocks=blocks,
            block_size=BLOCK,
            max_num_seqs=max_num_seqs,
            **kw,
        )


def load(spec: str, device: str, dtype: torch.dtype, layers: int | None) -> Setup:
    """A checkpoint (path or builtin:<task>) or a random model of RANDOM_MODELS, on `device`."""
    if spec not in RANDOM_MODELS:
        path = resolve_model_path(spec)
        tokenizer = load_tokenizer(path)
        model = load_model(path, dtype, device)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        return Setup(model, hf, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer, str(path))
    cfg = RANDOM_MODELS[spec]
    if layers is not None:
        cfg = replace(cfg, num_hidden_layers=layers)
    random_model = CausalLM(cfg)
    init_weights(random_model, seed=0)
    tmp = tempfile.mkdtemp(prefix="tandem-bench-")  # the same weights for all, through an HF save
    save_model(random_model.to(dtype), tmp)
    del random_model
    model = load_model(tmp, dtype, device)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device).eval()
    return Setup(model, hf, cfg.eos_token_id, cfg.pad_token_id, None, tmp)


def key_prefix(engine: str) -> str:
    """The JSON keys' prefix of an engine's figures: none for builtin (the keys this benchmark's first
    version wrote), "paged_", "vllm_", ... for the others."""
    return "" if engine == "builtin" else f"{engine}_"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- 1. fixed lengths and the RL workload


def time_engine(engine: BuiltinEngine, samples: list[Sample], params: SamplingParams) -> float:
    """Seconds for one `generate` call (it returns Python lists, so the device is done)."""
    start = time.perf_counter()
    engine.generate(samples, params)
    return time.perf_counter() - start


def time_fixed(engine: BuiltinEngine, prompts, ids, new_tokens: int) -> float:
    """-> tokens/s of batch x new_tokens sampled tokens."""
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    samples = make_groups(prompts, ids, n=1)
    elapsed = time_engine(engine, samples, params)
    assert all(len(s.response_ids) == new_tokens for s in samples)
    return len(samples) * new_tokens / elapsed


def hf_generate(setup: Setup, ids: list[list[int]], new_tokens: int, **extra) -> tuple[torch.Tensor, float]:
    """transformers' generate on left-padded prompts, sampling at temperature 1 -> (output, seconds)."""
    width, pad = max(map(len, ids)), setup.pad
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=setup.device)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=setup.device)
    sync(setup.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = setup.hf.generate(
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
    sync(setup.device)
    return out[:, width:], time.perf_counter() - start


def time_hf(setup: Setup, ids: list[list[int]], new_tokens: int) -> float:
    out, elapsed = hf_generate(setup, ids, new_tokens, min_new_tokens=new_tokens)
    assert out.shape[1] == new_tokens
    return len(ids) * new_tokens / elapsed


def fixed_table(
    setup: Setup, engines: dict[str, BuiltinEngine], batches: list[int], new_tokens: int, repeats: int
) -> dict:
    """Tokens/s of each engine and of generate at each batch size; the runs alternate, so machine
    noise hits all alike."""
    figures: dict[str, float] = {}
    print(f"{'batch':>6} {'engine':>8} {'tok/s':>10} {'hf tok/s':>10} {'ratio':>7}")
    for b in batches:
        prompts, ids = setup.prompts(b)
        for name, engine in engines.items():  # warm up (the compiled engine compiles here)
            start = time.perf_counter()
            time_fixed(engine, prompts, ids, 4)
            key = key_prefix(name)
            figures[f"{key}warmup_s"] = figures.get(f"{key}warmup_s", 0.0) + time.perf_counter() - start
        time_hf(setup, ids, 4)
        best = dict.fromkeys([*engines, "hf"], 0.0)
        for _ in range(repeats):
            for name, engine in engines.items():
                best[name] = max(best[name], time_fixed(engine, prompts, ids, new_tokens))
            best["hf"] = max(best["hf"], time_hf(setup, ids, new_tokens))
        figures[f"hf_tokens_per_s_b{b}"] = best["hf"]
        for name in engines:
            key = key_prefix(name)
            ratio = best[name] / best["hf"]
            figures.update({f"{key}tokens_per_s_b{b}": best[name], f"{key}ratio_b{b}": ratio})
            print(f"{b:>6} {name:>8} {best[name]:>10.0f} {best['hf']:>10.0f} {ratio:>6.2f}x")
    if "compiled" in engines:
        print(f"compiled: {figures['compiled_warmup_s']:.0f} s of warm-up calls, compiling included")
    return figures


def rl_workload(
    setup: Setup, engines: dict[str, BuiltinEngine], repeats: int, groups: int = 32, n: int = 8
) -> dict:
    """Responses/s of each engine and of generate on GRPO groups that stop at EOS (8 new tokens)."""
    prompts, ids = setup.prompts(groups)
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    best = dict.fromkeys([*engines, "hf"], 0.0)
    for _ in range(repeats):
        for name, engine in engines.items():
            elapsed = time_engine(engine, make_groups(prompts, ids, n=n), params)
            best[name] = max(best[name], groups * n / elapsed)
        _, elapsed = hf_generate(setup, ids, 8, num_return_sequences=n, eos_token_id=setup.eos)
        best["hf"] = max(best["hf"], groups * n / elapsed)
    figures = {"hf_rl_responses_per_s": best["hf"]}
    for name in engines:
        key = key_prefix(name)
        ratio = best[name] / best["hf"]
        figures.update({f"{key}rl_responses_per_s": best[name], f"{key}rl_ratio": ratio})
        print(
            f"RL workload ({groups} prompts x {n} samples, stop at EOS), {name}: "
            f"{best[name]:.0f} vs {best['hf']:.0f} responses/s, {ratio:.2f}x"
        )
    return figures


def builtin_vs_vllm(figures: dict, batches: list[int]) -> dict:
    """The built-in engines against vLLM, measured side by side above: > 1 where tandem's is faster."""
    out = {}
    for name in ("builtin", "paged"):
        key = key_prefix(name)
        for b in batches:
            if f"{key}tokens_per_s_b{b}" in figures:
                out[f"{name}_vs_vllm_b{b}"] = (
                    figures[f"{key}tokens_per_s_b{b}"] / figures[f"vllm_tokens_per_s_b{b}"]
                )
        if f"{key}rl_responses_per_s" in figures:
            out[f"{name}_vs_vllm_rl"] = (
                figures[f"{key}rl_responses_per_s"] / figures["vllm_rl_responses_per_s"]
            )
    print("built-in engines / vLLM: " + ", ".join(f"{k} {v:.2f}x" for k, v in out.items()))
    return out


# ---------------------------------------------------------------- 2. continuous vs static batching


def pareto_lengths(count: int, cap: int, alpha: float = 1.0, seed: int = 0) -> list[int]:
    """ceil(4 u^(-1/alpha)) for u ~ U(0, 1], capped at `cap`: most short, a few at the cap."""
    rng = random.Random(seed)
    return [min(cap, math.ceil(4 * (1.0 - rng.random()) ** (-1 / alpha))) for _ in range(count)]


def time_lengths(engine: BuiltinEngine, prompts, ids, lengths: list[int], cap: int) -> float:
    """-> tokens/s of one call whose request i makes exactly lengths[i] tokens."""
    samples = make_groups(prompts, ids, n=1)
    for s, length in zip(samples, lengths, strict=True):
        s.max_new_tokens = length
    params = SamplingParams(temperature=1.0, max_new_tokens=cap, ignore_eos=True)
    elapsed = time_engine(engine, samples, params)
    assert [len(s.response_ids) for s in samples] == lengths
    return sum(lengths) / elapsed


def continuous_vs_static(setup: Setup, requests: int, cap: int, repeats: int) -> dict:
    prompts, ids = setup.prompts(requests, seed=2)
    lengths = pareto_lengths(requests, cap)
    engines = {
        "static": setup.builtin(max_batch_size=IN_FLIGHT),
        "continuous": setup.paged(IN_FLIGHT, max(map(len, ids)) + cap),
    }
    for engine in engines.values():  # warm up
        time_lengths(engine, prompts[:8], ids[:8], [min(4, n) for n in lengths[:8]], cap)
    best, shapes = dict.fromkeys(engines, 0.0), {}
    for _ in range(repeats):
        for name, engine in engines.items():
            with forward_shapes(setup.model) as shapes[name]:
                best[name] = max(best[name], time_lengths(engine, prompts, ids, lengths, cap))
    ratio = best["continuous"] / best["static"]
    figures = {
        "continuous_vs_static": ratio,
        "continuous_requests": requests,
        "continuous_tokens": sum(lengths),
    }
    print(
        f"continuous vs static batching ({requests} requests, Pareto lengths: mean "
        f"{sum(lengths) / requests:.1f}, {lengths.count(cap)} at the cap of {cap}; {IN_FLIGHT} in flight): "
        f"{ratio:.2f}x"
    )
    for name, engine in engines.items():
        decode = [rows for rows, tokens in shapes[name] if tokens == 1]
        rows = sum(decode) / max(len(decode), 1)
        figures.update(
            {
                f"{name}_tokens_per_s": best[name],
                f"{name}_forwards": len(shapes[name]),
                f"{name}_rows_per_decode": rows,
            }
        )
        label = f"{name} ({type(engine).__name__}):"
        print(
            f"  {label:<27} {best[name]:>6.0f} tok/s, {len(shapes[name])} forwards, "
            f"{len(decode)} of them decode steps of {rows:.1f} rows on average"
        )
    return figures


@contextmanager
def forward_shapes(model: CausalLM) -> Iterator[list[tuple[int, ...]]]:
    """While open: the (rows, tokens) of the input ids of every forward of `model`."""
    shapes: list[tuple[int, ...]] = []
    handle = model.register_forward_pre_hook(lambda _, args: shapes.append(tuple(args[0].shape)))
    try:
        yield shapes
    finally:
        handle.remove()


# ---------------------------------------------------------------- 3. prefix sharing


def prefix_sharing(setup: Setup, repeats: int, groups: int = 32, n: int = 8, new_tokens: int = 16) -> dict:
    length = min(48, setup.model.cfg.max_position_embeddings - new_tokens)
    prompts, ids = setup.random_prompts(groups, length, seed=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    engines = {
        "shared": setup.paged(groups * n, length + new_tokens),
        "unshared": setup.paged(groups * n, length + new_tokens, group_sharing=False, prefix_caching=False),
    }
    best, prefilled = dict.fromkeys(engines, 0.0), {}
    for engine in engines.values():  # warm up
        time_engine(engine, make_groups(prompts[:2], ids[:2], n=2), params)
    for _ in range(repeats):
        for name, engine in engines.items():
            engine.block_manager.reset_prefix_cache()  # no hits from the previous repeat
            before = engine.runner.num_prefill_tokens
            elapsed = time_engine(engine, make_groups(prompts, ids, n=n), params)
            prefilled[name] = engine.runner.num_prefill_tokens - before
            best[name] = max(best[name], groups * n * new_tokens / elapsed)
    speedup = best["shared"] / best["unshared"]
    print(
        f"prefix sharing ({groups} prompts of {length} tokens x {n} samples, {new_tokens} new tokens; "
        f"paged): shared {best['shared']:.0f} tok/s ({prefilled['shared']} tokens prefilled), "
        f"unshared {best['unshared']:.0f} tok/s ({prefilled['unshared']}), {speedup:.2f}x"
    )
    return {
        "prefix_sharing_speedup": speedup,
        "prefix_shared_tokens_per_s": best["shared"],
        "prefix_unshared_tokens_per_s": best["unshared"],
        "prefix_shared_prefill_tokens": prefilled["shared"],
        "prefix_unshared_prefill_tokens": prefilled["unshared"],
        "prefix_prompt_tokens": length,
    }


# ---------------------------------------------------------------- 4. peak fraction


FUSED = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


def linear_shapes(model: CausalLM) -> Counter:
    """(in_features, out_features) -> how many matmuls of the model's forward have it (lm_head
    included). Projections fused by `fuse_projections` (as the engines run them) count as one."""
    shapes, fused = Counter(), set()
    for layer in model.model.layers:
        for block, names in FUSED.items():
            module = getattr(layer, block)
            if module.fused is not None:
                out_features, in_features = module.fused[0].shape
                shapes[(in_features, out_features)] += 1
                fused.update(id(getattr(module, n)) for n in names)
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m) not in fused:
            shapes[(m.in_features, m.out_features)] += 1
    return shapes


def matmul_peak(model: CausalLM, m: int, repeats: int = 5, dtype: torch.dtype | None = None) -> float:
    """GFLOP/s of x (m, in) @ W.T over the model's projection shapes, each weighted by its count:
    sum(2 m in out) / sum(best time), in `dtype` (default: the model's) on the model's device."""
    p = next(model.parameters())
    dtype = dtype or p.dtype
    flops = seconds = 0.0
    for (fan_in, fan_out), count in linear_shapes(model).items():
        x = torch.randn(m, fan_in, dtype=dtype, device=p.device)
        w = torch.randn(fan_out, fan_in, dtype=dtype, device=p.device)
        best = math.inf
        for _ in range(repeats + 1):  # the first is a warm-up
            sync(p.device)
            start = time.perf_counter()
            F.linear(x, w)
            sync(p.device)
            best = min(best, time.perf_counter() - start)
        flops += 2 * m * fan_in * fan_out * count
        seconds += best * count
    return flops / seconds / 1e9


def peak_fraction(model: CausalLM, m: int, figures: dict[str, float], batch: int) -> dict[str, float]:
    """The matmul peak, each measured engine's decode GFLOP/s at `batch` and its share of the peak;
    `peak_fraction` is the best engine's."""
    params = sum(i * o * n for (i, o), n in linear_shapes(model).items())
    peak, at_batch = matmul_peak(model, m), matmul_peak(model, batch)
    out: dict[str, float] = {"matmul_peak_gflops": peak, "matmul_params": params, "peak_m": m}
    out[f"matmul_gflops_m{batch}"] = at_batch  # the same matmuls at the decode batch's M
    shown = []
    for name in ENGINES:
        key = key_prefix(name)
        tokens_per_s = figures.get(f"{key}tokens_per_s_b{batch}")
        if tokens_per_s is None:
            continue
        rate = 2 * params * tokens_per_s / 1e9
        out.update({f"{key}decode_gflops_b{batch}": rate, f"{name}_peak_fraction": rate / peak})
        out["peak_fraction"] = max(out.get("peak_fraction", 0.0), rate / peak)
        shown.append(f"{name} {rate:.1f} GFLOP/s = {rate / peak:.1%} of it")
    print(
        f"peak: matmuls of the model's shapes at M={m}: {peak:.1f} GFLOP/s (at M={batch}: "
        f"{at_batch:.1f}); decode at batch {batch} "
        f"(2 x {params / 1e6:.2f}M matmul weights x new tokens/s): {'; '.join(shown) or 'not measured'}"
    )
    return out


# ---------------------------------------------------------------- 6. memory


def memory(setup: Setup, new_tokens: int, requests: int = 64) -> dict:
    prompts, ids = setup.random_prompts(requests, 24, seed=4)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    need = requests * math.ceil((24 + new_tokens) / BLOCK)  # blocks the whole batch would hold
    small = PagedEngine(
        setup.model, [setup.eos], setup.pad, num_kv_blocks=need // 4, block_size=BLOCK, max_num_seqs=requests
    )
    engines = {"large": setup.paged(requests, 24 + new_tokens), "small": small}
    outputs, seconds = {}, {}
    for name, engine in engines.items():
        samples = make_groups(prompts, ids, n=1)
        seconds[name] = time_engine(engine, samples, params)
        outputs[name] = [s.response_ids for s in samples]
    same = outputs["small"] == outputs["large"]
    print(
        f"memory ({requests} prompts x {new_tokens} greedy tokens): KV blocks for a quarter of the batch "
        f"({small.block_manager.num_blocks} of {need}): {small.num_preemptions} preemptions, "
        f"{'the same' if same else 'DIFFERENT'} tokens as with room for all, "
        f"{seconds['small'] / seconds['large']:.2f}x its time"
    )
    return {
        "memory_preemptions": small.num_preemptions,
        "memory_same_outputs": float(same),
        "memory_time_ratio": seconds["small"] / seconds["large"],
    }


# ---------------------------------------------------------------- 5. ceiling


def memory_bandwidth(device: torch.device, mb: int = 512, repeats: int = 5) -> float:
    """GB/s of reading `mb` MB once (a sum of fp32 ones, best of `repeats`): what a decode step that
    streams its weights can reach at most."""
    x = torch.ones(mb * 2**20 // 4, device=device)
    best = math.inf
    for _ in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        x.sum()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return mb * 2**20 / best / 1e9


def ceiling(model: CausalLM, batches: list[int], figures: dict[str, float], peak_m: int) -> dict[str, float]:
    """Per batch size: tokens/s of a decode made of the model's matmuls alone (at M = the batch,
    against generate), and the machine's own ceiling on any engine, measured here: a step can go
    no faster than reading every matmul weight once at the measured memory bandwidth, nor than
    its matmuls' FLOPs at the measured matmul peak (M = --peak-m). Each engine's share of it."""
    p = next(model.parameters())
    params = sum(i * o * n for (i, o), n in linear_shapes(model).items())
    peak = figures.get("matmul_peak_gflops") or matmul_peak(model, peak_m)
    bandwidth = memory_bandwidth(p.device)
    out = {"memory_bandwidth_gbs": bandwidth, "matmul_peak_gflops": peak}
    print(f"ceiling: memory {bandwidth:.1f} GB/s, matmuls {peak:.0f} GFLOP/s ({p.dtype}, measured here)")
    for b in batches:
        tokens_per_s = matmul_peak(model, b) * 1e9 / (2 * params)
        ratio = tokens_per_s / figures[f"hf_tokens_per_s_b{b}"]
        step_s = max(params * p.element_size() / (bandwidth * 1e9), 2 * params * b / (peak * 1e9))
        roof = b / step_s
        out.update(
            {
                f"matmul_only_tokens_per_s_b{b}": tokens_per_s,
                f"ceiling_ratio_b{b}": ratio,
                f"ceiling_tokens_per_s_b{b}": roof,
            }
        )
        shares = []
        for name in (*ENGINES, *OPTIONAL, "hf"):
            key = key_prefix(name) if name != "hf" else "hf_"
            rate = figures.get(f"{key}tokens_per_s_b{b}")
            if rate is not None:
                out[f"{key}ceiling_share_b{b}"] = rate / roof
                shares.append(f"{name} {rate / roof:.0%}")
        bound = "memory" if step_s > 2 * params * b / (peak * 1e9) else "matmul"
        print(
            f"  batch {b}: ceiling {roof:.0f} tok/s ({bound}-bound); matmuls alone (M={b}) "
            f"{tokens_per_s:.0f} tok/s = {ratio:.1f}x generate; "
            f"share of the ceiling: {', '.join(shares)}"
        )
    return out


def headline(figures: dict[str, float], device: str) -> dict[str, float | str]:
    """The figures issue 49 names, for the default engine (builtin): batch 1 tokens/s, its ratio
    to vLLM's CPU build at batch 8 and 64 and on the RL workload, its share of the ceiling at
    batch 64, and the CPU (or GPU) they were measured on."""
    out: dict[str, float | str] = {"cpu": machine(device)}
    named = {
        "b1_tok_s": "tokens_per_s_b1",
        "b8_vs_vllm": "builtin_vs_vllm_b8",
        "b64_vs_vllm": "builtin_vs_vllm_b64",
        "rl_vs_vllm": "builtin_vs_vllm_rl",
        "b64_ceiling_share": "ceiling_share_b64",
    }
    out.update({k: figures[v] for k, v in named.items() if v in figures})
    print(
        "headline: "
        + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in out.items())
    )
    return out


# ---------------------------------------------------------------- main


def default_engines() -> list[str]:
    """builtin, paged, graphs, and vllm where it is installed; compiled only when asked for (its
    Inductor compile takes minutes on a real model)."""
    import importlib.util

    return ["builtin", "paged", "graphs"] + (["vllm"] if importlib.util.find_spec("vllm") else [])


def parse_args() -> argparse.Namespace:
    RANDOM, DTYPES = ", ".join(RANDOM_MODELS), ["auto", "float32", "bfloat16", "float16"]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:addition", help=f"a checkpoint, builtin:<task> or {RANDOM}")
    ap.add_argument(
        "--engine",
        nargs="+",
        choices=ENGINES + OPTIONAL,
        default=default_engines(),
        help="engines of table 1 (default: builtin paged graphs, and vllm when it is installed)",
    )
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="auto: as train.dtype=auto (bf16 where native, else fp32)",
    )
    ap.add_argument("--layers", type=int, help="depth of a random model (a quick check on the CPU)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--requests", type=int, default=256, help="requests of the continuous vs static test")
    ap.add_argument("--groups", type=int, default=32, help="prompts (x 8 samples) of the RL and prefix tests")
    ap.add_argument("--peak-m", type=int, default=2048, help="rows of the peak matmuls")
    ap.add_argument("--repeats", type=int, default=5, help="best of this many runs")
    ap.add_argument("--json", help="write the figures as one flat JSON object")
    ap.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts to run (default: all)"
    )
    args = ap.parse_args()
    if args.layers is not None and args.model not in RANDOM_MODELS:
        ap.error(f"--layers sets the depth of a random model ({RANDOM}), not of {args.model}")
    return args


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    native = device.type == "cuda" or cpu_has_native_bf16()
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if native else "float32")
    setup = load(args.model, args.device, getattr(torch, dtype_name), args.layers)
    longest = max(map(len, setup.prompts(max(args.batches))[1])) + args.new_tokens
    seqs = max(*args.batches, 8 * args.groups)
    make = {
        "builtin": setup.builtin,
        "paged": lambda: setup.paged(seqs, longest),
        "compiled": setup.compiled,
        "graphs": lambda: setup.paged(seqs, longest, cuda_graphs=True),
        "vllm": lambda: setup.vllm(seqs),
    }
    engines, started = {}, {}
    for name in dict.fromkeys(args.engine):
        start = time.perf_counter()
        engines[name] = make[name]()
        started[f"{name}_start_s"] = time.perf_counter() - start
    where = (
        f"{torch.get_num_threads()} threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
    )
    print(f"model {args.model}, {dtype_name} on {device} ({where}), {args.new_tokens} new tokens")
    figures, parts = dict(started), set(args.parts)
    if "fixed" in parts:
        figures.update(fixed_table(setup, engines, args.batches, args.new_tokens, args.repeats))
    if "rl" in parts:
        figures.update(rl_workload(setup, engines, args.repeats, args.groups))
    if "vllm" in engines and {"fixed", "rl"} <= parts:
        figures.update(builtin_vs_vllm(figures, args.batches))
    if "batching" in parts:
        figures.update(continuous_vs_static(setup, args.requests, args.new_tokens, args.repeats))
    if "prefix" in parts:
        figures.update(prefix_sharing(setup, args.repeats, args.groups))
    if "peak" in parts and "fixed" in parts:
        figures.update(peak_fraction(setup.model, args.peak_m, figures, max(args.batches)))
    if "ceiling" in parts and "fixed" in parts:
        figures.update(ceiling(setup.model, args.batches, figures, args.peak_m))
    if "memory" in parts:
        figures.update(memory(setup, args.new_tokens))
    figures.update(headline(figures, args.device))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
