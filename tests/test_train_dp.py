"""Data parallel training over torch.distributed (gloo): DDP and FSDP2 ranks give the one-worker result."""

from pathlib import Path

import pytest
import torch
from helpers import clone_model, grads, on_gloo_ranks, random_samples, tiny_model, train_worker

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


OFFLOAD = {"offload": "optimizer", "gradient_checkpointing": True}


@pytest.mark.parametrize(
    "strategy, world, extra", [("ddp", 2, {}), ("fsdp2", 2, {}), ("fsdp2", 1, {}), ("fsdp2", 2, OFFLOAD)]
)
def test_data_parallel_ranks_equal_one_worker(tmp_path, strategy, world, extra):
    """fsdp2 with CPU offload and per-layer checkpointing too (on a CPU the offload moves nothing,
    but the policy's path runs)."""
    ranks = on_gloo_ranks(world, rank_step, strategy, str(tmp_path), torch.float32, extra)
    single = worker(clone_model(tiny_model()))
    m_single = single.train_step(random_samples(4, 4))
    for r in ranks:
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
            assert r["metrics"][key] == pytest.approx(m_single[key], rel=1e-5, abs=1e-7), key
        for name, value in dict(single.named_weights()).items():
            # Adam turns float noise in near-zero gradients into ~1e-6 steps; one step moves ~1e-3.
            torch.testing.assert_close(r["weights"][name], value, rtol=1e-4, atol=2e-5)
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
