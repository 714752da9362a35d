"""Data parallel training over torch.distributed (gloo): DDP and FSDP2 ranks give the one-worker result."""

from pathlib import Path

import pytest
import torch
from helpers import (
    clone_model,
    gradient_tolerance,
    grads,
    on_gloo_ranks,
    random_samples,
    tiny_config,
    tiny_model,
    train_worker,
)

from tandem.data.tokenizer import build_char_tokenizer
from tandem.model.checkpoint import load_model
from tandem.runtime.roles import save_hf_model
from tandem.train.worker import TrainWorker

pytestmark = pytest.mark.integration  # each test spawns a gloo process group

ALGO = {"kl_coef": 0.1, "entropy_coef": 0.01, "loss_agg": "seq-mean-token-mean", "corrections": ["tis"]}


def worker(model, strategy: str = "ddp", dtype: torch.dtype = torch.float32, **extra) -> TrainWorker:
    train = dict(lr=1e-3, micro_batch_tokens=40, mini_batch_size=8, strategy=strategy, **extra)
    return train_worker(model, ALGO, train, dtype=dtype)


def rank_step(strategy: str, out: str, dtype: torch.dtype, extra: dict | None = None) -> dict:
    """One rank's train step -> its metrics, full weights, local gradients and optimizer bytes."""
    w = worker(tiny_model(), strategy, dtype, **(extra or {}))
    w.parallelize(torch.distributed.group.WORLD)
    metrics = w.train_step(random_samples(4, 4))  # 16 samples, 2 mini-batches of 8: two steps
    save_hf_model(w, build_char_tokenizer(), Path(out) / "ckpt")  # every rank: fsdp2 gathers, rank 0 writes
    local = {
        n: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for n, p in w.model.named_parameters()
    }
    moments = w.learner.optimizer.state.values()
    state = [t for s in moments for t in s.values() if torch.is_tensor(t) and t.dim()]
    optimizer_bytes = sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in state)
    weights = w.full_weights()
    return {"metrics": metrics, "weights": weights, "grads": local, "optimizer_bytes": optimizer_bytes}


def record_steps(w: TrainWorker) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """Filled with (lr, {name: gradient}) at each of `w`'s optimizer steps, as AdamW sees them."""
    steps = []
    names = {p: n for n, p in w.model.named_parameters()}

    def hook(opt, args, kwargs) -> None:
        group = opt.param_groups[0]
        steps.append((group["lr"], {names[p]: p.grad.detach().clone() for p in group["params"]}))

    w.learner.optimizer.register_step_pre_hook(hook)
    return steps


def adam_tolerance(
    steps: list, name: str, delta: float, betas=(0.9, 0.999), eps: float = 1e-8
) -> torch.Tensor:
    """Per element of weight `name`: how far two AdamW runs over `steps` (`record_steps`) may end
    apart when their gradients differ by at most `delta` at each step (`gradient_tolerance`).

    Step s moves a weight by lr·u, u = m̂/(√v̂ + ε): m̂ (bias-corrected) is a convex combination of
    the gradients so far and √v̂ their weighted RMS, so each moves by at most δ, and to first order
    |Δu| <= δ·(1 + |u|)/(√v̂ + ε - δ). Where √v̂ + ε <= 2δ the gradient is within rounding of 0 and
    Adam's normalisation can turn it to either sign: |Δu| <= 2·max|u|, max|u| = sqrt(Σ a_r²/b_r)
    for m̂'s weights a_r and v̂'s b_r (Cauchy-Schwarz; ~1 at these betas). Summed over the steps,
    times lr (the weights' own rounding, an ulp a step, is the caller's). It assumes the steps
    before moved the weights apart by rounding only: true but for the few elements capped.
    """
    b1, b2 = betas
    m = v = torch.zeros_like(steps[0][1][name], dtype=torch.float64)
    tol = torch.zeros_like(m)
    for s, (lr, g) in enumerate(steps, 1):
        g = g[name].double()
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        rms = (v / (1 - b2**s)).sqrt() + eps
        u = m / (1 - b1**s) / rms
        a = [(1 - b1) * b1 ** (s - r) / (1 - b1**s) for r in range(1, s + 1)]
        b = [(1 - b2) * b2 ** (s - r) / (1 - b2**s) for r in range(1, s + 1)]
        most = sum(x * x / y for x, y in zip(a, b, strict=True)) ** 0.5
        first = delta * (1 + u.abs()) / (rms - delta)
        tol += lr * torch.where(rms > 2 * delta, first.clamp(max=2 * most), torch.full_like(u, 2 * most))
    return tol


OFFLOAD = {"offload": "optimizer", "gradient_checkpointing": True}


@pytest.mark.parametrize(
    "strategy, world, extra", [("ddp", 2, {}), ("fsdp2", 2, {}), ("fsdp2", 1, {}), ("fsdp2", 2, OFFLOAD)]
)
def test_data_parallel_ranks_equal_one_worker(tmp_path, strategy, world, extra):
    """fsdp2 with CPU offload and per-layer checkpointing too (on a CPU the offload moves nothing,
    but the policy's path runs)."""
    ranks = on_gloo_ranks(world, rank_step, strategy, str(tmp_path), torch.float32, extra)
    single = worker(clone_model(tiny_model()))
    steps, samples = record_steps(single), random_samples(4, 4)
    m_single = single.train_step(samples)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    for r in ranks:
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
            assert r["metrics"][key] == pytest.approx(m_single[key], rel=1e-5, abs=1e-7), key
        for name, value in dict(single.named_weights()).items():
            # The ranks' gradients are the one worker's up to rounding; AdamW amplifies it where a
            # gradient is small (~1e-6 of a step of ~1e-3 for most weights, a whole step for a few).
            # A rank stepping on its own half's samples puts most elements past it, by up to 4e-3.
            delta = max(gradient_tolerance(g[name], tiny_config(), tokens) for _, g in steps)
            ulps = len(steps) * torch.finfo(torch.float32).eps * value.abs()
            bound = adam_tolerance(steps, name, delta) + ulps
            assert ((r["weights"][name] - value).abs() <= bound).all(), name
    saved = dict(load_model(tmp_path / "ckpt").named_parameters())  # the same HF directory as one worker's
    assert all(torch.equal(saved[n], t) for n, t in ranks[0]["weights"].items())
    if strategy == "ddp" and world == 2:  # the replicas step with the same averaged gradient
        for name in ranks[0]["grads"]:
            assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name])
    if strategy == "fsdp2" and world == 2:  # each rank holds half of every gradient and of AdamW's state
        full = sum(g.numel() for g in grads(single.model).values())
        assert sum(g.numel() for g in ranks[0]["grads"].values()) <= full / 2 + 64
        assert ranks[0]["optimizer_bytes"] + ranks[1]["optimizer_bytes"] == 2 * full * 4


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_bf16_ranks_equal_one_bf16_worker_to_bf16_rounding(tmp_path, strategy):
    """bf16 compute, fp32 masters and fp32 reduction: DDP's fp32 hook averages (a plain sum would
    double the gradient norm), FSDP2's policy reduces in fp32."""
    ranks = on_gloo_ranks(2, rank_step, strategy, str(tmp_path), torch.bfloat16)
    m_single = worker(tiny_model(), dtype=torch.bfloat16).train_step(random_samples(4, 4))
    for r in ranks:
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert r["metrics"][key] == pytest.approx(m_single[key], rel=2e-2, abs=1e-4), key
        assert all(w.dtype == torch.float32 for w in r["weights"].values())
