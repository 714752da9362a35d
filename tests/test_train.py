"""The trainer: micro-batching changes nothing, the guard skips bad steps, the policy improves."""

import math

import pytest
import torch
from helpers import VOCAB, clone_model, grads, random_samples, tiny_model

from tandem.config import AlgoConfig, TrainConfig
from tandem.model import token_logprobs
from tandem.train import TrainWorker
from tandem.train.batch import micro_batches
from tandem.train.optim import lr_factor

AGGS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def worker(model, budget: int, **algo) -> TrainWorker:
    algo = {"kl_coef": 0.1, "entropy_coef": 0.01, **algo}
    return TrainWorker(
        model, AlgoConfig(**algo), TrainConfig(lr=1e-3, micro_batch_tokens=budget), pad_token_id=0
    )


@pytest.mark.parametrize("agg", AGGS)
def test_micro_batches_give_the_single_batch_loss_and_gradients(agg):
    model = tiny_model()
    samples = random_samples(4, 4)
    whole = worker(model, budget=10_000, loss_agg=agg)
    split = worker(clone_model(model), budget=24, loss_agg=agg)
    assert len(micro_batches([len(s.prompt_ids) + len(s.response_ids) for s in samples], 24)) > 4
    m_whole, m_split = whole.train_step(samples), split.train_step(samples)
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac", "actor/grad_norm"):
        assert m_whole[key] == pytest.approx(m_split[key], rel=1e-5, abs=1e-7), key
    g_whole, g_split = grads(whole.model), grads(split.model)
    assert g_whole.keys() == g_split.keys() and g_whole
    for name in g_whole:
        torch.testing.assert_close(g_split[name], g_whole[name], rtol=1e-4, atol=1e-7)


def test_recomputed_logprobs_match_a_plain_forward():
    model = tiny_model()
    samples = random_samples(2, 3)
    logp = worker(model, budget=20).compute_logprobs(samples)
    for row, s in zip(logp, samples, strict=True):
        ids = torch.tensor(s.prompt_ids + s.response_ids)[None]
        logits = model(ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool))
        p = len(s.prompt_ids)
        expected = token_logprobs(logits[0, p - 1 : -1], ids[0, p:])
        torch.testing.assert_close(row[: len(s.response_ids)], expected, atol=1e-5, rtol=0)


def test_non_finite_gradient_skips_the_step_and_counts_it():
    model = tiny_model()
    w = worker(model, budget=10_000, kl_coef=0.0, entropy_coef=0.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    samples = random_samples(2, 4)
    samples[0].reward = math.inf  # an infinite reward makes the advantages, so the gradient, non-finite
    metrics = w.train_step(samples)
    assert metrics["actor/skipped_steps"] == 1.0
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    samples[0].reward = 1.0
    assert w.train_step(samples)["actor/skipped_steps"] == 1.0  # a finite step goes through again
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_policy_gradient_raises_the_logprob_of_rewarded_responses():
    model = tiny_model()
    samples = random_samples(4, 4, seed=3)
    w = TrainWorker(model, AlgoConfig(), TrainConfig(lr=3e-3, epochs=4, mini_batch_size=8), pad_token_id=0)
    good = [i for i, s in enumerate(samples) if s.reward > 0]
    bad = [i for i, s in enumerate(samples) if s.reward == 0]
    before = w.compute_logprobs(samples).sum(-1)
    for _ in range(3):
        w.train_step(samples)
    delta = w.compute_logprobs(samples).sum(-1) - before
    assert delta[good].mean() > 0.5 and delta[bad].mean() < -0.5


def test_lr_schedule_warms_up_then_decays():
    assert lr_factor(0, 4, 20, "cosine", 0.1) == pytest.approx(0.25)
    assert lr_factor(3, 4, 20, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_factor(20, 4, 20, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(12, 4, 20, "linear", 0.0) == pytest.approx(0.5)
    assert lr_factor(100, 0, 20, "constant", 0.0) == 1.0


def test_micro_batches_respect_the_budget():
    groups = micro_batches([5, 9, 3, 20, 4, 4], token_budget=18)
    assert sorted(i for g in groups for i in g) == list(range(6))  # every row exactly once
    assert groups == [[2, 4, 5], [0, 1], [3]]  # shortest first: similar lengths pad little
    lengths = [5, 9, 3, 20, 4, 4]
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 18
    assert VOCAB > 3
