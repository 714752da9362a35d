"""A mini-batch that carries no learning signal (every advantage 0: each group's responses scored
alike, and no KL or entropy term) is not trained on: its forwards run for the metrics, but no
backward and no optimizer step (the weights stay as they are, where AdamW would still move them by
its momentum), counted in actor/no_signal_fraction. A real instruct model at a high temperature
sees many such steps."""

import copy

import pytest
import torch
from helpers import assert_same_gradients, grads, random_samples, train_worker

TRAIN = dict(lr=1e-2, micro_batch_tokens=60)


def uniform(samples, by_group: bool = True):
    """Every response of a group scored alike (group g: g % 2), so every advantage is 0."""
    for s in samples:
        s.reward = float(s.group_id % 2) if by_group else 1.0
    return samples


def weights(worker):
    return {n: t.clone() for n, t in worker.named_weights()}


def test_a_batch_of_zero_advantages_is_skipped_and_leaves_the_weights_exactly():
    w = train_worker(train=TRAIN)
    w.train_step(random_samples(4, 4, seed=0))  # Adam has momentum now: a zero-gradient step would move
    before = weights(w)
    backwards, steps = [], []
    original, step = torch.Tensor.backward, w.learner.step
    w.learner.step = lambda: steps.append(1) or step()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "backward", lambda t, *a, **k: backwards.append(1) or original(t, *a, **k))
        m = w.train_step(uniform(random_samples(4, 4, seed=1)))
    assert backwards == [] and steps == [] and m["actor/no_signal_fraction"] == 1.0
    assert m["critic/advantages/max"] == 0.0 == m["critic/advantages/min"]
    assert "mismatch/kl" in m and "actor/entropy" in m  # the forwards ran: the metrics are all there
    assert all(torch.equal(t, before[n]) for n, t in w.named_weights())
    m = w.train_step(random_samples(4, 4, seed=2))
    assert m["actor/no_signal_fraction"] == 0.0 and steps == [1]
    assert any(not torch.equal(t, before[n]) for n, t in w.named_weights())


def test_the_steps_around_a_skipped_batch_are_those_of_a_run_without_it():
    """Skipping is exact: the next step's weights equal those of a trainer that never saw the batch."""
    skipped, plain = train_worker(train=TRAIN), train_worker(train=TRAIN)
    for w in (skipped, plain):
        w.train_step(random_samples(4, 4, seed=0))
    skipped.train_step(uniform(random_samples(4, 4, seed=1)))
    for w in (skipped, plain):
        w.train_step(random_samples(4, 4, seed=2))
    for (n, a), (_, b) in zip(skipped.named_weights(), plain.named_weights(), strict=True):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("algo", [dict(entropy_coef=0.01), dict(kl_coef=0.1)], ids=["entropy", "kl"])
def test_a_loss_with_another_term_still_steps(algo):
    """An entropy bonus or a KL penalty has a gradient whatever the advantages: the step is taken."""
    w = train_worker(algo=algo, train=TRAIN)
    w.train_step(random_samples(4, 4, seed=0))  # away from the reference: the KL term has a gradient
    before = weights(w)
    m = w.train_step(uniform(copy.deepcopy(random_samples(4, 4, seed=1)), by_group=False))
    assert m["actor/no_signal_fraction"] == 0.0
    assert any(not torch.equal(t, before[n]) for n, t in w.named_weights())


def half_uniform(samples):
    """Groups 0 and 2 scored alike (advantages 0), groups 1 and 3 mixed."""
    for s in samples:
        s.reward = 1.0 if s.group_id % 2 == 0 else float(s.index % 2)
    return samples


def test_rows_without_signal_skip_their_backward_and_the_gradient_is_the_same():
    """Within a mini-batch, the rows of groups scored alike add exact zeros to the gradient: only
    the other rows run a backward (half of them here), and the step's gradient equals that of a
    backward over every row within the tolerance of summing micro-batches in another order."""
    skipping, plain = train_worker(train=TRAIN), train_worker(train=TRAIN)
    plain._silent = lambda b: set()  # every row through the backward, as before the skip
    seen = []
    accumulate = skipping.learner.accumulate

    def recorded(samples, micro_loss, backward=True):
        seen.append((len(samples), backward))
        return accumulate(samples, micro_loss, backward)

    skipping.learner.accumulate = recorded
    samples = half_uniform(random_samples(4, 4, seed=1))
    m = skipping.train_step(copy.deepcopy(samples))
    plain.train_step(copy.deepcopy(samples))
    assert seen == [(8, False), (8, True)] and m["actor/no_signal_fraction"] == 0.5
    assert_same_gradients(grads(skipping.model), grads(plain.model), plain.model, samples)
    assert "mismatch/kl" in m  # π_θ of every row came back from the forwards
