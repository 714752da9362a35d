"""The built-in engine: greedy equals a plain argmax loop, logprobs match the trainer, stops work."""

import pytest
import torch
from helpers import VOCAB, tiny_model

from tandem.model import token_logprobs
from tandem.rollout import BuiltinEngine, SamplingParams, make_groups
from tandem.rollout.sampler import filter_top_k_top_p
from tandem.sample import Prompt, Status

EOS = 2


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, VOCAB, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def run(engine, ids, params, n=1):
    return engine.generate(make_groups([Prompt(text="p")] * len(ids), ids, n), params)


def full_forward_logprobs(model, prompt_ids, response_ids, temperature=1.0):
    ids = torch.tensor(prompt_ids + response_ids)[None]
    logits = model(ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool))
    p = len(prompt_ids)
    return token_logprobs(logits[0, p - 1 : -1], ids[0, p:], temperature)


def test_greedy_matches_an_argmax_loop_and_logprobs_match_recompute():
    model = tiny_model(std=0.3)
    engine = BuiltinEngine(model, [EOS], pad_token_id=0)
    ids = prompts(6)
    samples = run(engine, ids, SamplingParams(temperature=0.0, max_new_tokens=10))
    for s in samples:
        seq = list(s.prompt_ids)
        with torch.no_grad():
            for _ in range(len(s.response_ids)):
                t = torch.tensor(seq)[None]
                logits = model(t, torch.arange(t.shape[1])[None], torch.ones_like(t, dtype=torch.bool))
                seq.append(int(logits[0, -1].argmax()))
                if seq[-1] == EOS:
                    break
        assert s.response_ids == seq[len(s.prompt_ids) :]
        with torch.no_grad():
            expected = full_forward_logprobs(model, s.prompt_ids, s.response_ids)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_recompute_at_the_sampling_temperature(temperature):
    model = tiny_model(std=0.3)
    engine = BuiltinEngine(model, [EOS], pad_token_id=0, seed=1)
    samples = run(engine, prompts(4), SamplingParams(temperature=temperature, max_new_tokens=12), n=3)
    assert len(samples) == 12 and {s.group_id for s in samples} == {0, 1, 2, 3}
    for s in samples:
        assert s.status is Status.FINISHED and s.versions == [0] * len(s.response_ids)
        with torch.no_grad():
            expected = full_forward_logprobs(model, s.prompt_ids, s.response_ids, temperature)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-5, rtol=0)


def test_stop_tokens_end_responses_and_length_limits_them():
    model = tiny_model(std=0.3)
    engine = BuiltinEngine(model, [EOS], pad_token_id=0, seed=0)
    stop = list(range(3, VOCAB, 2))  # half the vocabulary: most responses stop early
    samples = run(engine, prompts(8), SamplingParams(max_new_tokens=6, stop_token_ids=stop), n=2)
    for s in samples:
        if s.finish_reason == "stop":
            assert s.response_ids[-1] in stop + [EOS]
            assert not set(s.response_ids[:-1]) & set(stop + [EOS])
        else:
            assert s.finish_reason == "length" and len(s.response_ids) == 6
    assert {s.finish_reason for s in samples} == {"stop", "length"}


def test_same_seed_same_samples_and_new_weights_change_them():
    ids = prompts(4)
    params = SamplingParams(max_new_tokens=8)
    a = run(BuiltinEngine(tiny_model(std=0.3), [EOS], 0, seed=7), ids, params)
    b = run(BuiltinEngine(tiny_model(std=0.3), [EOS], 0, seed=7), ids, params)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    engine = BuiltinEngine(tiny_model(std=0.3), [EOS], 0)
    other = tiny_model(seed=5, std=0.3)
    engine.load_weights(other.named_parameters(), version=3)
    for (name, p), (_, q) in zip(engine.model.named_parameters(), other.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    s = run(engine, ids, SamplingParams(temperature=0.0, max_new_tokens=4))[0]
    assert engine.version == 3 and s.versions == [3] * len(s.response_ids)


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isfinite(filter_top_k_top_p(logits, 2, 1.0)).tolist() == [[True, True, False, False]]
    probs = torch.softmax(logits, -1)[0]  # 0.64, 0.24, 0.09, 0.03
    kept = torch.isfinite(filter_top_k_top_p(logits, 0, 0.8)).tolist()
    assert kept == [[True, True, False, False]] and probs[0] < 0.8 <= probs[:2].sum()
    assert torch.isfinite(filter_top_k_top_p(logits, 0, 0.5)).tolist() == [[True, False, False, False]]


def test_a_group_shares_its_prefill_and_matches_separate_prompts():
    model = tiny_model(std=0.3)
    ids = prompts(3)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=7)
    grouped = run(BuiltinEngine(model, [EOS], 0), ids, greedy, n=4)
    alone = run(BuiltinEngine(model, [EOS], 0), ids, greedy, n=1)
    for g, single in enumerate(alone):
        group = [s for s in grouped if s.group_id == g]
        assert len(group) == 4
        for s in group:
            assert s.response_ids == single.response_ids
            torch.testing.assert_close(
                torch.tensor(s.logprobs), torch.tensor(single.logprobs), atol=1e-5, rtol=0
            )
