"""The built-in engine beyond the contract every engine keeps (test_engine_contract.py, which runs on
it too): engine seeds, top-k/top-p, group prefill sharing, partial groups, keys kept under
"continue", updates and aborts from other threads, caps past EOS, the compiled decode."""

import pytest
import torch
from helpers import (
    EOS,
    assert_aligned,
    assert_same_logprobs,
    at_step,
    clone_model,
    from_another_thread,
    full_forward_logprobs,
    logprob_tolerance,
    partial,
    prompts,
    run,
    sample_logits,
    stepwise_logprobs,
    tiny_model,
)

from tandem.errors import TandemError
from tandem.rollout.engine import BuiltinEngine
from tandem.rollout.group import make_groups
from tandem.rollout.paged_engine import PagedEngine
from tandem.rollout.sampler import filter_top_k_top_p
from tandem.rollout.worker import RolloutWorker
from tandem.sample import Prompt, SamplingParams, Status


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
            assert_same_logprobs(s.logprobs, torch.tensor(single.logprobs), model, [single])


# --- partial rollouts, in-flight weight updates, abort ------------------------------------------


def copy_into(engine, source):
    """The `apply` of a pending update: copy `source`'s weights into the engine's model."""
    pairs = list(zip(engine.model.parameters(), source.parameters(), strict=True))
    return lambda: [p.copy_(q) for p, q in pairs]


def same_weights(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_on_update_must_be_a_known_policy():
    with pytest.raises(ValueError, match="drain, abort, continue"):
        BuiltinEngine(tiny_model(), [EOS], 0, on_update="swap")


def test_a_group_continues_partials_of_different_lengths_in_one_call():
    model = tiny_model(std=0.3)
    ids, greedy = prompts(2), SamplingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True)
    whole = run(BuiltinEngine(model, [EOS], 0), ids, greedy)
    cuts = [0, 3, 3, 6, 9]  # two samples share a prefix of 3 tokens; one is already complete
    samples = [partial(w, j) for w in whole for j in cuts]
    engine = BuiltinEngine(model, [EOS], 0)
    prefill_rows = []
    forward = engine.model.forward
    engine.model.forward = lambda ids, *a: (prefill_rows.append(len(ids)), forward(ids, *a))[1]
    engine.generate(samples, greedy)
    assert prefill_rows[0] == 2 * 3  # one prefill per distinct prompt + partial (9 needs none)
    for k, s in enumerate(samples):
        w = whole[k // len(cuts)]
        assert s.status is Status.FINISHED and s.response_ids == w.response_ids
        assert_aligned(s)
        assert_same_logprobs(s.logprobs, torch.tensor(w.logprobs), model, [w])


@torch.no_grad()
def test_continue_swaps_weights_between_decode_steps_and_versions_switch_at_the_next_token():
    old, new = tiny_model(std=0.3), tiny_model(seed=5, std=0.3)
    ids, greedy = prompts(3), SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    engine = BuiltinEngine(clone_model(old), [EOS], 0, on_update="continue")
    engine.on_step = at_step(4, lambda: engine.set_pending_update(1, copy_into(engine, new)))
    samples = run(engine, ids, greedy)
    assert engine.version == 1 and same_weights(engine.model, new)
    for s in samples:
        # Tokens 0..3 were sampled from logits of the old weights; the swap came before the forward
        # of token 3, whose logits (new weights) gave token 4.
        assert s.status is Status.FINISHED and s.versions == [0] * 4 + [1] * 6
        tokens, expected = stepwise_logprobs(old, new, s.prompt_ids, s.response_ids, swap_after=4)
        assert s.response_ids == tokens
        tol = max(logprob_tolerance(sample_logits(m, [s]), m.cfg) for m in (old, new))
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=tol, rtol=0)
        # The weights did change, and the old keys were kept rather than recomputed.
        on_old = full_forward_logprobs(old, s.prompt_ids, s.response_ids)
        on_new = full_forward_logprobs(new, s.prompt_ids, s.response_ids)
        assert_same_logprobs(expected[:4], on_old[:4], old, [s])
        assert (expected[4:] - on_old[4:]).abs().max() > 100 * tol
        assert (expected[4:] - on_new[4:]).abs().max() > 100 * tol


def test_abort_and_an_update_from_another_thread():
    engine = BuiltinEngine(tiny_model(std=0.3), [EOS], 0, on_update="continue")

    def update_then_abort():
        engine.set_pending_update(7, lambda: None)
        engine.abort()

    with from_another_thread(engine, 3, update_then_abort):
        samples = run(engine, prompts(3), SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert all(s.status is Status.ABORTED and s.versions == [0, 0, 0] for s in samples)
    assert engine.version == 0  # abort wins: the update waits for the next call
    assert engine.apply_pending() == 7 and engine.version == 7 and engine.apply_pending() is None


def test_the_worker_passes_updates_and_aborts_through_and_decodes_partials():
    class Digits:
        def decode(self, ids, skip_special_tokens):
            return " ".join(map(str, ids))

    engine = BuiltinEngine(tiny_model(std=0.3), [EOS], 0)
    worker = RolloutWorker(engine, Digits())
    engine.on_step = at_step(2, worker.abort)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    samples = worker.generate(make_groups([Prompt(text="p")], prompts(1), 2), params)
    assert all(s.status is Status.ABORTED and len(s.response_text.split()) == 2 for s in samples)
    worker.set_pending_update(4, lambda: None)
    assert worker.apply_pending() == 4 and worker.version == 4
    engine.on_step = None
    worker.generate(samples, params)
    assert all(s.response_text == " ".join(map(str, s.response_ids)) for s in samples)
    assert all(len(s.response_ids) == 5 and s.versions == [0, 0, 4, 4, 4] for s in samples)


def test_an_abort_also_returns_the_batches_not_yet_started():
    engine = BuiltinEngine(tiny_model(std=0.3), [EOS], 0, max_batch_size=2)
    engine.on_step = at_step(2, engine.abort)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    samples = run(engine, prompts(5), params)
    assert [len(s.response_ids) for s in samples] == [2, 2, 0, 0, 0]
    assert all(s.status is Status.ABORTED and s.finish_reason == "abort" for s in samples)
    engine.on_step = None
    engine.generate(samples, params)
    assert all(s.status is Status.FINISHED and len(s.response_ids) == 5 for s in samples)


def test_per_sample_caps_and_decoding_past_eos_count_the_response_to_its_first_eos():
    class Tokenizer:
        eos_token_id = EOS

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(str(i) for i in ids if i != EOS)

    model = tiny_model(std=0.3)
    params = SamplingParams(max_new_tokens=12, decode_past_eos=True)
    samples = make_groups([Prompt(text="p")] * 6, prompts(6), 2)
    for i, s in enumerate(samples):
        s.max_new_tokens = [3, 12, 7, 40][i % 4]  # 40: above the call's cap, which still applies
    worker = RolloutWorker(BuiltinEngine(model, [EOS], pad_token_id=0, seed=1), Tokenizer())
    worker.generate(samples, params)
    assert [len(s.response_ids) for s in samples] == [[3, 12, 7, 12][i % 4] for i in range(12)]
    past = [s for s in samples if EOS in s.response_ids[:-1]]
    assert past, "some response must run past an EOS for this test to mean anything"
    for s in samples:
        end = s.response_ids.index(EOS) + 1 if EOS in s.response_ids else len(s.response_ids)
        assert s.loss_mask == [1] * end + [0] * (len(s.response_ids) - end)
        assert s.response_text == Tokenizer().decode(s.response_ids[:end])
        assert len(s.logprobs) == len(s.versions) == len(s.response_ids)


@pytest.mark.slow  # Inductor compiles for about a minute: rollout.compile is opt-in
@pytest.mark.parametrize("engine_cls", [BuiltinEngine, PagedEngine])
def test_compiled_decode_gives_the_eager_tokens_and_the_trainers_logprobs(engine_cls):
    """rollout.compile: decode steps through torch.compile. Batches of changing size and cache
    length (rows finish at EOS, a second call) must keep the eager tokens and logprobs."""
    eager = engine_cls(tiny_model(std=0.3), [EOS], pad_token_id=0, seed=3)
    compiled = engine_cls(tiny_model(std=0.3), [EOS], pad_token_id=0, seed=3, compile=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    for ids, n in ((prompts(5), 2), (prompts(3, seed=1), 3)):
        expected, got = run(eager, ids, params, n), run(compiled, ids, params, n)
        assert [s.response_ids for s in got] == [s.response_ids for s in expected]
        for s in got:
            with torch.no_grad():
                recomputed = full_forward_logprobs(eager.model, s.prompt_ids, s.response_ids)
            assert_same_logprobs(s.logprobs, recomputed, eager.model, [s])
    assert compiled.model._decode_layers is not None


def test_compile_without_a_cpp_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(TandemError, match="needs a C\\+\\+ compiler"):
        BuiltinEngine(tiny_model(), [EOS], pad_token_id=0, compile=True)


@pytest.mark.parametrize("engine_cls", [BuiltinEngine, PagedEngine])
def test_a_one_row_bf16_decode_on_the_matrix_vector_kernel_gives_the_trainers_logprobs(
    engine_cls, monkeypatch
):
    """One row in bf16 on the CPU: the engine may run its matmuls on PyTorch's own matrix-vector
    kernel instead of oneDNN (`tandem.model.gemv`, chosen by measuring); forced on here, so the
    path runs on every CPU. Its logprobs are the trainer's full forward's, to bf16 rounding."""
    from tandem.model import gemv

    monkeypatch.setattr(gemv, "native_gemv_faster", lambda dtype: True)
    used = []
    real = gemv.onednn
    monkeypatch.setattr(gemv, "onednn", lambda enabled: used.append(enabled) or real(enabled))
    model = tiny_model(std=0.3).to(torch.bfloat16)
    engine = engine_cls(model, [EOS], pad_token_id=0, seed=3)
    (s,) = run(engine, prompts(1), SamplingParams(temperature=1.0, max_new_tokens=12), 1)
    assert used and not any(used)  # the decode steps ran with oneDNN off
    assert torch.backends.mkldnn.enabled  # and it is back on after them
    with torch.no_grad():
        recomputed = full_forward_logprobs(model, s.prompt_ids, s.response_ids)
    assert_same_logprobs(s.logprobs, recomputed, model, [s], dtype=torch.bfloat16)


@pytest.mark.parametrize("engine_cls", [BuiltinEngine, PagedEngine])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_weights_follow_every_update_and_a_sleep(engine_cls, dtype):
    """On the CPU the engine also keeps its linear weights packed for oneDNN
    (`tandem.model.packed`), made again after each update: four rows a step (past the matrix-vector
    kernel's two) multiply by them, and after a push, and after a sleep and the push that wakes it,
    their logprobs are the new weights' full forward's, not the weights packed at the start."""
    from tandem.model.packed import PackedLinear, packed_bytes, packing_available

    if not packing_available(dtype, torch.device("cpu")):
        pytest.skip(f"this PyTorch or CPU packs no {dtype} weights for oneDNN")
    engine = engine_cls(tiny_model(seed=0, std=0.3).to(dtype), [EOS], pad_token_id=0, seed=3, pack=True)
    assert engine.packed and isinstance(engine.model.lm_head, PackedLinear)
    auto = engine_cls(tiny_model().to(dtype), [EOS], pad_token_id=0)  # rollout.pack_weights=null
    assert auto.packed == (dtype == torch.bfloat16)
    held = packed_bytes(engine.model)
    assert held > 0 and engine.engine_bytes() >= held
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    for version, seed in ((1, 1), (2, 2)):
        new = tiny_model(seed=seed, std=0.3).to(dtype)
        if version == 2:
            assert engine.sleep()["memory/engine_bytes"] >= held and packed_bytes(engine.model) == 0
        engine.load_weights(new.named_parameters(), version)
        samples = run(engine, prompts(4, seed=seed), params, 1)
        for s in samples:
            with torch.no_grad():
                recomputed = full_forward_logprobs(new, s.prompt_ids, s.response_ids)
            assert_same_logprobs(s.logprobs, recomputed, new, [s], dtype=dtype)
