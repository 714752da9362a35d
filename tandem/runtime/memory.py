"""The least memory one training step's rollout takes, against this machine's: a rollout.n of 10^8
is refused in seconds, where it would otherwise build its samples until the machine swaps.

Lower bounds, so a config that fits is never refused: one copy of the step's `Sample` records (the
driver, the rollout worker and the trainer each hold one), and one engine's KV cache.
"""

import os
import resource
import sys
from collections.abc import Callable
from typing import Any

from tandem.config import Config
from tandem.config.schema import RolloutConfig
from tandem.errors import TandemError
from tandem.model.batch_invariant import KEY_TILE, round_up
from tandem.model.config import ModelConfig

# A Sample's object, fields and empty lists (measured: 1.1 KiB); a slot of its own copy of the
# prompt's ids; a response token's id, logprob (a float object), version and loss-mask slots (88 B).
SAMPLE_BYTES, PROMPT_TOKEN_BYTES, RESPONSE_TOKEN_BYTES = 1024, 8, 64
GIB = 2**30


def machine_memory() -> int | None:
    """Bytes of physical memory, or None where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(cfg: Config, model: ModelConfig, prompt_ids: list[list[int]], machine: int | None) -> None:
    """TandemError when the step's samples and the engine's host memory exceed `machine` bytes."""
    if machine is None or not prompt_ids:
        return
    r = cfg.rollout
    count = r.batch_size * r.n
    mean_prompt = sum(map(len, prompt_ids)) / len(prompt_ids)
    per_sample = SAMPLE_BYTES + PROMPT_TOKEN_BYTES * mean_prompt + RESPONSE_TOKEN_BYTES * r.max_new_tokens
    engine, what = engine_memory(cfg, model, max(map(len, prompt_ids)))
    weights, held = weights_memory(cfg, model)
    need = count * per_sample + engine + weights
    if need <= machine:
        return
    engine_part = f"; {what}: {engine / GIB:.1f} GiB" if what else ""
    weights_part = f"; {held}: {weights / GIB:.1f} GiB" if held else ""
    raise TandemError(
        f"A training step needs at least {need / GIB:.1f} GiB of memory, and this machine has "
        f"{machine / GIB:.1f} GiB: rollout.batch_size={r.batch_size} prompts x rollout.n={r.n} samples "
        f"= {count} samples, whose records (tokens, logprobs, versions: {per_sample / 1024:.1f} KiB "
        f"each) take {count * per_sample / GIB:.1f} GiB{engine_part}{weights_part}. Lower whichever is "
        "too large (a smaller model, train.lora.rank > 0, fewer workers)."
    )


def weights_memory(cfg: Config, model: ModelConfig) -> tuple[int, str]:
    """(bytes, what they are) the weights take in host memory at the least: each train worker's fp32
    masters, its gradients and AdamW's two moments of what trains (all of it, or with LoRA about
    none), and each built-in engine's copy in rollout.dtype. (0, "") on a GPU."""
    if not _on_host(cfg):
        return 0, ""
    from tandem.model.decoder import meta_model

    params = sum(p.numel() for p in meta_model(model).parameters())
    trains = 0 if cfg.train.lora.rank else params
    trainer = 4 * params + 12 * trains  # masters; gradients and two moments of what trains
    engines = 0
    if cfg.rollout.engine in ENGINE_MEMORY:
        engines = cfg.rollout.num_workers * params * (4 if cfg.rollout.dtype == "float32" else 2)
    workers = cfg.train.num_workers
    what = (
        f"the weights of {params / 1e6:.0f}M parameters: {workers} train worker(s)' fp32 masters"
        f"{', gradients and AdamW moments' if trains else ''} and the engines' copies"
    )
    return workers * trainer + engines, what


def engine_memory(cfg: Config, model: ModelConfig, prompt_tokens: int) -> tuple[int, str]:
    """(bytes, what they are) one rollout engine allocates in host memory; (0, "") on a GPU, and
    for vLLM, which sizes its own memory (rollout.vllm_gpu_memory_utilization)."""
    estimate = ENGINE_MEMORY.get(cfg.rollout.engine)
    return estimate(cfg.rollout, model, prompt_tokens) if estimate and _on_host(cfg) else (0, "")


def _builtin(r: RolloutConfig, model: ModelConfig, prompt_tokens: int) -> tuple[int, str]:
    """At most rollout.max_batch_size sequences decode at once, each with a KV cache of 2 x layers x
    kv heads x head_dim values per token over the longest prompt plus rollout.max_new_tokens (whole
    key tiles), after a prefill of fp32 logits at each distinct prompt's last position (prompts, V)."""
    rows = min(r.max_batch_size, r.batch_size * r.n)
    length = round_up(prompt_tokens + r.max_new_tokens, KEY_TILE)
    itemsize = 4 if r.dtype == "float32" else 2  # auto: bfloat16 at the least
    per_token = 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * itemsize
    prompts = -(-rows // r.n)  # a group's samples share their prompt's prefill
    what = (
        f"the builtin engine's KV cache and prefill logits, {rows} sequences of {length} tokens "
        f"(rollout.max_batch_size={r.max_batch_size})"
    )
    return rows * length * per_token + prompts * model.vocab_size * 4, what


def _paged(r: RolloutConfig, model: ModelConfig, prompt_tokens: int) -> tuple[int, str]:
    """Its block pools, allocated whole when the engine starts."""
    return int(
        r.kv_cache_mb * 2**20
    ), f"the paged engine's KV cache, rollout.kv_cache_mb={r.kv_cache_mb:.10g}"


ENGINE_MEMORY: dict[str, Callable[[RolloutConfig, ModelConfig, int], tuple[int, str]]] = {
    "builtin": _builtin,
    "paged": _paged,
}


def _on_host(cfg: Config) -> bool:
    """Whether the run's weights and engines live in this machine's memory (not a GPU's)."""
    return cfg.run.device == "cpu" or (cfg.run.device == "auto" and not cfg.ray.address and not _cuda_here())


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def process_peak() -> tuple[int, float]:
    """(this process's id, the most memory it has held so far, in GB: its peak resident set, or on
    a GPU the most the device's allocator has held, whichever is more)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    peak = rss if sys.platform == "darwin" else rss * 1024
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak = max(peak, torch.cuda.max_memory_allocated())
    return os.getpid(), peak / 1e9


def peak_memory(cluster: Any, timeout_s: float) -> dict[str, float]:
    """memory/peak_gb/<role>: the largest peak of the processes that ran the role's workers (in a
    run in one process, every role's is the process's); memory/peak_gb: the sum over the distinct
    processes, this driver's included (an upper bound: their peaks need not coincide)."""
    names = [(role, name) for role, workers in cluster.names.items() for name in workers]
    results = cluster.get([cluster.submit(name, "peak_memory") for _, name in names], timeout_s)
    out: dict[str, float] = {}
    by_pid = dict([process_peak()])
    for (role, _), (pid, gb) in zip(names, results, strict=True):
        out[f"memory/peak_gb/{role}"] = max(out.get(f"memory/peak_gb/{role}", 0.0), gb)
        by_pid[pid] = max(by_pid.get(pid, 0.0), gb)
    out["memory/peak_gb"] = sum(by_pid.values())
    return out
