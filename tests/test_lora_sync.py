"""LoRA weight sync: a push carries the adapters only, planned alike by the trainer and by the
engines from the model's config; the built-in engines merge what arrives into their (fused,
compiled, FP8) weights and then serve the trainer's policy, under every rollout.on_update; over
both transports on Ray, and through `tandem train train.lora.rank=8`."""

import copy
import dataclasses
import json

import pytest
import torch
from helpers import (
    EOS,
    TINY,
    VOCAB,
    prompts,
    random_samples,
    run,
    stepwise_logprobs,
    tiny_config,
    tiny_model,
)
from test_lora import LORA, lora_worker, trained

from tandem import devices
from tandem.config import LoraConfig
from tandem.model.checkpoint import load_model
from tandem.model.config import resolve_model_path
from tandem.model.decoder import CausalLM, init_weights
from tandem.model.fp8 import Fp8Linear, quantize_model
from tandem.model.lora import adapter_names, adapter_shapes, apply_lora, merge_lora, merged, merged_weights
from tandem.rollout.engine import BuiltinEngine
from tandem.rollout.paged_engine import PagedEngine
from tandem.runtime.startup import load_config
from tandem.sample import SamplingParams, Status
from tandem.sync import BucketPlan, StagingBuffer, pack_bucket
from tandem.sync.bucket import collect
from tandem.train.batch import sequence_logprobs
from tandem.train.worker import TrainWorker

ENGINES = {
    "builtin": lambda model, **kw: BuiltinEngine(model, [EOS], 0, **kw),
    # small blocks, few sequences at once: continuous batching and block boundaries in a short call
    "paged": lambda model, **kw: PagedEngine(model, [EOS], 0, num_kv_blocks=64, block_size=4, **kw),
}
KB = 1 / 1024  # in MB: buckets of a few KB, so a push of the tiny adapters takes several
ALL = LoraConfig(rank=4, alpha=8.0, target_modules="all-linear", modules_to_save=["lm_head"])
HEAD = dataclasses.replace(
    LORA, target_modules=[*LORA.target_modules, "lm_head"]
)  # tied: Tinker's train_unembed
ATOL = 5e-5  # fp32 engine against the trainer's recompute (tests/test_engine_contract.py's bound)


def untied(seed: int = 0) -> CausalLM:
    """tiny_model's shapes with an lm_head of its own, which modules_to_save may train whole."""
    model = CausalLM(dataclasses.replace(tiny_config(), tie_word_embeddings=False))
    init_weights(model, seed, std=0.1)
    return model


def engine_for(name: str, lora: LoraConfig = LORA, model: CausalLM | None = None, **kw):
    """A LoRA engine on a copy of the trainer's base (tiny_model(0)), at version 0."""
    return ENGINES[name](copy.deepcopy(model) if model is not None else tiny_model(), lora=lora, **kw)


def plans(trainer: TrainWorker, engine, dtype: torch.dtype = torch.float32) -> tuple[BucketPlan, BucketPlan]:
    """The sender's and the receiver's plans, as the actors build them (`actors._plan`)."""
    sender = BucketPlan.from_named_tensors(trainer.pushed_weights(), 4 * KB, 2 * KB, dtype)
    receiver = BucketPlan.from_named_tensors(engine.named_weights().items(), 4 * KB, 2 * KB, dtype)
    return sender, receiver


def push(trainer: TrainWorker, engine, version: int, dtype: torch.dtype = torch.float32) -> None:
    """What a push does between the actors, less the transport: pack every bucket of the trainer's
    push, stage it on the engine's side, and hand the engine the swap as its pending update."""
    sender, receiver = plans(trainer, engine, dtype)
    receiver.check_same_layout(sender)
    staging, tensors = StagingBuffer(receiver), collect(sender, trainer.pushed_weights())
    for i in range(sender.num_buckets):
        staging.write(pack_bucket(sender, i, tensors, version))
    params = engine.named_weights()
    engine.set_pending_update(version, lambda: staging.swap_into(params, version))


def served(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in engine.model.named_parameters()}


def policy(trainer: TrainWorker) -> CausalLM:
    """The trainer's policy as one plain fp32 model, its adapters merged."""
    return merge_lora(copy.deepcopy(trainer.model)).float().requires_grad_(False)


def recompute(model: CausalLM, samples) -> list[torch.Tensor]:
    """The trainer's logprob of every response token under `model` (fp32)."""
    logp = sequence_logprobs(model, samples, 4096, 1.0)
    return [row[: len(s.response_ids)] for s, row in zip(samples, logp, strict=True)]


def logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    b, t = ids.shape
    with torch.no_grad():
        return model(ids, torch.arange(t).expand(b, t), torch.ones(b, t, dtype=torch.bool))


IDS = torch.randint(3, VOCAB, (3, 10), generator=torch.Generator().manual_seed(2))


# --- the plan -------------------------------------------------------------------------------------


@pytest.mark.parametrize("lora", [LORA, ALL, LoraConfig(rank=2, target_modules=["v_proj"])], ids=str)
@pytest.mark.parametrize("name", list(ENGINES))
def test_both_sides_plan_the_adapters_alone_from_the_model_s_config(name, lora):
    """The trainer plans from its model, the engine from the config and train.lora: the same names,
    shapes and order, byte for byte, and nothing but what trains."""
    base = untied() if lora.modules_to_save else tiny_model()
    trainer = lora_worker(apply_lora(copy.deepcopy(base), lora))
    engine = engine_for(name, lora, base)
    sender, receiver = plans(trainer, engine)
    assert sender.fingerprint == receiver.fingerprint and sender.specs == receiver.specs
    assert [s.name for s in sender.specs] == adapter_names(trainer.model)
    assert {s.name: s.shape for s in sender.specs} == adapter_shapes(base.cfg, lora)
    trains = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert sender.payload_bytes == 4 * trains  # the adapters (and a head trained whole), no base
    full = BucketPlan.from_named_tensors(base.named_parameters(), 4 * KB, 2 * KB)
    assert sender.payload_bytes < full.payload_bytes / (2 if lora.modules_to_save else 4)


# --- what a push leaves in the engine ---------------------------------------------------------------


@pytest.mark.parametrize("lora", [LORA, HEAD], ids=["projections", "and-head"])
@pytest.mark.parametrize("name", list(ENGINES))
def test_an_adapter_push_lands_merged_bit_for_bit_in_the_fused_weights(name, lora):
    """fp32: every weight the engine serves is merged_weights(the trainer's model) exactly, the
    fused q|k|v and gate|up tensors included (the projections are views of them), and the engine's
    forward gives the trainer's logits; a second push replaces the first, from the base. An adapted
    head tied to the embedding becomes a weight of its own; the embedding stays the base's."""
    trainer, engine = lora_worker(apply_lora(tiny_model(), lora)), engine_for(name, lora)
    for i in range(2):
        trainer.train_step(random_samples(4, 4, seed=i))
    base = {n: t.clone() for n, t in served(engine).items()}
    for version in (1, 2):
        if version == 2:
            trainer.train_step(random_samples(4, 4, seed=7))
        push(trainer, engine, version)
        assert engine.apply_pending() == version
        expected = merged_weights(trainer.model)
        got = served(engine)
        assert got.keys() == expected.keys()
        for n, t in expected.items():
            assert torch.equal(got[n], t), n
        changed = [n for n in got if not torch.equal(got[n], base[n])]
        assert changed == [f"{t}.weight" for t in trainer.model.adapters.targets]
        for layer in engine.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
            assert torch.equal(attn.fused[0], torch.cat(qkv))
            assert torch.equal(mlp.fused[0], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        torch.testing.assert_close(logits(engine.model, IDS), logits(trainer.model, IDS), rtol=0, atol=1e-5)


def test_a_head_trained_whole_arrives_as_it_is_and_all_linear_adapters_merge():
    trainer = lora_worker(apply_lora(untied(), ALL))
    for i in range(2):
        trainer.train_step(random_samples(4, 4, seed=i))
    engine = engine_for("builtin", ALL, untied())
    push(trainer, engine, 1)
    engine.apply_pending()
    got, expected = served(engine), merged_weights(trainer.model)
    assert not torch.equal(got["lm_head.weight"], untied().lm_head.weight)
    assert all(torch.equal(got[n], t) for n, t in expected.items())


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("train", ["fp32", "bf16"])
@pytest.mark.parametrize("rollout", list(DTYPES))
@pytest.mark.parametrize("name", list(ENGINES))
def test_the_engine_serves_the_checkpoint_s_base_in_rollout_dtype_with_the_adapters_merged_once(
    name, rollout, train
):
    """What a LoRA engine serves, in every rollout.dtype x train.dtype the config accepts: the
    checkpoint's weights cast once to rollout.dtype, each adapted one W0 + s · B @ A from the pushed
    (rollout.dtype) adapters in fp32, rounded once (`merged`). Never the trainer's compute copy: a bf16
    trainer's base is the checkpoint's too (on the landed code a ddp bf16 trainer rounded it, and
    its checkpoints and exports carried the rounded base)."""
    r, t = DTYPES[rollout], DTYPES[train]
    checkpoint = {n: w.detach().clone() for n, w in tiny_model().named_parameters()}
    trainer = trained(2, dtype=t)
    engine = engine_for(name, model=tiny_model().to(r))
    push(trainer, engine, 1, r)
    engine.apply_pending()
    got, params = served(engine), dict(trainer.model.named_parameters())
    targets = trainer.model.adapters.targets
    assert got.keys() == checkpoint.keys()
    for n, w0 in checkpoint.items():
        module = n.removesuffix(".weight")
        if module in targets:
            a, b = (params[f"{module}.lora_{x}.weight"].to(r) for x in "AB")
            expected = merged(w0.to(r), a, b, LORA.alpha / LORA.rank).to(r)
        else:
            expected = w0.to(r)
        assert got[n].dtype == r and torch.equal(got[n], expected), n
    base = trainer.full_weights()
    assert all(torch.equal(base[n].float(), w0) for n, w0 in checkpoint.items())


def test_an_fp8_engine_quantises_the_merged_weights():
    trainer = trained(2)
    engine = engine_for("builtin", quantization="fp8")
    push(trainer, engine, 1)
    engine.apply_pending()
    reference = quantize_model(merge_lora(copy.deepcopy(trainer.model)).eval().requires_grad_(False))
    ours = dict(engine.model.named_modules())
    for name, m in reference.named_modules():
        if isinstance(m, Fp8Linear):
            assert torch.equal(ours[name].qweight.float(), m.qweight.float()), name
            assert torch.equal(ours[name].scales, m.scales), name
    torch.testing.assert_close(logits(engine.model, IDS), logits(reference, IDS), rtol=0, atol=0)


@pytest.mark.slow  # torch.compile builds its C++ kernels: a minute on two cores
def test_a_compiled_engine_decodes_with_the_merged_weights():
    trainer, engine = trained(2), engine_for("builtin", compile=True)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    run(engine, prompts(3), params)  # compiled on the base's weights, then merged into in place
    push(trainer, engine, 1)
    samples = run(engine, prompts(3), params, seeds=[0, 1, 2])
    for s, expected in zip(samples, recompute(policy(trainer), samples), strict=True):
        assert s.versions == [1] * 6
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, rtol=0, atol=ATOL)


# --- logprobs ---------------------------------------------------------------------------------------


def mismatch(engine, trainer: TrainWorker, seed: int) -> torch.Tensor:
    """|behaviour logprob - the trainer's recompute| of every token of 24 sampled responses."""
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    samples = run(engine, prompts(8, seed), params, n=3, seeds=list(range(24)))
    recomputed = trainer.compute_logprobs(samples)
    gaps = [torch.tensor(s.logprobs) - r[: len(s.logprobs)] for s, r in zip(samples, recomputed, strict=True)]
    return torch.cat(gaps).abs()


@pytest.mark.parametrize("name", list(ENGINES))
def test_behaviour_logprobs_with_an_adapter_equal_the_trainer_s_recompute(name):
    """fp32: within the engines' usual bound. bf16: the merged weight is rounded once, where the
    trainer adds the base's and the adapter's products apart; the mismatch stays what the same
    engine's is on the base (no adapter, the same dtypes)."""
    trainer = trained(3)
    engine = engine_for(name)
    push(trainer, engine, 1)
    assert mismatch(engine, trainer, 0).max() < ATOL
    bf16 = lora_worker(copy.deepcopy(trainer.model), dtype=torch.bfloat16)
    engine = engine_for(name, model=tiny_model().bfloat16())
    push(bf16, engine, 1, torch.bfloat16)
    on = mismatch(engine, bf16, 1)
    # the same model and dtypes, no adapter: a full-weights trainer and engine on the base
    off = mismatch(ENGINES[name](tiny_model().bfloat16()), lora_worker(tiny_model(), dtype=torch.bfloat16), 1)
    # max and mean here: 1.9e-2, 4.5e-3 with the adapter; 1.5e-2, 3.4e-3 without
    figures = [f"{x:.1e}" for x in (on.max(), on.mean(), off.max(), off.mean())]
    assert on.mean() < 2 * off.mean() and on.max() < 2 * off.max(), figures


@pytest.mark.parametrize("lora", [LORA, HEAD], ids=["projections", "and-head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(ENGINES))
def test_deterministic_lora_keeps_the_behaviour_logprobs_the_trainer_s_bit_for_bit(name, dtype, lora):
    """run.deterministic: the trainer's batch-invariant forward multiplies by the merged weight the
    engine merges (W0 + s · B @ A in fp32, rounded once), so after a push of trained adapters every
    behaviour logprob equals the recompute exactly, in bf16 as in fp32 (without the invariant
    forward the bf16 gap is ~2e-2, the test above)."""
    trainer = lora_worker(apply_lora(tiny_model(), lora), dtype=dtype)
    trainer.compute.batch_invariant = True
    for i in range(2):
        trainer.train_step(random_samples(4, 4, seed=i))
    base = tiny_model().to(dtype)
    base.batch_invariant = True
    engine = engine_for(name, lora, model=base)
    push(trainer, engine, 1, dtype)
    assert mismatch(engine, trainer, 0).max() == 0


# --- rollout.on_update ------------------------------------------------------------------------------


def staged_at(step: int, trainer: TrainWorker, engine):
    """An on_step hook: the adapter push of version 1 lands while the call decodes."""
    return lambda j: j == step and push(trainer, engine, 1)


@pytest.mark.parametrize("name", list(ENGINES))
def test_drain_finishes_on_the_base_and_the_next_call_serves_the_adapter(name):
    trainer, engine = trained(3), engine_for(name)
    engine.on_step = staged_at(2, trainer, engine)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    samples = run(engine, prompts(4), params, n=2, seeds=list(range(8)))
    assert engine.version == 0
    for s, expected in zip(samples, recompute(tiny_model(), samples), strict=True):
        assert s.versions == [0] * 8
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, rtol=0, atol=ATOL)
    engine.on_step = None
    after = run(engine, prompts(4), params, seeds=list(range(4)))
    assert engine.version == 1
    for s, expected in zip(after, recompute(policy(trainer), after), strict=True):
        assert s.versions == [1] * 8
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", list(ENGINES))
def test_abort_returns_partials_that_finish_on_the_adapter(name):
    trainer, engine = trained(3), engine_for(name, on_update="abort")
    engine.on_step = staged_at(3, trainer, engine)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    samples = run(engine, prompts(4), params, n=2, seeds=list(range(8)))
    assert engine.version == 0
    assert all(s.status is Status.ABORTED and len(s.response_ids) == 3 for s in samples)
    engine.on_step = None
    engine.generate(samples, params)
    assert engine.version == 1
    for s, expected in zip(samples, recompute(policy(trainer), samples), strict=True):
        assert s.status is Status.FINISHED and s.versions == [0] * 3 + [1] * 5
        torch.testing.assert_close(torch.tensor(s.logprobs[3:]), expected[3:], rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", list(ENGINES))
def test_continue_merges_between_two_steps(name):
    trainer, engine = trained(3), engine_for(name, on_update="continue")
    engine.on_step = staged_at(4, trainer, engine)
    samples = run(engine, prompts(3), SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True))
    assert engine.version == 1
    new = policy(trainer)
    for s in samples:
        assert s.status is Status.FINISHED and s.versions == [0] * 4 + [1] * 6
        with torch.no_grad():  # the reference: a cached decode, the new weights loaded after 4 tokens
            tokens, expected = stepwise_logprobs(tiny_model(), new, s.prompt_ids, s.response_ids, 4)
        assert s.response_ids == tokens
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, rtol=0, atol=ATOL)


# --- sleep ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ENGINES))
def test_a_sleeping_lora_engine_keeps_its_base_and_an_adapter_push_refills_the_rest(name):
    """Sleep frees what a push rewrites (the adapters, the merged weights, fused where all their
    parts are adapted) and keeps the base: after the next adapter push the sleeper serves exactly
    what an engine that never slept does."""
    lora = dataclasses.replace(LORA, target_modules=["q_proj", "o_proj", "gate_proj", "up_proj"])
    trainer = lora_worker(apply_lora(tiny_model(), lora))
    for i in range(2):
        trainer.train_step(random_samples(4, 4, seed=i))
    awake, sleeper = engine_for(name, lora, seed=3), engine_for(name, lora, seed=3)
    kept = {n: t.clone() for n, t in served(sleeper).items()}
    held = sleeper.engine_bytes()
    assert sleeper.sleep()["memory/engine_bytes"] == held > 0
    layer = sleeper.model.model.layers[0]
    freed = lambda t: t.untyped_storage().nbytes() == 0
    assert freed(layer.self_attn.o_proj.weight) and freed(layer.mlp.fused[0])  # adapted, all parts
    assert not freed(layer.self_attn.fused[0])  # q with k and v, which are not adapted
    assert not freed(layer.mlp.down_proj.weight) and not freed(sleeper.model.model.embed_tokens.weight)
    assert all(not freed(t) for t in sleeper.adapters.base.values())
    for engine in (awake, sleeper):
        push(trainer, engine, 1)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    a, b = (run(e, prompts(6), params, n=2) for e in (awake, sleeper))
    assert sleeper.engine_bytes() == held
    assert [(s.response_ids, s.logprobs, s.versions) for s in a] == [
        (s.response_ids, s.logprobs, s.versions) for s in b
    ]
    got, down = served(sleeper), "model.layers.0.mlp.down_proj.weight"
    assert all(torch.equal(got[n], t) for n, t in merged_weights(trainer.model).items())
    assert torch.equal(got[down], kept[down])


# --- on Ray -----------------------------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize(
    "transport, engine, strategy",
    [
        ("object_store", "builtin", "ddp"),
        ("broadcast", "paged", "ddp"),
        ("object_store", "paged", "fsdp2"),
        ("broadcast", "builtin", "fsdp2"),
    ],
)
def test_adapter_pushes_arrive_bit_for_bit_over_each_transport(transport, engine, strategy):
    """The actors' path: trainer ranks (fsdp2: two, each tensor gathered from the shards) push the
    adapters alone; the engine merges them into exactly merged_weights of the trainer's model."""
    import ray

    from tandem.runtime.cluster import RayCluster

    workers = 2 if strategy == "fsdp2" else 1
    overrides = [
        *TINY,
        "train.lora.rank=8",
        "rollout.dtype=float32",
        f"rollout.engine={engine}",
        f"sync.transport={transport}",
        f"train.strategy={strategy}",
        f"train.num_workers={workers}",
        "sync.produce_bucket_mb=0.01",  # several buckets
        "sync.consume_bucket_mb=0.005",
    ]
    cfg = load_config(None, overrides)
    cluster = RayCluster.start(devices.resolve(cfg, 0))
    try:
        trainers, rollout = cluster.trainers, cluster.rollouts[0]
        ray.get([t.train_step.remote(random_samples(4, 4)) for t in trainers])
        trained_weights = ray.get([t.weights.remote() for t in trainers])[0]
        sends = [t.send_weights.remote(1) for t in trainers]
        handle = sends[0] if transport == "object_store" else None
        ray.get([*sends, rollout.receive_weights.remote(handle, 1)], timeout=60)
        assert ray.get(rollout.apply_pending.remote()) == 1
        version, pushed = ray.get(rollout.weights.remote())
        _, got = ray.get(rollout.weights.remote(served=True))
        # the trainer's policy, from its gathered weights and the adapters' scaling
        model = apply_lora(load_model(resolve_model_path(cfg.model.path)), cfg.train.lora)
        names = adapter_names(model)
        assert version == 1 and list(pushed) == names
        assert all(torch.equal(pushed[n], trained_weights[n]) for n in names)
        if transport == "object_store":
            sent = ray.get(sends[0])[0]
            assert [s.name for s in sent.specs] == names  # the push's bytes: the adapters, nothing else
        expected = merged_weights(model, trained_weights)
        assert got.keys() == expected.keys()
        for n, t in expected.items():
            assert torch.equal(got[n], t), n
    finally:
        cluster.close()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_tandem_train_with_lora_pushes_versions_to_the_engine(tmp_path):
    """`tandem train train.lora.rank=8 run.steps=2` on the default task: the rollout worker serves
    each pushed version (sync mode: every token of a step's samples is of the trainer's version, the
    last validation of version 2) and it is the trainer's policy (fp32: the behaviour logprobs are
    the recompute's to float error; an engine left on the base is 1e-2 off at step 2)."""
    from tandem.cli.main import main

    args = ["train", f"run.out_dir={tmp_path}", "run.progress=false", "run.steps=2", "run.val_every=2"]
    assert main([*args, "train.lora.rank=8", "train.dtype=float32", "data.val_size=64"]) == 0
    lines = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "timing_s/train" in r]
    vals = [r for r in lines if "val/accuracy" in r]
    assert len(steps) == 2 and all(r["staleness/max"] == 0 for r in steps)
    assert all(r["mismatch/logprob_abs_diff_max"] < 1e-4 for r in steps), steps
    assert [r["val/version"] for r in vals][-1] == 2
