"""Builders shared by tests: a tiny random model, samples with made-up responses, engine calls,
train workers, gloo process groups and tiny runs on Ray."""

import errno
import json
import random
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from tandem.config import AlgoConfig, TrainConfig
from tandem.model.config import ModelConfig
from tandem.model.decoder import CausalLM, init_weights
from tandem.model.kv_cache import KVCache
from tandem.model.logprobs import token_logprobs
from tandem.rollout.group import make_groups
from tandem.sample import Prompt, Sample, Status
from tandem.sync.dist import destroy_world, free_port, init_world
from tandem.train.worker import TrainWorker

VOCAB = 50


def tiny_config(vocab_size: int = VOCAB, max_positions: int = 64, **ids) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=max_positions,
        **ids,
    )


class Scripted(CausalLM):
    """A tiny random decoder (`tiny_config`) that writes what it is told: `script` maps a position to
    the token ids from there on. The logits at position p get +18 on the token scripted for p + 1
    (random logits are near 0, so greedy picks it, with a logprob near -4e-6, still below 0 in
    fp32; at temperature 1 a token leaves the script with that chance, a run of 40 tokens about
    once in 6,000, where +12 left one in ~17); elsewhere, random."""

    def __init__(self, tokenizer, script: dict[int, list[int]], max_positions: int = 1024, seed: int = 0):
        ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        super().__init__(tiny_config(len(tokenizer), max_positions, **ids))
        init_weights(self, seed)
        self.forced = torch.full((max_positions + 2,), -1, dtype=torch.long)
        for start, scripted in script.items():
            self.forced[start : start + len(scripted)] = torch.tensor(scripted)

    def forward(self, input_ids, positions, token_mask, cache=None, targets=None, logits_at=None):
        out = super().forward(input_ids, positions, token_mask, cache, targets, logits_at)
        if targets is not None:
            return out
        if logits_at is not None:  # the logits of one column a row: (B, 1, V)
            positions = positions.gather(1, logits_at[:, None])
        nxt = self.forced[(positions + 1).clamp(max=len(self.forced) - 1)]  # (B, T)
        return out.scatter_add(-1, nxt.clamp(min=0)[..., None], (nxt >= 0).float()[..., None] * 18.0)


def tiny_model(seed: int = 0, std: float = 0.1) -> CausalLM:
    model = CausalLM(tiny_config())
    init_weights(model, seed, std=std)
    return model


def random_samples(n_groups: int, group_size: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for g in range(n_groups):
        prompt_ids = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 7))]
        for i in range(group_size):
            n = rng.randint(1, 9)
            samples.append(
                Sample(
                    prompt=Prompt(text="x"),
                    prompt_ids=prompt_ids,
                    group_id=g,
                    index=i,
                    response_ids=[rng.randrange(3, VOCAB) for _ in range(n)],
                    logprobs=[-rng.random() for _ in range(n)],
                    versions=[0] * n,
                    loss_mask=[1] * n,
                    reward=float(rng.random() < 0.5),
                    status=Status.FINISHED,
                    finish_reason="stop",
                )
            )
    return samples


def clone_model(model: CausalLM) -> CausalLM:
    twin = CausalLM(model.cfg)
    twin.load_state_dict(model.state_dict())
    return twin


def grads(model: CausalLM) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def write_tiny_checkpoint(path, max_positions: int = 64, seed: int = 0):
    """A tiny random Qwen2-shaped checkpoint with tandem's byte-level tokenizer, as `tandem sft` writes."""
    from tandem.data.tokenizer import build_char_tokenizer
    from tandem.model.checkpoint import save_model

    tokenizer = build_char_tokenizer()
    cfg = tiny_config(
        len(tokenizer),
        max_positions,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = CausalLM(cfg)
    init_weights(model, seed)
    save_model(model, path)
    tokenizer.save_pretrained(str(path))
    return path


# ---------------------------------------------------------------- tolerances between kernels
#
# Two kernels computing the same thing (a fused and an unfused projection, a KV-cached decode and a
# full forward, packed and padded rows, an engine and the trainer, tandem and transformers) sum in
# other orders, on other tilings, and differ by rounding: by how much depends on the CPU's BLAS, not
# on the code under test. These bounds follow from the rounding of the operations, so a test using
# them passes on any CPU (and fails on a bug, which moves results by far more).


def matmul_tolerance(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x (..., K), w (N, K) -> (..., N): the most two kernels' `x @ w.T` may differ by, elementwise.

    Each sums the K products in its own order, in float32 (CPUs and GPUs accumulate bf16 in fp32
    too), so each lies within γ_K·Σ_k|x_k w_nk| ≈ K·u·(|x| @ |w|ᵀ) of the exact value (u = eps/2,
    Higham's bound for a recursive sum) and the two within K·eps32·(|x| @ |w|ᵀ); a result rounded to
    `dtype` adds eps_dtype of the same magnitudes (half for each kernel).
    """
    magnitude = x.abs().float() @ w.abs().float().T
    return (x.shape[-1] * torch.finfo(torch.float32).eps + torch.finfo(dtype).eps) * magnitude


def chain_tolerance(out: torch.Tensor, k: int, matmuls: int, dtype: torch.dtype = torch.float32) -> float:
    """The most two kernels may differ by on `out` (an atol), the end of a chain of `matmuls` matmuls
    with contractions of at most `k`, computed in `dtype`.

    Each matmul moves its output by K·eps32 + eps_dtype of the magnitudes it sums (`matmul_tolerance`).
    RMSNorm rescales each layer's input, so relative errors do not grow with depth but add along the
    chain; taking max|out| for the magnitudes:

        matmuls · (K·eps32 + eps_dtype) · max|out|

    The factor K is the worst order of K rounding errors; in practice they add like a random walk
    (√K), which leaves room for layers that amplify a little (random weights of std 0.1-0.3).
    """
    per_matmul = k * torch.finfo(torch.float32).eps + torch.finfo(dtype).eps
    return matmuls * per_matmul * float(out.detach().abs().max())


def longest_sum(cfg: ModelConfig) -> int:
    """K: the longest contraction of the model's forward (hidden, MLP, expert or attention width)."""
    attention = cfg.num_attention_heads * cfg.head_dim
    return max(cfg.hidden_size, cfg.intermediate_size, cfg.moe_intermediate_size, attention)


def logit_tolerance(logits: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> float:
    """The most two kernels may differ by on one model's `logits` computed in `dtype` (an atol): each
    logit ends a chain of 4·L + 1 matmuls (per layer q|k|v, o, gate|up, down; then the LM head) of
    contractions up to `longest_sum` (`chain_tolerance`)."""
    return chain_tolerance(logits, longest_sum(cfg), 4 * cfg.num_hidden_layers + 1, dtype)


def logprob_tolerance(
    logits: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype = torch.float32, temperature: float = 1.0
) -> float:
    """The most two kernels may differ by on logprobs from `logits` (an atol): log_softmax(z/T)_t =
    z_t/T - logsumexp(z/T) moves by at most 2·δ/T when every logit moves by at most δ
    (`logit_tolerance`)."""
    return 2 * logit_tolerance(logits, cfg, dtype) / temperature


def gradient_tolerance(
    grad: torch.Tensor, cfg: ModelConfig, tokens: int, dtype: torch.dtype = torch.float32
) -> float:
    """The most two kernels may differ by on one weight's gradient `grad` of a loss over `tokens`
    tokens (an atol): one batch or micro-batches, packed or padded rows, logprobs whole or in chunks.

    The backward runs the forward's chain of 4·L + 1 matmuls in reverse (`logit_tolerance`),
    contracting over the vocabulary too (from the logits back), and a weight's gradient sums its
    contributions over the tokens: `chain_tolerance` with K = max(`longest_sum`, V) + tokens. The
    contributions of tokens whose advantages differ in sign cancel; the worst-case factor K (against
    a random walk's √K) leaves room for it.
    """
    k = max(longest_sum(cfg), cfg.vocab_size) + tokens
    return chain_tolerance(grad, k, 4 * cfg.num_hidden_layers + 1, dtype)


@torch.no_grad()
def sample_logits(model: CausalLM, samples: list[Sample]) -> torch.Tensor:
    """(N, V): the logits of every position of every sample's prompt + response, one forward each."""
    rows = []
    for s in samples:
        ids = torch.tensor(list(s.prompt_ids) + list(s.response_ids))[None]
        positions = torch.arange(ids.shape[1])[None]
        rows.append(model(ids, positions, torch.ones_like(ids, dtype=torch.bool))[0].float())
    return torch.cat(rows)


def assert_same_logits(got: torch.Tensor, expected: torch.Tensor, model: CausalLM) -> None:
    """Two kernels' fp32 logits of one model (tandem and transformers, a cached decode and a full
    forward, fused and plain projections, other batch groupings): within `logit_tolerance`, ~1e-4
    at logits of ~1. A missing bias or norm, a wrong RoPE, a stale cache entry or another expert
    moves them by 1e-2 or more."""
    torch.testing.assert_close(got, expected, atol=logit_tolerance(expected, model.cfg), rtol=0)


def assert_same_gradients(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], model: CausalLM, samples: list[Sample]
) -> None:
    """Two kernels' fp32 gradients of one loss over `samples` (other micro-batches, packings or
    chunks sum in other orders): each weight's within `gradient_tolerance`, ~2e-4 of its largest
    element for the tiny model. Leaving two samples of sixteen out moves each by 1e-1 of it or more."""
    assert got.keys() == expected.keys() and got
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    for name, g in expected.items():
        atol = gradient_tolerance(g, model.cfg, tokens)
        torch.testing.assert_close(got[name], g, atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def assert_same_logprobs(
    actual: list[float] | torch.Tensor,
    expected: torch.Tensor,
    model: CausalLM,
    samples: list[Sample],
    temperature: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Two kernels' logprobs of `samples` under `model` in `dtype` (an engine and the trainer, a
    cached decode and a full forward, one batch and another): within `logprob_tolerance` of the
    samples' logits. Attention across sequences, a stale cache entry or another weight version moves
    them by 1e-1 or more."""
    atol = logprob_tolerance(sample_logits(model, samples), model.cfg, dtype, temperature)
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32), expected, atol=atol, rtol=0)


# ---------------------------------------------------------------- trainers


def train_worker(
    model: CausalLM | None = None, algo: dict | None = None, train: dict | None = None, **options: Any
) -> TrainWorker:
    """A TrainWorker with pad id 0 on `model` (a fresh tiny_model() if None). `algo` and `train` hold
    AlgoConfig and TrainConfig fields, `options` the worker's own (dtype, total_updates, ...). Every
    test builds its trainer here, so a change to the constructor is made in one place."""
    model = tiny_model() if model is None else model
    algo_cfg, train_cfg = AlgoConfig(**(algo or {})), TrainConfig(**(train or {}))
    return TrainWorker(model, algo_cfg, train_cfg, pad_token_id=0, **options)


# ---------------------------------------------------------------- engines

EOS = 2  # the tiny vocabulary's end of sequence: 0 pads, ids from 3 up are text


def prompts(n: int, seed: int = 0, low: int = 3, high: int = VOCAB, longest: int = 8) -> list[list[int]]:
    """n prompts of 2 to `longest` token ids, each id in [low, high)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(2, longest + 1, (1,), generator=g))
        out.append(torch.randint(low, high, (k,), generator=g).tolist())
    return out


def run(
    engine: Any, ids: list[list[int]], params: Any, n: int = 1, seeds: list[int | None] | None = None
) -> list[Sample]:
    """One generate call: a group of `n` samples for each prompt of `ids`, seeded from `seeds`
    (one per sample; None: the engine's shared generator)."""
    samples = make_groups([Prompt(text="p")] * len(ids), ids, n)
    for s, seed in zip(samples, seeds or [None] * len(samples), strict=True):
        s.seed = seed
    return engine.generate(samples, params)


def at_step(j: int, action: Callable[[], object]) -> Callable[[int], None]:
    """An on_step hook that runs `action()` once, after the batch's j-th decode step."""

    def hook(step: int) -> None:
        if step == j:
            action()

    return hook


def assert_aligned(s: Sample) -> None:
    n = len(s.response_ids)
    assert len(s.logprobs) == len(s.versions) == len(s.loss_mask) == n and s.loss_mask == [1] * n


def partial(s: Sample, j: int) -> Sample:
    """A copy of sample `s` cut after its first j tokens, as an aborted call would return it."""
    return Sample(
        prompt=s.prompt,
        prompt_ids=list(s.prompt_ids),
        group_id=s.group_id,
        index=s.index,
        response_ids=s.response_ids[:j],
        logprobs=s.logprobs[:j],
        versions=s.versions[:j],
        loss_mask=s.loss_mask[:j],
        status=Status.ABORTED,
        finish_reason="abort",
    )


def full_forward_logprobs(
    model: CausalLM, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """(len(response_ids),): each response token's logprob by one forward of the whole sequence."""
    ids = torch.tensor(prompt_ids + response_ids)[None]
    logits = model(ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool))
    p = len(prompt_ids)
    return token_logprobs(logits[0, p - 1 : -1], ids[0, p:], temperature)


def stepwise_logprobs(
    model: CausalLM, new_weights: CausalLM, prompt_ids: list[int], response_ids: list[int], swap_after: int
) -> tuple[list[int], torch.Tensor]:
    """Reference for the "continue" policy: decode response_ids one token at a time with a cache,
    loading `new_weights` after the first `swap_after` tokens were sampled -> greedy tokens and
    logprobs the loop would produce. Keys already cached stay as the old weights computed them."""
    model = clone_model(model)
    cache = KVCache(model.cfg, 1, len(prompt_ids) + len(response_ids), torch.float32, torch.device("cpu"))
    ids = torch.tensor(prompt_ids)[None]
    logits = model(ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool), cache)
    tokens, logprobs = [], []
    for i, token in enumerate(response_ids):
        logp = torch.log_softmax(logits[0, -1], -1)
        tokens.append(int(logp.argmax()))
        logprobs.append(float(logp[token]))
        if i + 1 == swap_after:
            model.load_state_dict(new_weights.state_dict())
        pos = torch.tensor([[len(prompt_ids) + i]])
        logits = model(torch.tensor([[token]]), pos, torch.ones(1, 1, dtype=torch.bool), cache)
    return tokens, torch.tensor(logprobs)


@contextmanager
def from_another_thread(engine: Any, step: int, action: Callable[[], object]) -> Iterator[None]:
    """Within the block, the engine's call halts after its `step`-th decode step while another thread
    runs `action()`, then goes on: a call from another thread at a known point of the decode."""
    reached, released = threading.Event(), threading.Event()

    def hook(j: int) -> None:
        if j == step:
            reached.set()
            assert released.wait(timeout=30)  # a safety net for a broken test, never a delay

    def other_thread() -> None:
        assert reached.wait(timeout=30)
        action()
        released.set()

    engine.on_step = hook
    helper = threading.Thread(target=other_thread)
    helper.start()
    try:
        yield
    finally:
        helper.join()
        engine.on_step = None


# ---------------------------------------------------------------- torch.distributed


def on_gloo_ranks(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """fn(*args) in each of `world` spawned processes joined in one gloo group (torch.distributed's
    WORLD) -> what each rank returned, by rank. `fn` must be a module-level function of a test file:
    the ranks import it by name."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_gloo_rank, args=(world, free_port(), out, fn, args), nprocs=world, join=True)
        return [torch.load(f"{out}/{rank}.pt", weights_only=False) for rank in range(world)]


def _gloo_rank(rank: int, world: int, port: int, out: str, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)  # two ranks share the machine's cores
    init_world(rank, world, "127.0.0.1", port, backend="gloo", timeout_s=60)
    torch.save(fn(*args), f"{out}/{rank}.pt")
    destroy_world()


# ---------------------------------------------------------------- runs on Ray

TINY = [  # 4 steps of 4 groups of 4 from the warm start, validating every 2
    "run.progress=false",
    "run.steps=4",
    "run.val_every=2",
    "rollout.batch_size=4",
    "rollout.n=4",
    "data.val_size=16",
    "data.train_size=200",
    "reward.num_workers=1",
    "run.timeout_s=120",
]


def train(out: Path, *overrides: str, on_step: Callable | None = None) -> tuple[dict, list[dict], list[dict]]:
    """A TINY run with `overrides` under `out` (run.out_dir), on the local Ray -> (its summary, each
    train step's metrics, each validation's)."""
    from tandem.runtime.run import run_training  # here, not above: it imports Ray, unit tests need not
    from tandem.runtime.startup import load_config

    cfg = load_config(None, [*TINY, f"run.out_dir={out}", *overrides])
    summary = run_training(cfg, on_step=on_step)
    rows = records(Path(out) / cfg.run.name)
    return summary, [r for r in rows if "critic/score/mean" in r], [r for r in rows if "val/accuracy" in r]


def records(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    """The records of one of a run's JSON-lines files."""
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def nothing_may_start(monkeypatch, error: Exception) -> None:
    """Starting Ray (a run on Ray) or the workers (a run in one process) raises `error`: for checks
    that a run refuses its input before anything starts."""

    def start(*args, **kwargs):
        raise error

    monkeypatch.setattr("tandem.runtime.cluster.start_ray", start)
    monkeypatch.setattr("tandem.runtime.local.LocalCluster.start", start)


class Crash(BaseException):
    """An error that is neither an `Exception` nor a stop request, as torch's `CheckpointException` is."""


def raising(error: BaseException) -> Callable[..., Any]:
    """A stand-in for a function or method: raises `error`, whatever it is given."""

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        raise error

    return stand_in


def full_disk(*args, **kwargs) -> None:
    """`torch.distributed.checkpoint.save` on a full disk: the OSError inside DCP's
    `CheckpointException` (a BaseException), as a failed save raises it."""
    from torch.distributed.checkpoint.api import CheckpointException

    raise CheckpointException("save", {0: (OSError(errno.ENOSPC, "No space left on device"), None)})


def local_ray():
    """Ray for the tests on it, started here if it is not running (4 logical CPUs, so split
    placements fit on 2 cores; the tests' directory on the workers' path, for actor classes defined
    in a test module): an instance of its own (address "local"), never a cluster that `ray start`
    recorded on this machine. A module may have stopped the session's Ray (test_cluster.py's
    two-node cluster does): the next test to ask starts it again. -> the ray module."""
    import os

    import ray

    if not ray.is_initialized():
        tests = os.path.dirname(os.path.abspath(__file__))
        env = {"PYTHONPATH": os.pathsep.join([tests, os.getcwd()])}
        ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            logging_level="WARNING",
            runtime_env={"env_vars": env},
        )
    return ray


def vllm_checkpoint(path: Path) -> Path:
    """A tiny checkpoint vLLM's CPU build can serve, with the built-in tokenizer beside it (vLLM
    loads it from the checkpoint): head_dim 32, the smallest head its CPU attention kernels take
    (8 is refused); std 0.3 for decisive logits (greedy ties would make comparisons flaky)."""
    from dataclasses import replace

    from tandem.data.tokenizer import build_char_tokenizer
    from tandem.model.checkpoint import save_model

    tokenizer = build_char_tokenizer()
    cfg = tiny_config(len(tokenizer), 64, eos_token_id=3, pad_token_id=0)  # <|im_end|>, <|pad|>
    model = CausalLM(replace(cfg, hidden_size=128, head_dim=32))
    init_weights(model, 0, std=0.3)
    save_model(model, path)
    tokenizer.save_pretrained(str(path))
    return path
