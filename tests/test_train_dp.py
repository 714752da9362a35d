"""Data parallel training over torch.distributed (gloo): two ranks give the one-worker result."""

import pytest
import torch
import torch.multiprocessing as mp
from helpers import clone_model, grads, random_samples, tiny_model

from tandem.config import AlgoConfig, TrainConfig
from tandem.sync import free_port, init_world
from tandem.train import TrainWorker

ALGO = {"kl_coef": 0.1, "entropy_coef": 0.01, "loss_agg": "seq-mean-token-mean", "corrections": ["tis"]}


def worker(model) -> TrainWorker:
    train = TrainConfig(lr=1e-3, micro_batch_tokens=40, mini_batch_size=8)
    return TrainWorker(model, AlgoConfig(**ALGO), train, pad_token_id=0)


def _rank(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    init_world(rank, world, "127.0.0.1", port, backend="gloo", timeout_s=60)
    w = worker(tiny_model())
    w.parallelize(torch.distributed.group.WORLD)
    metrics = w.train_step(random_samples(4, 4))  # 16 samples, 2 mini-batches of 8: two steps
    torch.save(
        {"metrics": metrics, "weights": dict(w.named_weights()), "grads": grads(w.model)}, f"{out}/{rank}.pt"
    )
    torch.distributed.destroy_process_group()


def test_two_data_parallel_ranks_equal_one_worker(tmp_path):
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    single = worker(clone_model(tiny_model()))
    m_single = single.train_step(random_samples(4, 4))
    ranks = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2)]
    for r in ranks:
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
            assert r["metrics"][key] == pytest.approx(m_single[key], rel=1e-5, abs=1e-7), key
        for name, value in dict(single.named_weights()).items():
            # Adam turns float noise in near-zero gradients into ~1e-6 steps; one step moves ~1e-3.
            torch.testing.assert_close(r["weights"][name], value, rtol=1e-4, atol=2e-5)
    for name in ranks[0]["grads"]:  # the ranks step with the same summed gradient
        assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name])
