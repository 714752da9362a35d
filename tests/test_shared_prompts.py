"""train.share_prompts: a packed micro-batch lays a GRPO group's prompt once, followed by every
response, each attending to the prompt and to itself. Each token must see exactly the context it has
alone, so its logprob is that of a forward over its own sequence, and a training step's gradient is
that of a step over unshared rows; the row is shorter by the repeated prompts."""

import copy

import pytest
import torch
from helpers import (
    assert_same_gradients,
    assert_same_logprobs,
    grads,
    random_samples,
    tiny_model,
    train_worker,
)

from tandem.model.logprobs import token_logprobs
from tandem.model.segments import tree_mask
from tandem.train.batch import packed, score


def alone(model, samples) -> torch.Tensor:
    """Each sample's response logprobs from a forward over its own prompt + response (no packing)."""
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor(s.prompt_ids + s.response_ids)[None]
            logits = model(ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool))[0]
            p = len(s.prompt_ids)
            out.append(token_logprobs(logits[p - 1 : -1], torch.tensor(s.response_ids)))
    return torch.cat(out)


def test_a_shared_prompt_gives_each_token_the_logprob_of_its_own_sequence():
    model = tiny_model(std=0.3)
    samples = random_samples(3, 4, seed=0)
    rows = packed(samples, share=True)
    plain = packed(samples)
    # three prompts laid once instead of four times each
    saved = sum(3 * len(samples[4 * g].prompt_ids) for g in range(3))
    assert rows.ids.shape[1] == plain.ids.shape[1] - saved
    with torch.no_grad():
        logp, _ = score(model, rows, 9)
    got = torch.cat([logp[i, : len(s.response_ids)] for i, s in enumerate(samples)])
    assert_same_logprobs(got, alone(model, samples), model, samples)


def test_a_training_step_on_shared_prompts_has_the_gradient_of_one_on_plain_rows():
    samples = random_samples(4, 4, seed=1)
    shared, plain = (
        train_worker(train=dict(micro_batch_tokens=60, share_prompts=on, lr=1e-2)) for on in (True, False)
    )
    m_shared = shared.train_step(copy.deepcopy(samples))
    m_plain = plain.train_step(copy.deepcopy(samples))
    assert_same_gradients(grads(shared.model), grads(plain.model), plain.model, samples)
    assert abs(m_shared["mismatch/kl"] - m_plain["mismatch/kl"]) < 1e-5


def test_the_mask_lets_each_response_see_the_prompt_and_itself_only():
    allowed = tree_mask(2, [2, 1])  # tokens: p0 p1 a0 a1 b0
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_batch_invariant_mode_shares_prompts_bit_for_bit(dtype):
    """run.deterministic shares prompts too: each response attends to a copy of its prompt's keys
    laid out as in a sequence of its own (`tree_attention`), so the logprobs of a micro-batch with
    shared prompts equal those of each sequence packed alone, bit for bit, while the packed row
    holds each prompt once."""
    samples = random_samples(2, 4, seed=2)
    shared, alone_ = (
        train_worker(train=dict(micro_batch_tokens=400, share_prompts=on), dtype=dtype)
        for on in (True, False)
    )
    for w in (shared, alone_):
        w.compute.batch_invariant = True
    assert shared.learner.sharing and not alone_.learner.sharing
    rows = shared.learner.rows(samples)
    assert rows.ids.shape[1] < sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    assert torch.equal(shared.compute_logprobs(samples), alone_.compute_logprobs(samples))
