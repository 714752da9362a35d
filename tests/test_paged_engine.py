"""PagedEngine: continuous batching over the paged KV cache. Logprobs equal the trainer's recompute
(plain, ragged lengths with sequences admitted mid-run, chunked prefill, GRPO groups, prefix-cache
hits, after preemption); greedy outputs equal BuiltinEngine's and do not depend on the KV budget; a group's
prompt is prefilled once. The partial-rollout / update / abort contract that every engine keeps is
in test_engine_contract.py."""

from itertools import pairwise

import pytest
import torch
from helpers import (
    EOS,
    VOCAB,
    assert_aligned,
    assert_same_logprobs,
    full_forward_logprobs,
    prompts,
    run,
    tiny_model,
)

from tandem.rollout.engine import BuiltinEngine
from tandem.rollout.group import make_groups
from tandem.rollout.paged_engine import PagedEngine
from tandem.sample import Prompt, SamplingParams, Status


def paged(model, **kw) -> PagedEngine:
    """Small blocks, so short test sequences still cross block boundaries and share partial blocks."""
    return PagedEngine(model, [EOS], 0, **{"num_kv_blocks": 256, "block_size": 4, **kw})


def assert_logprobs_match_recompute(model, samples, temperature=1.0):
    for s in samples:
        assert_aligned(s)
        with torch.no_grad():
            expected = full_forward_logprobs(model, s.prompt_ids, s.response_ids, temperature)
        assert_same_logprobs(s.logprobs, expected, model, [s], temperature)


def ragged(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of very different lengths, 2 to 30 tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = [2, 30, 5, 17, 3, 24, 9, 2][:n] + [4] * max(0, n - 8)
    return [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in lengths]


# ---------------------------------------------------------------- logprobs equal the recompute


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_plain_prefill_and_decode_match_recompute(temperature):
    model = tiny_model(std=0.3)
    samples = run(
        paged(model, seed=1), prompts(5), SamplingParams(temperature=temperature, max_new_tokens=12)
    )
    assert all(s.status is Status.FINISHED and s.versions == [0] * len(s.response_ids) for s in samples)
    assert_logprobs_match_recompute(model, samples, temperature)


def test_continuous_batching_of_ragged_lengths_matches_recompute():
    model = tiny_model(std=0.3)
    engine = paged(model, seed=2, max_num_seqs=3, max_num_batched_tokens=32)
    samples = make_groups([Prompt(text="p")] * 8, ragged(8), 1)
    caps = [1, 20, 3, 14, 2, 9, 20, 5]  # heavy tail: short ones leave early, waiting ones join
    for s, cap in zip(samples, caps, strict=True):
        s.max_new_tokens = cap
    steps = []
    engine.on_step = steps.append
    engine.generate(samples, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert [len(s.response_ids) for s in samples] == caps
    assert len(steps) > max(caps)  # admissions (prefill steps) happened between decode steps
    assert_logprobs_match_recompute(model, samples)


def test_chunked_prefill_keeps_the_token_budget_and_matches_recompute():
    """Prompts up to 30 tokens under a budget of 8 per step: long ones are prefilled in chunks
    between the decode steps of the running sequences, with the outputs of an unchunked engine."""
    model = tiny_model(std=0.3)
    ids, params = ragged(8), SamplingParams(temperature=0.0, max_new_tokens=10)
    unchunked = run(paged(model, max_num_seqs=4), ids, params, n=2)
    engine = paged(model, max_num_seqs=4, max_num_batched_tokens=8)
    forwards = []  # (tokens computed, rows) of every forward
    hook = model.register_forward_pre_hook(lambda _, a: forwards.append((int(a[2].sum()), a[0].shape[0])))
    try:
        chunked = run(engine, ids, params, n=2)
    finally:
        hook.remove()
    assert max(tokens for tokens, _ in forwards) <= 8
    assert engine.runner.num_prefill_tokens == sum(map(len, ids))  # each prompt once, in pieces
    prefills = [i for i, (tokens, rows) in enumerate(forwards) if tokens > rows]  # prefill forwards
    assert any(b - a > 1 for a, b in pairwise(prefills)), "no decode step between chunks"
    assert [s.response_ids for s in chunked] == [s.response_ids for s in unchunked]
    assert_logprobs_match_recompute(model, chunked)
    assert engine.block_manager.num_used_blocks == 0


def test_grpo_groups_share_the_prompt_prefill_and_match_recompute():
    model = tiny_model(std=0.3)
    engine = paged(model, seed=3)
    ids = ragged(4)
    samples = run(engine, ids, SamplingParams(max_new_tokens=10), n=4)
    assert engine.runner.num_prefill_tokens == sum(map(len, ids))  # once per group, not per sample
    assert len({tuple(s.response_ids) for s in samples}) > len(ids)  # the samples of a group differ
    assert_logprobs_match_recompute(model, samples)
    assert engine.block_manager.num_used_blocks == 0  # every block released at the end of the call


def test_group_sharing_off_prefills_every_sample_and_matches_recompute():
    """The baseline bench/engine.py measures sharing against: every sample prefills its own copy."""
    model = tiny_model(std=0.3)
    engine = paged(model, seed=3, group_sharing=False, prefix_caching=False)
    ids = ragged(4)
    samples = run(engine, ids, SamplingParams(max_new_tokens=10), n=4)
    assert engine.runner.num_prefill_tokens == 4 * sum(map(len, ids))
    assert engine.block_manager.hit_blocks == 0
    assert_logprobs_match_recompute(model, samples)
    assert engine.block_manager.num_used_blocks == 0


def test_prefix_cache_hit_across_requests_with_a_shared_system_prompt():
    model = tiny_model(std=0.3)
    engine = paged(model, seed=4)
    system = list(range(3, 15))  # 12 tokens: 3 full blocks of 4
    first, second = system + [20, 21, 22], system + [30, 31]
    params = SamplingParams(max_new_tokens=6)
    a = run(engine, [first], params)
    hits, prefilled = engine.block_manager.hit_blocks, engine.runner.num_prefill_tokens
    b = run(engine, [second], params)
    assert engine.block_manager.hit_blocks - hits == 3
    assert engine.runner.num_prefill_tokens - prefilled == len(second) - 12
    assert_logprobs_match_recompute(model, a + b)
    # New weights: the cached keys are stale, so the same prompt is prefilled in full again.
    engine.load_weights(tiny_model(seed=5, std=0.3).named_parameters(), version=1)
    hits, prefilled = engine.block_manager.hit_blocks, engine.runner.num_prefill_tokens
    c = run(engine, [second], params)
    assert engine.block_manager.hit_blocks == hits
    assert engine.runner.num_prefill_tokens - prefilled == len(second)
    assert c[0].versions == [1] * len(c[0].response_ids)
    assert_logprobs_match_recompute(engine.model, c)


def test_prompts_of_one_call_with_a_shared_system_prompt_prefill_it_once():
    """Different prompts sharing leading full blocks, in one call: the first computes them, the
    others wait one step and take them from the prefix cache (they were computed once per prompt)."""
    model = tiny_model(std=0.3)
    engine = paged(model, seed=4)
    system = list(range(3, 15))  # 12 tokens: 3 full blocks of 4
    ids = [system + [15 + i, 20 + i, 25 + i] for i in range(5)]
    samples = run(engine, ids, SamplingParams(max_new_tokens=6))
    assert engine.block_manager.hit_blocks == 3 * 4  # every prompt after the first
    assert engine.runner.num_prefill_tokens == 12 + 5 * 3
    assert_logprobs_match_recompute(model, samples)
    assert engine.block_manager.num_used_blocks == 0


def test_preemption_recomputes_and_matches_recompute():
    model = tiny_model(std=0.3)
    engine = paged(model, seed=5, num_kv_blocks=12, block_size=2)  # 24 slots for 12 sequences
    samples = run(engine, prompts(6), SamplingParams(max_new_tokens=12, ignore_eos=True), n=2)
    assert engine.num_preemptions > 0
    assert all(s.status is Status.FINISHED and len(s.response_ids) == 12 for s in samples)
    assert_logprobs_match_recompute(model, samples)


# ---------------------------------------------------------------- greedy equalities


@pytest.mark.parametrize("token_budget", [8192, 6])  # 6: long prompts chunked while others preempt
def test_greedy_with_a_tiny_kv_budget_equals_a_large_one_and_builtin(token_budget):
    model = tiny_model(std=0.3)
    ids, greedy = ragged(8), SamplingParams(temperature=0.0, max_new_tokens=12)
    tiny = paged(model, num_kv_blocks=12, block_size=4, max_num_seqs=6, max_num_batched_tokens=token_budget)
    large = paged(model, num_kv_blocks=512)
    a, b = run(tiny, ids, greedy, n=2), run(large, ids, greedy, n=2)
    c = run(BuiltinEngine(model, [EOS], 0), ids, greedy, n=2)
    assert tiny.num_preemptions > 0 and large.num_preemptions == 0
    assert [s.response_ids for s in a] == [s.response_ids for s in b] == [s.response_ids for s in c]
    assert [s.finish_reason for s in a] == [s.finish_reason for s in c]
    for x, y in zip(a, c, strict=True):
        assert_same_logprobs(x.logprobs, torch.tensor(y.logprobs), model, [y])


def test_a_sequence_larger_than_the_whole_cache_is_a_clear_error():
    engine = paged(tiny_model(), num_kv_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="raise num_kv_blocks"):
        run(engine, prompts(1), SamplingParams(max_new_tokens=20))
    with pytest.raises(ValueError, match="kv_budget_mb"):
        paged(tiny_model(), kv_budget_mb=1e-6)
    assert paged(tiny_model(), kv_budget_mb=1.0).block_manager.num_blocks == 2**20 // (2 * 2 * 4 * 2 * 8 * 4)


# ---------------------------------------------------------------- CUDA graphs' fixed-shape decode


def test_bucketed_decode_gives_the_eager_engine_s_tokens_and_logprobs():
    """cuda_graphs=True on the CPU runs the graphs' padded, fixed-shape decode eagerly: rows padded
    up to a bucket (padding rows writing a scratch block), block tables padded to a width that
    grows past 16 blocks, batches above the largest bucket eager. Seeded samples take the same
    tokens as on the eager engine, with the same logprobs to float rounding."""
    model = tiny_model(std=0.3)
    samples = {}
    for graphs in (False, True):
        engine = paged(model, max_num_seqs=6, block_size=4, cuda_graphs=graphs)
        batch = make_groups([Prompt(text="p")] * 6, ragged(6), 2)  # 12 sequences, 6 at a time
        for i, s in enumerate(batch):
            s.seed, s.max_new_tokens = 100 + i, [70, 9, 33, 5][i % 4]  # 70 tokens: > 16 blocks of 4
        samples[graphs] = engine.generate(batch, SamplingParams(max_new_tokens=70, ignore_eos=True))
        if graphs:
            assert engine.runner.graphs.buckets == [1, 2, 4]
            assert engine.runner.graphs.num_steps > 0 and engine.runner.graphs.max_blocks == 32
    for eager, bucketed in zip(samples[False], samples[True], strict=True):
        assert bucketed.response_ids == eager.response_ids
        assert_same_logprobs(bucketed.logprobs, torch.tensor(eager.logprobs), model, [eager])
    assert_logprobs_match_recompute(model, samples[True])
