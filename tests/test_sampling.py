"""Sampling as vLLM users expect: min-p, repetition penalty, stop strings, per-request seeds and the
two logprob modes — each filter against a hand-computed case and against transformers' own."""

import pytest
import torch
from helpers import EOS, VOCAB, assert_same_logprobs, logprob_tolerance, prompts, sample_logits, tiny_model
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import tandem.rollout.engine as engine_module
from tandem.model.logprobs import token_logprobs
from tandem.rollout.engine import BuiltinEngine
from tandem.rollout.group import make_groups
from tandem.rollout.sampler import (
    apply_repetition_penalty,
    filter_min_p,
    inverse_cdf,
    processed_logprobs,
    sample_next,
    uniform_draws,
)
from tandem.rollout.worker import RolloutWorker, StopStrings
from tandem.sample import Prompt, Sample, SamplingParams, Status

# Token i >= 3 decodes to one to three letters; 0-2 (pad, unused, EOS) are special and decode to "".
PIECES = [""] * 3 + [chr(ord("a") + i % 26) * (1 + i % 3) for i in range(3, VOCAB)]


class Letters:
    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens=True):
        return "".join(PIECES[i] for i in ids)


def samples_for(ids: list[list[int]], n: int = 1) -> list[Sample]:
    return make_groups([Prompt(text="p")] * len(ids), ids, n)


def seen_mask(input_ids: list[list[int]], vocab: int) -> torch.Tensor:
    seen = torch.zeros(len(input_ids), vocab, dtype=torch.bool)
    for row, ids in enumerate(input_ids):
        seen[row, ids] = True
    return seen


def forward_logits(model, prompt_ids, response_ids) -> torch.Tensor:
    """(len(response_ids), V): the logits each response token was sampled from, by a full forward."""
    ids = torch.tensor(prompt_ids + response_ids)[None]
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool))
    return logits[0, len(prompt_ids) - 1 : -1].float()


@pytest.fixture
def compact_every_step(monkeypatch):
    """Drop ended rows from the cache after every step, so cache rows and samples diverge at once."""
    monkeypatch.setattr(engine_module, "COMPACT_FRACTION", 0.0)


# --- the filters, by hand and against transformers ------------------------------------------------


def test_min_p_keeps_exactly_the_tokens_above_min_p_times_the_top_probability():
    logits = torch.tensor([[0.5, 0.3, 0.12, 0.08]]).log()
    kept = lambda min_p: torch.isfinite(filter_min_p(logits, min_p)).tolist()[0]  # noqa: E731
    assert kept(0.2) == [True, True, True, False]  # threshold 0.1
    assert kept(0.5) == [True, True, False, False]  # threshold 0.25
    assert kept(0.7) == [True, False, False, False]  # threshold 0.35
    assert kept(1.0) == [True, False, False, False]  # the top token always stays
    kept_logits = filter_min_p(logits, 0.2)[0, :3]
    assert torch.equal(kept_logits, logits[0, :3])  # the kept logits are untouched


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_equals_transformers(min_p):
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    ours = filter_min_p(logits, min_p)
    theirs = MinPLogitsWarper(min_p)(None, logits.clone())
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    assert 1 < int(torch.isfinite(ours).sum()) < logits.numel()  # the case filters something
    torch.testing.assert_close(ours[torch.isfinite(ours)], theirs[torch.isfinite(theirs)])


def test_repetition_penalty_changes_exactly_the_seen_tokens_with_hf_sign_rule():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 0.0]])
    seen = seen_mask([[0, 1, 4, 0]], 5)
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [[1.0, -2.0, 0.5, -3.0, 0.0]]  # positive / 2, negative * 2, unseen as is
    assert apply_repetition_penalty(logits, seen, 0.5).tolist() == [[4.0, -0.5, 0.5, -3.0, 0.0]]


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_equals_transformers(penalty):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, VOCAB, generator=g)
    input_ids = torch.randint(0, VOCAB, (4, 12), generator=g)  # repeats, as real sequences have
    ours = apply_repetition_penalty(logits, seen_mask(input_ids.tolist(), VOCAB), penalty)
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone())
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    assert not torch.equal(ours, logits)


# --- logprobs: processed and raw ------------------------------------------------------------------


def test_processed_logprobs_are_the_renormalized_probabilities_of_the_kept_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]])
    seen = seen_mask([[4]], 5)
    params = SamplingParams(temperature=0.5, repetition_penalty=1.5, min_p=0.1, top_k=3)
    got = processed_logprobs(logits, params, seen)[0]
    # By hand: 3.0 seen -> 2.0; / T -> [4, 2, 0, -2, 4]; p_max = p_0 = p_4; min-p drops the tokens
    # with p < 0.1 p_max, i.e. logit < 4 + ln 0.1 = 1.70: tokens 2 and 3; top-3 then drops nothing.
    probs = torch.softmax(torch.tensor([4.0, 2.0, 0.0, -2.0, 4.0]), -1)
    keep = torch.tensor([True, True, False, False, True])
    expected = torch.where(keep, (probs / probs[keep].sum()).log(), torch.tensor(float("-inf")))
    torch.testing.assert_close(got, expected)
    assert torch.isclose(got.exp().sum(), torch.tensor(1.0))
    assert torch.equal(torch.isfinite(got), keep)


def test_processed_logprobs_equal_transformers_processors_in_vllm_order():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, VOCAB, generator=g) * 2
    input_ids = torch.randint(0, VOCAB, (5, 9), generator=g)
    params = SamplingParams(temperature=0.7, repetition_penalty=1.2, min_p=0.02, top_k=20, top_p=0.9)
    got = processed_logprobs(logits, params, seen_mask(input_ids.tolist(), VOCAB))
    scores = logits.clone()
    # vLLM's order: penalties, temperature, min-p, then top-k and top-p.
    for step in (
        RepetitionPenaltyLogitsProcessor(1.2),
        TemperatureLogitsWarper(0.7),
        MinPLogitsWarper(0.02),
        TopKLogitsWarper(20),
        TopPLogitsWarper(0.9),
    ):
        scores = step(input_ids, scores)
    expected = torch.log_softmax(scores, -1)
    assert torch.equal(torch.isfinite(got), torch.isfinite(expected))
    assert (torch.isfinite(got).sum(-1) < 20).any()  # top-p or min-p cut below top-k somewhere
    torch.testing.assert_close(got[torch.isfinite(got)], expected[torch.isfinite(expected)])
    torch.testing.assert_close(got.exp().sum(-1), torch.ones(5))


def test_sample_next_draws_from_the_processed_distribution_and_returns_the_mode_s_logprob():
    n = 20000
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, 2.5]]).expand(n, -1)
    seen = seen_mask([[5]], 6).expand(n, -1)
    draws = uniform_draws(n, torch.device("cpu"), torch.Generator().manual_seed(0))
    processed = SamplingParams(
        temperature=0.8, repetition_penalty=2.0, min_p=0.1, top_k=4, logprobs_mode="processed"
    )
    tokens, logprobs = sample_next(logits, processed, draws, seen)
    target = processed_logprobs(logits[:1], processed, seen[:1])[0]
    assert torch.isfinite(target).sum() == 4 and torch.isfinite(target[tokens]).all()
    freq = torch.bincount(tokens, minlength=6) / n
    torch.testing.assert_close(freq, target.exp(), atol=0.015, rtol=0)  # ~4 standard errors
    torch.testing.assert_close(logprobs, target[tokens])
    raw = SamplingParams(temperature=0.8, repetition_penalty=2.0, min_p=0.1, top_k=4)
    same_tokens, raw_logprobs = sample_next(logits, raw, draws, seen)
    assert torch.equal(same_tokens, tokens)  # the mode changes the logprob, never the token
    torch.testing.assert_close(raw_logprobs, torch.log_softmax(logits[0] / 0.8, -1)[tokens])


def test_plain_temperature_sampling_draws_softmax_of_the_tempered_logits():
    """No penalty or filter: sample_next draws from exp of its log-probs (one pass over (B, V), not
    a second softmax): the tokens the full route's inverse_cdf gives for the same draws, at the
    softmax's frequencies, with the log_softmax's logprob."""
    n = 20000
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, 2.5, -30.0]]).expand(n, -1).bfloat16()
    draws = uniform_draws(n, torch.device("cpu"), torch.Generator().manual_seed(0))
    tokens, logprobs = sample_next(logits, SamplingParams(temperature=0.7), draws)
    logp = torch.log_softmax(logits[0].float() / 0.7, -1)
    assert torch.equal(tokens, inverse_cdf(logp.expand(n, -1), draws))
    freq = torch.bincount(tokens, minlength=7) / n
    torch.testing.assert_close(freq, logp.exp(), atol=0.015, rtol=0)
    assert torch.equal(logprobs, logp[tokens])


def test_inverse_cdf_draws_the_token_whose_cumulative_mass_first_exceeds_the_draw():
    probs = torch.tensor([0.25, 0.0, 0.25, 0.5])
    scores = probs.log()[None].expand(6, -1)  # log 0 = -inf: never drawn
    draws = torch.tensor([0.0, 0.2499, 0.25, 0.4999, 0.5, 1 - 2**-53], dtype=torch.float64)
    assert inverse_cdf(scores, draws).tolist() == [0, 0, 2, 2, 3, 3]
    tail = torch.tensor([[0.0, 1.0, float("-inf"), float("-inf")]]).expand(2, -1)
    assert inverse_cdf(tail, torch.tensor([0.0, 1 - 2**-53], dtype=torch.float64)).tolist() == [0, 1]


@pytest.mark.parametrize("block", [1, 4, 7, 256])
def test_inverse_cdf_in_blocks_draws_what_one_running_sum_over_the_vocabulary_draws(block):
    """The two-level search (the block the draw falls in, then the token within it) gives the token
    a single float64 cumsum over the whole row gives, blocks that do not divide the vocabulary and
    runs of zero-mass tokens across block edges included."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(64, 50, generator=g) * 3
    scores[:, 5:17] = float("-inf")  # a run of zero mass over block edges
    scores[::3, -6:] = float("-inf")  # and at the end of some rows
    draws = torch.rand(64, generator=g, dtype=torch.float64)
    draws[:4] = torch.tensor([0.0, 1 - 2**-53, 0.5, 2**-40], dtype=torch.float64)
    cdf = torch.softmax(scores, -1).double().cumsum(-1)
    expected = torch.searchsorted(cdf, (draws[:, None] * cdf[:, -1:]), right=True).squeeze(-1)
    expected = torch.where(expected >= 50, scores.argmax(-1), expected)
    assert inverse_cdf(scores, draws, block=block).tolist() == expected.tolist()


FILTERS = dict(
    temperature=0.8, top_k=8, min_p=0.05, repetition_penalty=1.5, stop_token_ids=list(range(3, 10))
)


def test_raw_logprobs_equal_the_trainer_recompute_whatever_the_filters(compact_every_step):
    model = tiny_model(std=0.3)
    engine = BuiltinEngine(model, [EOS], 0, seed=4)
    samples = engine.generate(samples_for(prompts(4), 3), SamplingParams(max_new_tokens=12, **FILTERS))
    assert {s.finish_reason for s in samples} == {"stop", "length"}  # rows left the cache early
    for s in samples:
        ids = torch.tensor(s.response_ids)
        expected = token_logprobs(forward_logits(model, s.prompt_ids, s.response_ids), ids, 0.8)
        assert_same_logprobs(s.logprobs, expected, model, [s], temperature=0.8)


def test_processed_logprobs_follow_each_row_s_own_tokens_so_far(compact_every_step):
    model = tiny_model(std=0.3)
    engine = BuiltinEngine(model, [EOS], 0, seed=4)
    params = SamplingParams(max_new_tokens=12, logprobs_mode="processed", **FILTERS)
    samples = engine.generate(samples_for(prompts(4), 3), params)
    assert {s.finish_reason for s in samples} == {"stop", "length"}
    differs = 0
    for s in samples:
        logits = forward_logits(model, s.prompt_ids, s.response_ids)
        seen = seen_mask([s.prompt_ids + s.response_ids[:t] for t in range(len(s.response_ids))], VOCAB)
        table = processed_logprobs(logits, params, seen)
        expected = table.gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
        # The cached decode's logits against a full forward's, through the filters: the penalty
        # scales a logit, and so its rounding, by up to 1.5 before the temperature.
        tol = 1.5 * logprob_tolerance(sample_logits(model, [s]), model.cfg, temperature=0.8)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=tol, rtol=0)
        raw = token_logprobs(logits, torch.tensor(s.response_ids), 0.8)
        differs += int((expected - raw).abs().max() > 100 * tol)
    assert differs == len(samples)  # the two modes record numbers the tolerance tells apart (0.3+)


def test_greedy_with_a_repetition_penalty_equals_transformers_loop_also_when_continued():
    model = tiny_model(std=0.3)
    ids = prompts(3)
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True, repetition_penalty=1.8)
    whole = BuiltinEngine(model, [EOS], 0).generate(samples_for(ids), params)
    plain = BuiltinEngine(model, [EOS], 0).generate(
        samples_for(ids), SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    )
    assert any(a.response_ids != b.response_ids for a, b in zip(whole, plain, strict=True))
    penalty = RepetitionPenaltyLogitsProcessor(1.8)
    for s in whole:
        seq = list(s.prompt_ids)
        for _ in range(10):
            t = torch.tensor(seq)[None]
            with torch.no_grad():
                logits = model(t, torch.arange(t.shape[1])[None], torch.ones_like(t, dtype=torch.bool))
            seq.append(int(penalty(t, logits[:, -1].float()).argmax()))
        assert s.response_ids == seq[len(s.prompt_ids) :]
    # Aborted after 4 tokens and continued: the penalty counts the partial response's tokens too.
    engine = BuiltinEngine(model, [EOS], 0)
    engine.on_step = lambda step: engine.abort() if step == 4 else None
    parts = engine.generate(samples_for(ids), params)
    engine.on_step = None
    engine.generate(parts, params)
    assert [s.response_ids for s in parts] == [s.response_ids for s in whole]


# --- stop strings ---------------------------------------------------------------------------------


def greedy_reference(model, n_prompts=6, max_new_tokens=16):
    """Greedy responses with no stop string, and the prompts that gave them."""
    ids = prompts(n_prompts, seed=5)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    return ids, BuiltinEngine(model, [EOS], 0).generate(samples_for(ids), params)


def first_stop(response_ids, stop):
    """By hand: the number of tokens after which the decoded response first contains `stop`."""
    for k in range(1, len(response_ids) + 1):
        if stop in Letters().decode(response_ids[:k]):
            return k
    return None


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_end_generation_at_the_completing_token_and_cut_the_text(include):
    model = tiny_model(std=0.3)
    ids, reference = greedy_reference(model)
    checked = 0
    for prompt_ids, ref in zip(ids, reference, strict=True):
        full = Letters().decode(ref.response_ids)
        if len(ref.response_ids) < 10 or len(full) < 12:
            continue
        start = len(Letters().decode(ref.response_ids[:5])) - 1  # inside or at the end of token 5
        stop = full[start : start + 5]  # spans two or more tokens
        k = first_stop(ref.response_ids, stop)
        assert k is not None and k < len(ref.response_ids)
        steps = []
        engine = BuiltinEngine(model, [EOS], 0, on_step=steps.append)
        params = SamplingParams(
            temperature=0.0, max_new_tokens=16, stop=["never there", stop], include_stop_str_in_output=include
        )
        s = RolloutWorker(engine, Letters()).generate(samples_for([prompt_ids]), params)[0]
        assert s.status is Status.FINISHED and s.finish_reason == "stop"
        assert s.response_ids == ref.response_ids[:k]
        assert len(s.logprobs) == len(s.versions) == len(s.loss_mask) == k
        assert s.logprobs == pytest.approx(ref.logprobs[:k], abs=1e-5)
        assert steps == list(range(1, k))  # no decode step ran after the stop string
        text = Letters().decode(s.response_ids)
        at = text.index(stop)
        assert s.response_text == (text[: at + len(stop)] if include else text[:at])
        # Completed by the last token the length cap allows: a stop still, as vLLM counts it.
        params.max_new_tokens = k
        capped = RolloutWorker(engine, Letters()).generate(samples_for([prompt_ids]), params)[0]
        assert capped.finish_reason == "stop" and capped.response_ids == s.response_ids
        checked += 1
    assert checked >= 2


def test_stop_strings_hold_across_an_abort_and_a_resubmitted_finished_sample_stays_put():
    model = tiny_model(std=0.3)
    ids, reference = greedy_reference(model)
    ref = max(reference, key=lambda s: len(s.response_ids))
    full = Letters().decode(ref.response_ids)
    start = len(Letters().decode(ref.response_ids[:7]))
    stop = full[start - 2 : start + 2]
    k = first_stop(ref.response_ids, stop)
    assert k is not None and 3 < k < len(ref.response_ids)
    engine = BuiltinEngine(model, [EOS], 0)
    worker = RolloutWorker(engine, Letters())
    params = SamplingParams(temperature=0.0, max_new_tokens=16, stop=[stop])
    engine.on_step = lambda step: engine.abort() if step == k - 1 else None  # one token short
    s = worker.generate(samples_for([ref.prompt_ids]), params)[0]
    assert s.status is Status.ABORTED and len(s.response_ids) == k - 1
    engine.on_step = None
    worker.generate([s], params)  # its first new token completes a string begun in the partial
    assert s.finish_reason == "stop" and s.response_ids == ref.response_ids[:k]
    worker.generate([s], params)
    assert s.finish_reason == "stop" and s.response_ids == ref.response_ids[:k]
    with pytest.raises(ValueError, match="stop_check"):
        engine.generate(samples_for([ref.prompt_ids]), params)  # no tokenizer, no stop strings


def test_stop_string_window_and_cut():
    check = StopStrings(Letters(), ["ab", "é!"])
    assert check.window == 3 + 4  # "é!" is three UTF-8 bytes
    assert check([[3], [3, 4], [4, 3]]) == [False, False, False]  # "d", "de", "ed"
    assert check.cut("xxabyy", include_stop=False) == "xx"
    assert check.cut("xxabyy é!", include_stop=True) == "xxab"
    assert check.cut("nothing", include_stop=False) == "nothing"


# --- seeds ----------------------------------------------------------------------------------------


def test_a_seeded_request_samples_the_same_tokens_alone_and_in_any_batch(compact_every_step):
    model = tiny_model(std=0.3)
    params = SamplingParams(max_new_tokens=14, temperature=1.0, min_p=0.02, repetition_penalty=1.2)
    target_prompt = prompts(1, seed=9)[0]

    def request(seed):
        s = samples_for([target_prompt])[0]
        s.seed = seed
        return s

    def crowd(target: Sample) -> list[Sample]:
        """The target among 14 other requests, seeded and unseeded, of other prompts."""
        others = samples_for(prompts(7, seed=10), 2)
        for i, s in enumerate(others):
            s.seed = None if i % 2 else 50 + i
        return others[:5] + [target] + others[5:]

    alone = BuiltinEngine(model, [EOS], 0, seed=0).generate([request(1234)], params)[0]
    batch = BuiltinEngine(model, [EOS], 0, seed=99).generate(crowd(request(1234)), params)
    assert len({len(s.response_ids) for s in batch}) > 1  # rows left the cache at different steps
    assert batch[5].response_ids == alone.response_ids
    assert batch[5].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    # Without a seed the same request does depend on its batch (else this test would prove nothing),
    # and another seed gives another response.
    unseeded = [BuiltinEngine(model, [EOS], 0, seed=0).generate([request(None)], params)[0] for _ in range(2)]
    crowded = BuiltinEngine(model, [EOS], 0, seed=0).generate(crowd(request(None)), params)
    assert unseeded[0].response_ids == unseeded[1].response_ids != crowded[5].response_ids
    other = BuiltinEngine(model, [EOS], 0, seed=0).generate([request(4321)], params)[0]
    assert other.response_ids != alone.response_ids


def test_a_seeded_request_continued_after_an_abort_samples_what_it_would_have():
    model = tiny_model(std=0.3)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    samples = samples_for(prompts(3), 2)
    for i, s in enumerate(samples):
        s.seed = 7 + i
    whole = BuiltinEngine(model, [EOS], 0).generate([Sample(**vars(s)) for s in samples], params)
    engine = BuiltinEngine(model, [EOS], 0)
    engine.on_step = lambda step: engine.abort() if step == 5 else None
    engine.generate(samples, params)
    assert all(len(s.response_ids) == 5 for s in samples)
    engine.on_step = None
    engine.generate(samples, params)
    assert [s.response_ids for s in samples] == [w.response_ids for w in whole]


def test_sampling_params_reject_bad_values_by_name():
    for bad, name in [
        (dict(logprobs_mode="behaviour"), "logprobs_mode"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(stop="###"), "stop"),
        (dict(stop=[""]), "stop"),
    ]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**bad)
