"""The batch-invariant forward (`CausalLM.batch_invariant`): a token's logits and logprobs are
bit-identical (torch.equal) whatever else is in the batch, wherever its row sits, and whichever
path computes them — the trainer's padded and packed forwards, left-padded prefill and decode on
the contiguous KVCache, prefill, chunked prefill and decode on the paged cache — in fp32 and bf16;
and both built-in engines' behaviour logprobs equal the trainer's recompute bit for bit.

With the mode off these equalities fail (the default kernels pick their reduction order by shape):
`test_mode_off_is_not_batch_invariant` keeps that visible. The paths are those of
`tandem.model.invariance`, the self-test a deterministic run starts with; it runs here on the
shipped model's shapes too, and at thread counts this machine does not have cores for (the kernels
pick their split between threads by the count, not by the cores).
"""

import copy
import random

import pytest
import torch
from helpers import EOS, VOCAB, prompts, random_samples, run, tiny_model, train_worker

from tandem.determinism import check_batch_invariance
from tandem.errors import TandemError
from tandem.model import batch_invariant as bi
from tandem.model.config import ModelConfig, resolve_model_path
from tandem.model.decoder import CausalLM
from tandem.model.invariance import (
    Paged,
    first_difference,
    kv_cache_logits,
    packed_logits,
    padded_logits,
    probe_model,
)
from tandem.model.logprobs import TokenScores, token_logprobs
from tandem.model.packed import packing_available
from tandem.rollout.engine import BuiltinEngine
from tandem.rollout.paged_engine import PagedEngine
from tandem.runtime.startup import load_config
from tandem.sample import SamplingParams
from tandem.train.batch import sequence_logprobs

# Every path at 13 batch sizes in two dtypes: minutes where bf16 matmuls are emulated (AVX2 CPUs).
pytestmark = pytest.mark.integration

SIZES = [1, 2, 3, 4, 5, 7, 8, 12, 16, 31, 33, 48, 64]  # batch sizes every path is checked at
DTYPES = [torch.float32, torch.bfloat16]
TARGET = [int(t) for t in torch.randint(3, VOCAB, (24,), generator=torch.Generator().manual_seed(1))]
PROMPT = 9  # the target's prompt length where a path needs one


def model_in(dtype: torch.dtype, on: bool = True) -> CausalLM:
    model = tiny_model(std=0.3).to(dtype).eval().requires_grad_(False)
    model.batch_invariant = on
    return model


def others(n: int, rng: random.Random, longest: int = 40) -> list[list[int]]:
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, longest))] for _ in range(n)]


@pytest.fixture(scope="module", params=DTYPES, ids=["fp32", "bf16"])
def setup(request):
    """The model and the target's reference logits (T, V): alone, one padded row."""
    model = model_in(request.param)
    return model, padded_logits(model, [TARGET])[0]


def test_trainer_forwards_padded_and_packed(setup):
    model, ref = setup
    rng = random.Random(0)
    for n in SIZES:
        rows = others(n, rng)
        at = rng.randrange(n)
        rows[at] = TARGET
        assert torch.equal(padded_logits(model, rows)[at, : len(TARGET)], ref), f"padded, batch of {n}"
        start = sum(map(len, rows[:at]))
        assert torch.equal(packed_logits(model, rows)[start : start + len(TARGET)], ref), (
            f"packed, batch of {n}"
        )


def test_prefill_and_decode_on_the_kv_cache(setup):
    model, ref = setup
    rng = random.Random(1)
    decode = len(TARGET) - PROMPT
    for n in SIZES:
        prompts = others(n, rng, 20)
        at = rng.randrange(n)
        prompts[at] = TARGET[:PROMPT]
        steps = [[rng.randrange(3, VOCAB) for _ in range(n)] for _ in range(decode)]
        for j, tokens in enumerate(steps):
            tokens[at] = TARGET[PROMPT + j]
        got = torch.stack([logits[at] for logits in kv_cache_logits(model, prompts, steps)])
        assert torch.equal(got, ref[PROMPT - 1 :]), f"batch of {n}"


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_chunked_prefill_and_decode_on_the_paged_cache(setup, block_size):
    model, ref = setup
    rng = random.Random(2)
    for n in SIZES:
        prompts = others(n, rng, 20)
        at = rng.randrange(n)
        prompts[at] = TARGET[:PROMPT]
        paged = Paged(model, n, 20 + len(TARGET), block_size, rng)
        # The prompts in chunks: the first `cut` tokens of each, then the rest (a chunked prefill).
        cuts = [rng.randint(0, len(p) - 1) for p in prompts]
        first = [(i, p[:c], 0) for i, (p, c) in enumerate(zip(prompts, cuts, strict=True)) if c]
        if first:
            paged.step(first)
        logits = paged.step([(i, p[c:], c) for i, (p, c) in enumerate(zip(prompts, cuts, strict=True))])
        got = [logits[at]]
        lengths = [len(p) for p in prompts]
        for j in range(len(TARGET) - PROMPT):
            tokens = [rng.randrange(3, VOCAB) for _ in range(n)]
            tokens[at] = TARGET[PROMPT + j]
            got.append(paged.step([(i, [tok], lengths[i]) for i, tok in enumerate(tokens)])[at])
            lengths = [x + 1 for x in lengths]
        assert torch.equal(torch.stack(got), ref[PROMPT - 1 :]), f"batch of {n}"


def test_trainer_logprobs_equal_the_logprobs_of_the_logits(setup):
    """sequence_logprobs (the trainer's scoring: lm_head and log_softmax in chunks, packed or padded
    micro-batches of any budget) equals token_logprobs of the full forward's logits."""
    model, ref = setup
    samples = random_samples(8, 8, seed=3)  # 64 samples
    for s in samples:
        s.prompt_ids, s.response_ids = TARGET[:PROMPT], TARGET[PROMPT:]
        break
    expected = token_logprobs(ref[PROMPT - 1 : -1], torch.tensor(TARGET[PROMPT:]))
    for budget in (20, 200, 10_000):
        for pad in (None, 0):
            got = sequence_logprobs(model, samples, budget, pad_token_id=pad)[0]
            assert torch.equal(got, expected), f"budget {budget}, padded {pad is not None}"


SHIPPED = ModelConfig.load(resolve_model_path("builtin:addition"))  # vocabulary 261: an odd weight


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_the_shipped_models_shapes_through_every_path(dtype):
    """The default task's model shapes (hidden 256, 4 query / 2 key heads, vocabulary 261), at this
    machine's thread count: one sequence bit-identical through every path and batch size."""
    assert first_difference(probe_model(SHIPPED, dtype, "cpu"), [torch.get_num_threads()]) is None


def test_an_engine_and_a_trainer_at_different_thread_counts_agree():
    """An engine on 16 threads and a trainer on 1 (placement gives roles different shares). On the
    landed row-padding forward, MKL split the 261 logit columns between 16 threads so that the last
    ones took another kernel (measured on an AMD EPYC): the engine's logits differed from the
    trainer's. Padding a weight's rows to COL_TILE keeps every column in the same kernel."""
    assert first_difference(probe_model(SHIPPED, torch.float32, "cpu"), [16]) is None


def nudged_last_column(out: torch.Tensor) -> torch.Tensor:
    """`out` with its last column moved one float step up: a result no reduction order explains."""
    out = out.clone()
    out[:, -1] = torch.nextafter(out[:, -1], torch.full_like(out[:, -1], float("inf")))
    return out


# Kernels that break the mode's promise on purpose, whatever this machine's BLAS does: the refusal
# must not hope for a CPU whose kernels misbehave (the landed test relied on MKL splitting 261 logit
# columns between 16 threads on an AMD EPYC, which an Intel Xeon with AMX does not do).
FAULTS = {
    # another result when the call holds more than one row: depends on the batch
    "batch": (
        lambda mm: (
            lambda x, w, *packed: (
                nudged_last_column(mm(x, w, *packed)) if x.shape[0] > 1 else mm(x, w, *packed)
            )
        ),
        "batch of",
    ),
    # another result on more than one thread: depends on the thread count
    "threads": (
        lambda mm: (
            lambda x, w, *packed: (
                nudged_last_column(mm(x, w, *packed)) if torch.get_num_threads() > 1 else mm(x, w, *packed)
            )
        ),
        "16 thread",
    ),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_deterministic_run_refuses_kernels_that_are_not_batch_invariant(monkeypatch, fault, dtype):
    """The start-up self-test, on a matmul that depends on the batch or on the thread count (injected:
    `tiled_mm` wrapped): one paragraph naming the path, not a run with a silent mismatch."""
    overrides = ["run.deterministic=true", "run.device=cpu", f"train.dtype={dtype}", f"rollout.dtype={dtype}"]
    cfg = load_config(None, overrides)
    assert check_batch_invariance(cfg, [1, 16]) >= 0  # passes as built
    wrap, where = FAULTS[fault]
    monkeypatch.setattr(bi, "tiled_mm", wrap(bi.tiled_mm))
    with pytest.raises(TandemError, match=f"not batch-invariant.*{where}"):
        check_batch_invariance(cfg, [1, 16])


def test_mode_off_is_not_batch_invariant():
    """What the mode fixes: with the default kernels a decode step against the cache differs from
    the full forward, and packed rows change with the batch (both on every CPU measured: AMD EPYC
    with AVX2 and with AVX512, Intel Xeon with AMX). Whether padded rows change with the batch
    depends on the CPU's BLAS (they do not on an AVX2 EPYC), so it is not asserted."""
    for dtype in DTYPES:
        model = model_in(dtype, on=False)
        ref = padded_logits(model, [TARGET])[0]
        rng = random.Random(0)
        packed = 0
        for n in SIZES:
            rows = others(n, rng)
            at = rng.randrange(n)
            rows[at] = TARGET
            start = sum(map(len, rows[:at]))
            packed += not torch.equal(packed_logits(model, rows)[start : start + len(TARGET)], ref)
        steps = [[t] for t in TARGET[PROMPT:]]
        decoded = torch.stack([x[0] for x in kv_cache_logits(model, [TARGET[:PROMPT]], steps)])
        assert packed and not torch.equal(decoded, ref[PROMPT - 1 :])


# ---------------------------------------------------------------- end to end: engines vs trainer


def engine_samples(engine, count: int, group: int, seed: int):
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    return run(engine, prompts(count, seed, longest=11), params, group)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_engine_logprobs_equal_the_trainers_bit_for_bit(dtype):
    """BuiltinEngine (batches of 1, 3 and 64) and PagedEngine (continuous batching, chunked prefill,
    a group's shared prompt, the prefix cache, preemption, the CUDA graphs' decode) sample 64
    responses; the TrainWorker's recompute (fp32 masters, compute in `dtype`) gives exactly their
    behaviour logprobs."""
    trainer = train_worker(tiny_model(std=0.3), train=dict(micro_batch_tokens=300), dtype=dtype)
    trainer.compute.batch_invariant = True
    engines = [BuiltinEngine(model_in(dtype), [EOS], 0, max_batch_size=b, seed=b) for b in (1, 3, 64)] + [
        PagedEngine(model_in(dtype), [EOS], 0, block_size=4, max_num_batched_tokens=24, seed=5),
        # preemption, the prefix cache off: with it on, see the known failure below
        PagedEngine(
            model_in(dtype),
            [EOS],
            0,
            block_size=4,
            num_kv_blocks=24,
            max_num_seqs=8,
            seed=6,
            prefix_caching=False,
        ),
        # the CUDA graphs' padded, fixed-shape decode (run eagerly on the CPU), bucket-padded rows
        PagedEngine(model_in(dtype), [EOS], 0, block_size=4, max_num_seqs=6, cuda_graphs=True, seed=7),
    ]
    for i, engine in enumerate(engines):
        samples = engine_samples(engine, 16, 4, seed=i)
        recomputed = trainer.compute_logprobs(samples)
        for s, row in zip(samples, recomputed, strict=True):
            got = torch.tensor(s.logprobs)
            assert torch.equal(got, row[: len(got)]), f"engine {i} ({type(engine).__name__})"
    assert engines[-2].num_preemptions > 0 and engines[-1].runner.graphs.num_steps > 0


@pytest.mark.skipif(not packing_available(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 here")
def test_the_engines_packed_weights_multiply_its_tiles_and_keep_the_trainers_logprobs(monkeypatch):
    """A bf16 engine keeps its weights packed for oneDNN; in the batch-invariant mode its tiles
    multiply by those copies where oneDNN gives torch.mm's result bit for bit (`packed.same_as_mm`),
    and its logprobs stay the trainer's, which multiplies the plain weights (in whole tiles but
    the last rows, as the engine's few rows: in a smaller call where it gives a tile's bits)."""
    calls = []
    multiply = bi.packing.multiply
    monkeypatch.setattr(bi.packing, "multiply", lambda x, w, *b: calls.append(x.shape) or multiply(x, w, *b))
    trainer = train_worker(tiny_model(std=0.3), train=dict(micro_batch_tokens=300), dtype=torch.bfloat16)
    trainer.compute.batch_invariant = True
    engine = BuiltinEngine(model_in(torch.bfloat16), [EOS], 0, seed=3)
    assert engine.packed
    samples = engine_samples(engine, 16, 4, seed=3)
    tiles = {rows for rows, _ in calls}
    assert calls and tiles <= {bi.row_tile(torch.bfloat16), *bi.SUB_TILES}
    for s, row in zip(samples, trainer.compute_logprobs(samples), strict=True):
        assert torch.equal(torch.tensor(s.logprobs), row[: len(s.logprobs)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batchs_rows_take_fewer_calls_only_where_they_give_a_tiles_bits(monkeypatch, dtype):
    """`tiled_mm` multiplies its whole tiles up to MERGED_TILES a call where the probe
    (`tiles_free`) finds that exact here, and the rows after them in the smallest call
    `rows_exact` finds exact, else in a whole tile: either way every row's bits are those of a
    whole tile's call. Forced to find neither exact, it falls back to one call a whole tile."""
    gen = torch.Generator().manual_seed(0)
    tile = bi.row_tile(dtype)
    tiles = bi.MERGED_TILES + 2  # one call of MERGED_TILES tiles, one of 2, then the last rows
    x = torch.randn(tiles * tile + 20, 96, generator=gen).to(dtype)
    weight = torch.randn(130, 96, generator=gen).to(dtype)  # padded to 192 columns
    padded = torch.cat([weight, weight.new_zeros(62, 96)])
    starts = range(0, x.shape[0], tile)
    whole = torch.cat([torch.mm(bi.pad_rows(x[i : i + tile], tile), padded.t()) for i in starts])
    expected = whole[: x.shape[0], :130]
    threads = torch.get_num_threads()
    last = next((r for r in (32, 64) if bi.rows_exact(192, 96, dtype, r, "cpu", threads)), tile)
    assert bi.calls(x.shape[0], 192, 96, dtype, x.device) == [tile] * tiles + [last]
    assert torch.equal(bi.tiled_mm(x, weight), expected)
    monkeypatch.setattr(bi, "rows_exact", lambda *_: False)
    monkeypatch.setattr(bi, "tiles_free", lambda *_: False)
    assert bi.calls(x.shape[0], 192, 96, dtype, x.device) == [tile] * (tiles + 1)
    assert torch.equal(bi.tiled_mm(x, weight), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_in_one_call_a_key_tile_equals_one_call_a_query_tile(monkeypatch, dtype):
    """`tiled_attention` multiplies all of a key tile's query tiles in one call where `rows_free`
    finds it exact here; forced not to, one call a query tile: the same bits, for a prefill of
    several sequences, a decode step and a long training row."""
    gen = torch.Generator().manual_seed(1)
    cases = [(3, 9, 40), (5, 1, 70), (1, 70, 70)]  # (sequences, query tokens, keys)
    inputs = []
    for b, t, s in cases:
        q, k, v = (torch.randn(b, h, n, 16, generator=gen).to(dtype) for h, n in ((4, t), (2, s), (2, s)))
        mask = torch.zeros(b, 1, t, s)
        mask[..., s - t :] = torch.full((t, t), float("-inf")).triu(1)
        inputs.append((q, k, v, mask))
    batched = [bi.tiled_attention(*args) for args in inputs]
    monkeypatch.setattr(bi, "rows_free", lambda *_: False)
    for args, out in zip(inputs, batched, strict=True):
        assert torch.equal(bi.tiled_attention(*args), out)


@pytest.mark.xfail(
    strict=False,  # these seeds hit it on an AVX512-BF16 EPYC; another CPU's bf16 may sample past it
    reason="known bug (found 2026-11-28): in bf16, a sequence preempted and recomputed with the "
    "prefix cache on can get logprobs off the trainer's from a later token on (1 sample in ~10 "
    "such runs, on main before then too: its seeds never hit it); docs/determinism.md",
)
def test_a_preempted_sequence_with_the_prefix_cache_keeps_the_trainers_logprobs_bf16():
    """PagedEngine with a KV budget that forces preemption and the prefix cache on, bf16, the
    batch-invariant forward: every behaviour logprob must be the trainer's recompute. These seeds
    give one sample (its response holds the pad id, then a recompute) off from token 6 on."""
    dtype = torch.bfloat16
    trainer = train_worker(tiny_model(std=0.3), train=dict(micro_batch_tokens=300), dtype=dtype)
    trainer.compute.batch_invariant = True
    engine = PagedEngine(model_in(dtype), [EOS], 0, block_size=4, num_kv_blocks=24, max_num_seqs=8, seed=6)
    samples = engine_samples(engine, 16, 4, seed=4)
    assert engine.num_preemptions > 0
    for s, row in zip(samples, trainer.compute_logprobs(samples), strict=True):
        assert torch.equal(torch.tensor(s.logprobs), row[: len(s.logprobs)])


@pytest.mark.parametrize(
    "train", [dict(mini_batch_size=8), dict(epochs=2)], ids=["2 mini-batches", "2 epochs"]
)
def test_exact_behaviour_skips_the_recompute_and_trains_as_the_recompute_does(train):
    """With several updates per step π_old is not π_θ of one forward, but on tokens the trainer's
    version sampled it is μ bit for bit: `exact_behaviour` takes μ and never recomputes, and the
    weights come out exactly as a trainer that recomputes gets them; mismatch/* is exactly 0."""
    samples = engine_samples(BuiltinEngine(model_in(torch.bfloat16), [EOS], 0, seed=1), 4, 4, seed=0)
    for s in samples:
        s.reward = float(s.response_ids[0] % 2)
    workers = []
    for exact in (True, False):
        algo, cfg = dict(corrections=["tis"]), dict(micro_batch_tokens=300, **train)
        w = train_worker(tiny_model(std=0.3), algo, cfg, dtype=torch.bfloat16, exact_behaviour=exact)
        w.compute.batch_invariant = True
        workers.append(w)
    calls = []
    recompute = workers[0].compute_logprobs
    workers[0].compute_logprobs = lambda *a, **k: calls.append(1) or recompute(*a, **k)
    m_exact, m_recomputed = (w.train_step(copy.deepcopy(samples)) for w in workers)
    assert calls == [] and m_exact["actor/old_logprob_source/behaviour"] == 1.0
    assert m_recomputed["actor/old_logprob_source/recompute"] == 1.0
    assert m_exact["mismatch/kl"] == 0.0 and m_exact["mismatch/logprob_abs_diff_max"] == 0.0
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert m_exact[key] == m_recomputed[key], key
    for (name, a), (_, b) in zip(*(w.named_weights() for w in workers), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_rows_logprob_entropy_and_gradient_are_its_own_in_any_batch(dtype):
    """The trainer's scores in the batch-invariant mode (`TokenScores`): a row's logp, entropy and
    logits gradient are the same bits alone as among 37 rows, at a real model's vocabulary. The
    entropy's row sums once ran over all rows in one call, which splits a lone row between threads
    (at 49k columns it differed in the last bits: seen on 2 Zen 4 cores)."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 49152, generator=g) * 3).to(dtype)
    tokens = torch.randint(0, 49152, (37,), generator=g)

    def scores(rows: slice):
        x = logits[rows].clone().requires_grad_(True)
        logp, entropy = TokenScores.apply(x, tokens[rows], 0.7, True)
        (logp.sum() - 0.1 * entropy.sum()).backward()
        return logp, entropy, x.grad

    together = scores(slice(None))
    for i in (0, 17, 36):
        alone = scores(slice(i, i + 1))
        for a, t in zip(alone, together, strict=True):
            assert torch.equal(a[0], t[i])
