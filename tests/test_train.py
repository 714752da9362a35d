"""The trainer: micro-batching changes nothing, the guard skips bad steps, the policy improves."""

import math
from dataclasses import replace

import pytest
import torch
from helpers import (
    VOCAB,
    assert_same_gradients,
    assert_same_logprobs,
    clone_model,
    grads,
    logprob_tolerance,
    random_samples,
    sample_logits,
    tiny_model,
    train_worker,
)

from tandem.model.logprobs import token_logprobs
from tandem.train.advantages import advantages
from tandem.train.batch import micro_batches, pad_rows, rank_micro_batches, shard
from tandem.train.optim import lr_factor
from tandem.train.worker import TrainWorker

AGGS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def worker(model, budget: int, **algo) -> TrainWorker:
    return train_worker(
        model, {"kl_coef": 0.1, "entropy_coef": 0.01, **algo}, dict(lr=1e-3, micro_batch_tokens=budget)
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
    assert_same_gradients(grads(split.model), grads(whole.model), model, samples)


def test_recomputed_logprobs_match_a_plain_forward():
    model = tiny_model()
    samples = random_samples(2, 3)
    logp = worker(model, budget=20).compute_logprobs(samples)
    for row, s in zip(logp, samples, strict=True):
        ids = torch.tensor(s.prompt_ids + s.response_ids)[None]
        logits = model(ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool))
        p = len(s.prompt_ids)
        expected = token_logprobs(logits[0, p - 1 : -1], ids[0, p:])
        assert_same_logprobs(row[: len(s.response_ids)], expected, model, [s])


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
    w = train_worker(model, train=dict(lr=3e-3, epochs=4, mini_batch_size=8))
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


def step_twin(model, samples, **train) -> tuple[TrainWorker, dict[str, float]]:
    w = train_worker(model, dict(entropy_coef=0.01), dict(lr=1e-3, **train))
    return w, w.train_step(samples)


def test_packed_micro_batches_give_the_padded_loss_and_gradients():
    model, samples = tiny_model(), random_samples(4, 4)
    padded, m_padded = step_twin(clone_model(model), samples, micro_batch_tokens=60, padding_free=False)
    packed, m_packed = step_twin(model, samples, micro_batch_tokens=60, padding_free=True)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "mismatch/kl"):
        assert m_packed[key] == pytest.approx(m_padded[key], rel=1e-5, abs=1e-7), key
    assert_same_gradients(grads(packed.model), grads(padded.model), model, samples)
    assert_same_logprobs(packed.compute_logprobs(samples), padded.compute_logprobs(samples), model, samples)


def test_a_packed_row_attends_only_within_each_sequence():
    model, samples = tiny_model(), random_samples(2, 3)
    together = train_worker(model).compute_logprobs(samples)
    for i, s in enumerate(samples):
        alone = train_worker(model).compute_logprobs([s])
        assert_same_logprobs(together[i, : len(s.response_ids)], alone[0, : len(s.response_ids)], model, [s])


def test_an_exactly_on_policy_step_skips_the_recompute_and_updates_the_same():
    model, samples = tiny_model(), random_samples(4, 4)
    skip = train_worker(model, dict(corrections=["tis"]), dict(lr=1e-3))
    again = train_worker(clone_model(model), dict(corrections=["tis"]), dict(lr=1e-3))
    again.version = 3  # the same weights, but the batch is three versions old: π_old is recomputed
    for s in samples:
        s.versions = [0] * len(s.response_ids)
    calls = []
    skip.compute_logprobs = lambda *a, **k: calls.append(1)  # must not be called
    m_skip, m_again = skip.train_step(samples), again.train_step(samples)
    assert calls == []
    assert (
        m_skip["actor/old_logprob_source/policy"] == 1.0 and m_skip["actor/old_logprob_source/recompute"] == 0
    )
    assert m_again["actor/old_logprob_source/recompute"] == 1.0
    for key in ("actor/pg_loss", "actor/grad_norm", "mismatch/kl", "mismatch/logprob_abs_diff_max"):
        assert m_skip[key] == pytest.approx(m_again[key], rel=1e-6, abs=1e-8), key
    # π_old as π_θ detached or recomputed by a no-grad forward of the same rows: the same kernels,
    # so bit-identical logprobs and steps (Adam's lr·g/|g| would amplify any rounding in a gradient
    # near 0). 1e-7, ~13 ulps of weights near 0.1, is far below the lr of 1e-3 a wrong ratio moves.
    for (name, a), (_, b) in zip(skip.named_weights(), again.named_weights(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    "train, algo",
    [(dict(epochs=2), {}), (dict(mini_batch_size=8), {}), ({}, dict(corrections=["mis"]))],
)
def test_more_than_one_update_or_a_masking_correction_recomputes(train, algo):
    w = train_worker(tiny_model(), algo, train)
    assert w.train_step(random_samples(4, 4))["actor/old_logprob_source/recompute"] == 1.0


def test_logprobs_in_chunks_equal_the_whole_and_so_do_their_gradients(monkeypatch):
    import tandem.model.logprobs as lp

    model, samples = tiny_model(), random_samples(4, 4)
    whole, m_whole = step_twin(clone_model(model), samples)
    monkeypatch.setattr(lp, "CHUNK_ELEMENTS", 3 * VOCAB)  # 3 tokens a chunk
    chunked, m_chunked = step_twin(model, samples)
    assert m_whole["actor/pg_loss"] == pytest.approx(m_chunked["actor/pg_loss"], rel=1e-6)
    assert_same_gradients(grads(chunked.model), grads(whole.model), model, samples)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
def test_token_scores_hand_written_backward_is_autograds(temperature, entropy_coef, dtype):
    """`TokenScores` (log_softmax, gather and entropy with one backward of its own) against autograd
    through the plain composition it replaced: the same logp and, for a loss without the entropy
    (or with it times 0), the same gradient bit for bit, so runs train as before; the entropy and
    its gradient to fp32 rounding."""
    from tandem.model.logprobs import TokenScores

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=gen, dtype=torch.float64).mul_(3).to(dtype)
    tokens = torch.randint(0, VOCAB, (6,), generator=gen)
    weights = torch.randn(6, generator=gen)

    def loss(logp, entropy):
        return (weights * logp).sum() + entropy_coef * entropy.sum()

    ours = logits.clone().requires_grad_()
    logp, entropy = TokenScores.apply(ours.view(6, VOCAB), tokens, temperature, False)  # a view, as
    loss(logp, entropy).backward()  # the batch-invariant linear's output is: never written in place
    assert torch.equal(ours.detach(), logits)
    ref = logits.clone().requires_grad_()  # the graph TokenScores replaced
    logp_all = torch.log_softmax(ref.float() / temperature, dim=-1)
    ref_logp = logp_all.gather(-1, tokens[:, None]).squeeze(-1)
    ref_entropy = -(logp_all.exp() * logp_all).sum(-1)
    loss(ref_logp, ref_entropy).backward()
    assert torch.equal(logp, token_logprobs(logits, tokens, temperature))
    torch.testing.assert_close(entropy, ref_entropy.detach(), rtol=1e-5, atol=1e-6)
    if entropy_coef == 0:
        assert torch.equal(ours.grad, ref.grad)
    else:
        torch.testing.assert_close(ours.grad.float(), ref.grad.float(), rtol=0.01, atol=1e-4)


def test_gradient_checkpointing_changes_nothing_but_memory():
    model, samples = tiny_model(), random_samples(4, 4)
    plain, m_plain = step_twin(clone_model(model), samples)
    ckpt, m_ckpt = step_twin(model, samples, gradient_checkpointing=True)
    assert m_plain["actor/pg_loss"] == pytest.approx(m_ckpt["actor/pg_loss"], rel=1e-6)
    for name, g in grads(plain.model).items():  # the same kernels recompute the same activations
        assert torch.equal(grads(ckpt.model)[name], g), name


def test_bf16_compute_keeps_fp32_master_weights_that_small_steps_move():
    """lr 1e-5 moves a weight of ~0.1 by less than half a bf16 step (2.4e-4) per update: a trainer
    that stepped bf16 weights directly would round every update away and never change them."""
    model, samples = tiny_model(), random_samples(4, 4)
    start = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    w_q = "model.layers.0.self_attn.q_proj.weight"
    # The premise: AdamW stepping bf16 weights at this lr leaves almost all of them as they were.
    direct = clone_model(model).to(torch.bfloat16)
    opt = torch.optim.AdamW(direct.parameters(), lr=1e-5, weight_decay=0.0)
    for _ in range(40):
        for p in direct.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    assert (dict(direct.named_parameters())[w_q] != start[w_q]).float().mean() < 0.1  # 0.04: only the tiniest

    w = train_worker(model, train=dict(lr=1e-5), dtype=torch.bfloat16)
    for _ in range(40):
        w.train_step(samples)
    weights = dict(w.named_weights())
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert all(s["exp_avg_sq"].dtype == torch.float32 for s in w.learner.optimizer.state.values())
    # What a push sends to a bf16 engine: the masters, rounded once. Many weights have moved.
    moved = (weights[w_q].to(torch.bfloat16) != start[w_q]).float().mean()
    assert moved > 0.5, float(moved)  # 0.80 here; stepping bf16 weights directly moves 0.04


def test_bf16_compute_learns_like_fp32():
    """The test above's trainer, at a normal lr: bf16 logprobs within bf16 rounding of fp32's."""
    model, samples = tiny_model(), random_samples(4, 4)
    fp32 = train_worker(model, train=dict(lr=3e-3, epochs=4, mini_batch_size=8))
    bf16 = train_worker(
        clone_model(model), train=dict(lr=3e-3, epochs=4, mini_batch_size=8), dtype=torch.bfloat16
    )
    # The bound of bf16 rounding at each of the model's matmuls (`logprob_tolerance`): ~0.3 here,
    # where they differ by ~0.015; a bf16 copy of other weights, or one missing a layer, by 1.5 or more.
    atol = logprob_tolerance(sample_logits(model, samples), model.cfg, torch.bfloat16)
    torch.testing.assert_close(
        bf16.compute_logprobs(samples), fp32.compute_logprobs(samples), atol=atol, rtol=0
    )
    good = [i for i, s in enumerate(samples) if s.reward > 0]
    before = fp32.compute_logprobs(samples).sum(-1)
    for _ in range(3):
        fp32.train_step(samples), bf16.train_step(samples)
    gain32 = (fp32.compute_logprobs(samples).sum(-1) - before)[good].mean()
    gain16 = (bf16.compute_logprobs(samples).sum(-1) - before)[good].mean()
    assert gain16 > 0.5 and gain16 == pytest.approx(float(gain32), rel=0.3)


def test_ranks_split_rows_evenly_and_run_as_many_micro_batches():
    assert [len(shard(5, r, 4)) for r in range(4)] == [2, 1, 1, 1]  # every rank gets a row
    lengths = [10, 10, 10, 10, 10, 10, 40, 40]  # rank 0: six short rows, rank 1: two long ones
    plans = [rank_micro_batches(lengths, 40, padded=False, rank=r, world=2) for r in range(2)]
    assert len(plans[0]) == len(plans[1])  # FSDP2's collectives need the same count everywhere
    assert sorted(i for p in plans for part in p for i in part) == list(range(8))
    assert [] in plans[0] or [] in plans[1]  # the shorter plan is padded with dummies


def test_an_episodes_extra_samples_take_its_advantage_and_leave_the_groups_baseline_alone():
    """rollout.agent=openai: an episode's extra samples (Sample.episode_of) train with the advantage
    of their episode; the GRPO baseline of the group is over its rollout.n episodes only."""
    samples = random_samples(2, 4, seed=3)
    for s, r in zip(samples, [1, 0, 0, 0, 1, 1, 0, 1], strict=True):
        s.reward = float(r)
    w = worker(tiny_model(), 64)
    width = max(len(s.response_ids) for s in samples)
    alone = advantages(samples, pad_rows([s.loss_mask for s in samples], width), w.algo).clone()
    extras = [replace(samples[i], index=(i % 4 + 1) << 16, episode_of=i % 4, response_ids=[5] * (i + 2),
                      logprobs=[-1.0] * (i + 2), versions=[0] * (i + 2), loss_mask=[1] * (i + 2))
              for i in (0, 0, 5)]  # fmt: skip
    rows = samples + extras
    width = max(len(s.response_ids) for s in rows)
    adv = advantages(rows, pad_rows([s.loss_mask for s in rows], width), w.algo)
    torch.testing.assert_close(adv[: len(samples), : alone.shape[1]], alone)  # the baseline is unchanged
    assert [x.advantage for x in extras] == pytest.approx([samples[0].advantage] * 2 + [samples[5].advantage])
    assert (
        samples[0].advantage > 0 and (adv[-1, : len(extras[-1].response_ids)] == samples[5].advantage).all()
    )
