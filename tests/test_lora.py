"""LoRA: adapters train alone (single, DDP, FSDP2, checkpointed layers), the base is the KL
reference with no copy of it, PEFT loads the saved adapter with the trainer's logits, resume is bit
for bit, and every bad setting is refused by name."""

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import (
    on_gloo_ranks,
    random_samples,
    tiny_config,
    tiny_model,
    train_worker,
    write_tiny_checkpoint,
)

from tandem.config import Config, LoraConfig
from tandem.data.tokenizer import build_char_tokenizer
from tandem.errors import TandemError
from tandem.model.checkpoint import load_model, save_model
from tandem.model.config import ModelConfig
from tandem.model.decoder import CausalLM, init_weights
from tandem.model.fuse import fuse_projections
from tandem.model.lora import (
    LoraLinear,
    adapter_names,
    adapters_off,
    apply_lora,
    fresh_adapters,
    merge_lora,
    merged,
    merged_weights,
)
from tandem.model.peft_format import adapter_state_dict, refuse_adapter_dir
from tandem.runtime.resume import check_compatible
from tandem.runtime.roles import save_hf_model
from tandem.runtime.startup import load_config
from tandem.train.state import load_state, save_state
from tandem.train.worker import TrainWorker

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = LoraConfig(rank=4, alpha=8.0)  # scaling 2: a wrong alpha / rank shows in every logit
HEAD = LoraConfig(rank=4, alpha=8.0, target_modules=[*LORA.target_modules, "lm_head"])  # train_unembed
TRAIN = dict(lr=1e-2, micro_batch_tokens=40, mini_batch_size=8)


def lora_model(seed: int = 0, lora: LoraConfig = LORA, model: CausalLM | None = None) -> CausalLM:
    return apply_lora(tiny_model(seed) if model is None else model, lora, seed=seed)


def lora_worker(model: CausalLM | None = None, algo: dict | None = None, dtype=torch.float32, **train):
    """A train worker on `model` (a fresh tiny_model with LORA's adapters if None); `train` holds
    TrainConfig fields over TRAIN's."""
    return train_worker(model or lora_model(), algo, {**TRAIN, **train}, dtype=dtype, total_updates=20)


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    b, t = ids.shape
    return model(ids, torch.arange(t).expand(b, t), torch.ones(b, t, dtype=torch.bool))


IDS = torch.randint(3, 50, (2, 12), generator=torch.Generator().manual_seed(1))


def trained(steps: int = 3, **options) -> TrainWorker:
    """A LoRA train worker after `steps` steps: every B is non-zero."""
    w = lora_worker(**options)
    for i in range(steps):
        w.train_step(random_samples(4, 4, seed=i))
    return w


# --- the adapted model ----------------------------------------------------------------------------


def test_a_fresh_adapter_computes_the_base_and_adapters_off_gives_it_exactly_after_training():
    base = tiny_model()
    fresh = lora_model()
    assert torch.equal(logits(fresh, IDS), logits(base, IDS))  # B starts at zero
    w = trained()
    with torch.no_grad():
        with adapters_off(w.model):
            off = logits(w.model, IDS)
        on = logits(w.model, IDS)
    assert torch.equal(off, logits(base, IDS))
    assert not torch.allclose(on, off, atol=1e-3)  # ...and the adapters did move the policy


def test_only_the_adapters_train_and_only_they_are_in_the_optimizer():
    w = lora_worker()
    before = {n: t.clone() for n, t in w.named_weights()}
    w.train_step(random_samples(4, 4))
    after = dict(w.named_weights())
    names = adapter_names(w.model)
    assert names == [f"{m}.{ab}.weight" for m in _targets(w.model) for ab in ("lora_A", "lora_B")]
    assert all(not torch.equal(before[n], after[n]) for n in names)
    assert all(torch.equal(before[n], after[n]) for n in after if n not in names)
    stepped = {id(p) for g in w.learner.optimizer.param_groups for p in g["params"]}
    assert stepped == {id(p) for n, p in w.model.named_parameters() if n in names}


@pytest.mark.parametrize("checkpoint", ["bf16", "fp32"])
def test_bf16_compute_keeps_the_checkpoint_s_base_and_fp32_adapter_masters(checkpoint):
    """The frozen base stays the checkpoint's bit for bit (what the engines serve and the run saves):
    a base that bf16 holds exactly (a bf16 checkpoint, as real models ship) is one bf16 copy shared by
    masters and compute copy; an fp32 one keeps its fp32 master beside the bf16 compute copy (on the
    landed code it was rounded in place under ddp and kept under fsdp2). The adapters have fp32
    masters whose steps are not rounded away."""
    base = tiny_model()
    if checkpoint == "bf16":
        base = base.bfloat16().float()  # an fp32 model holding a bf16 checkpoint's values
    expected = {n: t.detach().clone() for n, t in base.named_parameters()}
    w = lora_worker(lora_model(model=base), dtype=torch.bfloat16)
    masters, compute = w.model, w.learner.masters.compute
    shared = (
        compute.model.layers[0].self_attn.q_proj.weight is masters.model.layers[0].self_attn.q_proj.weight
    )
    assert shared == (checkpoint == "bf16")
    embed = masters.model.embed_tokens.weight
    assert embed.dtype == (torch.bfloat16 if checkpoint == "bf16" else torch.float32)
    assert compute.model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for n, p in masters.named_parameters() if n in adapter_names(masters))
    w.train_step(random_samples(4, 4))
    b = compute.model.layers[0].self_attn.q_proj.lora_B.weight
    assert b.dtype == torch.bfloat16 and torch.equal(
        b, masters.model.layers[0].self_attn.q_proj.lora_B.weight.bfloat16()
    )
    got = w.full_weights()
    for name, t in expected.items():
        assert torch.equal(got[name].float(), t), name  # the base as the checkpoint holds it


def test_gradient_checkpointing_steps_the_adapters_as_without():
    plain, checkpointed = trained(2), trained(2, gradient_checkpointing=True)
    for name, t in plain.named_weights():
        torch.testing.assert_close(dict(checkpointed.named_weights())[name], t, rtol=1e-5, atol=1e-7)


def test_the_batch_invariant_forward_multiplies_by_the_merged_weight_and_trains_the_adapters():
    """run.deterministic: each adapted linear's weight merged with its adapter (`merged`'s bits,
    what an engine serves) in the batch-invariant forward; the same steps as the plain forward's
    to float error, gradients reaching A and B. tests/test_lora_sync.py checks the engines."""
    plain, invariant = lora_worker(), lora_worker()
    invariant.compute.batch_invariant = True
    for i in range(2):
        batch = random_samples(4, 4, seed=i)
        a, b = plain.train_step(copy.deepcopy(batch)), invariant.train_step(batch)
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-4)
    for name, t in plain.named_weights():
        torch.testing.assert_close(dict(invariant.named_weights())[name], t, rtol=1e-4, atol=1e-6)
    q = invariant.compute.model.layers[0].self_attn.q_proj
    assert q.lora_B.weight.abs().max() > 0  # trained
    expected = merged(q.weight, q.lora_A.weight, q.lora_B.weight, q.scaling)
    assert torch.equal(q.merged_weight(), expected)
    with torch.no_grad():
        torch.testing.assert_close(
            logits(invariant.compute, IDS), logits(plain.compute, IDS), rtol=1e-4, atol=1e-4
        )


def test_dropout_acts_in_the_loss_forward_only():
    """PEFT's dropout on the adapters' input: on in training forwards, off in a score (π_old, the
    reference), so those are the policy itself."""
    model = lora_model(lora=dataclasses.replace(LORA, dropout=0.5))
    with torch.no_grad():
        for _, m in model.named_modules():
            if isinstance(m, LoraLinear):
                m.lora_B.weight.normal_()
    w = lora_worker(model)
    samples = random_samples(2, 2)
    once, again = w.compute_logprobs(samples), w.compute_logprobs(samples)
    assert torch.equal(once, again)
    with torch.no_grad():
        assert not torch.equal(logits(w.compute, IDS), logits(w.compute, IDS))  # training mode: dropout


def test_the_kl_reference_is_the_base_with_no_copy_of_it():
    """With LoRA the reference logprobs are the base model's, computed on the policy's own weights
    with the adapters off: the same numbers as a full-weights worker's frozen copy of the base."""
    algo = dict(kl_coef=0.1)
    w = lora_worker(algo=algo)
    assert w.ref_model is None
    for i in range(2):
        metrics = w.train_step(random_samples(4, 4, seed=i))
    assert metrics["actor/kl_loss"] > 0
    full = lora_worker(tiny_model(), algo=algo)  # no adapters: keeps a copy of the initial policy
    samples = random_samples(4, 4, seed=9)
    width = max(len(s.response_ids) for s in samples)
    assert torch.equal(w._ref_logprobs(samples, width), full.compute_logprobs(samples, full.ref_model))
    assert not torch.equal(w.compute_logprobs(samples), full.compute_logprobs(samples, full.ref_model))


def test_merge_folds_the_adapters_into_plain_linears():
    w = trained()
    expected = logits(w.model, IDS).detach()
    merged_dict = merged_weights(w.model)
    merged = merge_lora(copy.deepcopy(w.model))
    assert not any(isinstance(m, LoraLinear) for m in merged.modules())
    assert (
        set(merged_dict)
        == {n for n, _ in merged.named_parameters()}
        == {n for n, _ in tiny_model().named_parameters()}
    )
    torch.testing.assert_close(logits(merged, IDS).detach(), expected, rtol=0, atol=1e-5)
    fuse_projections(merged)  # a plain model again: the engines' paths take it
    torch.testing.assert_close(logits(merged, IDS).detach(), expected, rtol=0, atol=1e-5)


# --- PEFT -----------------------------------------------------------------------------------------


def test_the_adapter_carries_peft_names():
    """The same tensor names PEFT gives the same adapter on transformers' Qwen2, and the same shapes."""
    peft = pytest.importorskip("peft")
    hf = _hf_model(tiny_model())
    peft_model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS))
    theirs = peft.get_peft_model_state_dict(peft_model)
    ours = adapter_state_dict(lora_model())
    assert {n: t.shape for n, t in ours.items()} == {n: t.shape for n, t in theirs.items()}


@pytest.mark.parametrize("targets", [PROJECTIONS, [*PROJECTIONS, "lm_head"]], ids=["projections", "and-head"])
def test_peft_loads_the_saved_adapter_with_the_trainers_logits(tmp_path, targets):
    """After three steps (B non-zero) the step directory's adapter, loaded by PEFT into transformers'
    Qwen2 built from tandem's base checkpoint, gives the trainer's fp32 logits; so does the directory
    itself (the base's weights, the adapter beside them) through tandem's loader and through
    transformers' own, which both apply an adapter they find beside a model's weights. With an
    adapter on the LM head (Tinker's train_unembed), tied to the embedding here, too: the adapter
    adds to the head alone, and the merged checkpoint unties the two."""
    peft = pytest.importorskip("peft")
    import transformers

    save_model(tiny_model(), tmp_path / "base")
    lora = dataclasses.replace(LORA, target_modules=targets)
    w = lora_worker(lora_model(lora=lora, model=load_model(tmp_path / "base")))
    for i in range(3):
        w.train_step(random_samples(4, 4, seed=i))
    assert all(w.model.get_submodule(m).lora_B.weight.abs().sum() > 0 for m in _targets(w.model))
    assert ("lm_head" in _targets(w.model)) == ("lm_head" in targets)
    save_hf_model(w, build_char_tokenizer(), tmp_path / "step", base_path=str(tmp_path / "base"))
    config = json.loads((tmp_path / "step" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["target_modules"] == targets
    with torch.no_grad():
        expected = logits(w.compute, IDS)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").float().eval()
        loaded = peft.PeftModel.from_pretrained(hf, tmp_path / "step").eval()
        torch.testing.assert_close(loaded(input_ids=IDS).logits, expected, rtol=0, atol=1e-5)
        merged = load_model(tmp_path / "step")
        torch.testing.assert_close(logits(merged, IDS), expected, rtol=0, atol=1e-5)
        auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "step").float().eval()
        torch.testing.assert_close(auto(input_ids=IDS).logits, expected, rtol=0, atol=1e-5)
        save_model(merged, tmp_path / "merged")
        plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").float().eval()
        torch.testing.assert_close(plain(input_ids=IDS).logits, expected, rtol=0, atol=1e-5)
        assert plain.config.tie_word_embeddings == ("lm_head" not in targets)


def test_peft_loads_an_all_linear_adapter_with_a_head_trained_whole(tmp_path):
    """all-linear is written as the adapted modules' names (as PEFT writes it) and an untied
    lm_head in modules_to_save travels under PEFT's name for it."""
    peft = pytest.importorskip("peft")
    cfg = dataclasses.replace(tiny_config(), tie_word_embeddings=False)
    base = CausalLM(cfg)
    init_weights(base, 0, std=0.1)
    save_model(base, tmp_path / "base")
    lora = LoraConfig(rank=2, alpha=3.0, target_modules="all-linear", modules_to_save=["lm_head"])
    w = lora_worker(apply_lora(load_model(tmp_path / "base"), lora))
    for i in range(2):
        w.train_step(random_samples(4, 4, seed=i))
    assert "lm_head.weight" in adapter_names(w.model)
    save_hf_model(w, build_char_tokenizer(), tmp_path / "step", base_path=str(tmp_path / "base"))
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base").float().eval()
        loaded = peft.PeftModel.from_pretrained(hf, tmp_path / "step").eval()
        torch.testing.assert_close(loaded(input_ids=IDS).logits, logits(w.compute, IDS), rtol=0, atol=1e-5)


def test_tandem_loads_a_directory_of_weights_and_a_peft_adapter_as_transformers_does(tmp_path):
    """An adapter PEFT wrote (rsLoRA's scaling, B not zero) beside a base's weights: tandem's loader
    folds it in and computes what PEFT computes."""
    peft = pytest.importorskip("peft")
    save_model(tiny_model(), tmp_path / "dir")
    hf = _hf_model(tiny_model())
    config = peft.LoraConfig(
        r=4, lora_alpha=16, use_rslora=True, init_lora_weights=False, target_modules=PROJECTIONS
    )
    adapted = peft.get_peft_model(hf, config).eval()
    adapted.save_pretrained(tmp_path / "dir")
    with torch.no_grad():
        expected = adapted(input_ids=IDS).logits
        with adapted.disable_adapter():
            assert not torch.allclose(expected, adapted(input_ids=IDS).logits, atol=1e-3)
        # Folded in, not added after: another rounding of PEFT's large random B (trained ones: 1e-5).
        torch.testing.assert_close(logits(load_model(tmp_path / "dir"), IDS), expected, rtol=0, atol=1e-4)


# --- checkpoints ----------------------------------------------------------------------------------


def steps(w, first: int, count: int) -> list[dict[str, float]]:
    out = [w.train_step(random_samples(4, 4, seed=first + i)) for i in range(count)]
    return [{k: v for k, v in m.items() if not k.startswith("timing_s/")} for m in out]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_resumed_lora_worker_continues_bit_for_bit(tmp_path, dtype):
    """As tests/test_resume.py's full-weights check: two steps, save, two more equal a fresh worker
    that loads the save; the checkpoint holds the adapters and their Adam state, not the base."""
    algo = dict(entropy_coef=0.01, kl_coef=0.05)
    options = dict(warmup_steps=3, schedule="cosine", lr=1e-3, dtype=dtype)
    straight = lora_worker(algo=algo, **options)
    steps(straight, 0, 2)
    save_state(straight, tmp_path)
    after = steps(straight, 2, 2)
    resumed = lora_worker(algo=algo, **options)
    load_state(resumed, tmp_path)
    assert resumed.version == 2 and steps(resumed, 2, 2) == after
    a, b = straight.full_weights(), resumed.full_weights()
    assert all(torch.equal(a[n], b[n]) for n in a)
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(tmp_path / "trainer")).read_metadata().state_dict_metadata
    weights = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    assert weights == set(adapter_names(straight.model))


def test_a_resume_that_changes_train_lora_is_refused():
    saved = Config()
    saved.train.lora = dataclasses.replace(LORA)
    now = copy.deepcopy(saved)
    now.train.lora.rank = 8
    with pytest.raises(TandemError, match="train.lora"):
        check_compatible(saved, now, Path("ckpt"))


# --- data parallel ---------------------------------------------------------------------------------


def rank_adapters(strategy: str, extra: dict, lora: LoraConfig = LORA) -> dict:
    """One rank's LoRA train step (16 samples, two optimizer steps) -> its adapters, whole."""
    w = lora_worker(
        lora_model(lora=lora), algo=dict(kl_coef=0.1, entropy_coef=0.01), strategy=strategy, **extra
    )
    w.parallelize(torch.distributed.group.WORLD)
    metrics = w.train_step(random_samples(4, 4))
    weights = w.full_weights()
    return {"metrics": metrics, "adapters": {n: weights[n] for n in adapter_names(w.model)}}


@pytest.mark.integration  # gloo process groups of two
@pytest.mark.parametrize(
    "strategy, extra, lora",
    [
        ("ddp", {}, LORA),
        ("fsdp2", {}, LORA),
        ("fsdp2", {"gradient_checkpointing": True}, LORA),
        ("fsdp2", {}, HEAD),  # an adapter on the head too, whose weight is the sharded embedding's
    ],
    ids=["ddp", "fsdp2", "fsdp2-checkpointing", "fsdp2-head"],
)
def test_data_parallel_lora_ranks_equal_one_worker(strategy, extra, lora):
    ranks = on_gloo_ranks(2, rank_adapters, strategy, extra, lora)
    single = lora_worker(lora_model(lora=lora), algo=dict(kl_coef=0.1, entropy_coef=0.01))
    m_single = single.train_step(random_samples(4, 4))
    expected = dict(single.named_weights())
    for r in ranks:
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert r["metrics"][key] == pytest.approx(m_single[key], rel=1e-5, abs=1e-7), key
        assert set(r["adapters"]) == set(adapter_names(single.model))
        for name, value in r["adapters"].items():
            torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=2e-5)


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["train.lora.rank=-1"], r"'train.lora.rank' must be >= 0 \(0 = off"),
        (["train.lora.alpha=0"], r"'train.lora.alpha' must be > 0"),
        (["train.lora.dropout=1"], r"'train.lora.dropout' must be in \[0, 1\)"),
        (["train.lora.target_modules=q_proj"], r"'train.lora.target_modules' is 'q_proj'.*\[q_proj\]"),
        (["train.lora.target_modules=[]"], r"'train.lora.target_modules' is \[\]"),
        (
            ["train.lora.rank=4", "train.lora.dropout=0.1", "run.deterministic=true"],
            r"'train.lora.dropout' is 0.1 with run.deterministic=true.*no form",
        ),
        (
            ["train.lora.rank=4", "train.lora.modules_to_save=[lm_head]", "algo.kl_coef=0.1"],
            r"'train.lora.modules_to_save'.*no original",
        ),
        (
            ["train.lora.rank=4", "algo.kl_coef=0.1", "placement.groups=[[actor_train],ref_logp,generate]",
             "placement.ratios=[0.5,0.25,0.25]"],
            r"'placement.groups' places ref_logp.*adapters off",
        ),
    ],
)  # fmt: skip
def test_bad_lora_settings_are_refused_at_load(overrides, expected):
    with pytest.raises(TandemError, match=expected):
        load_config(None, overrides)


def test_rank_zero_is_off_and_a_lora_kl_run_places_no_reference_worker():
    from tandem.runtime.placement import role_counts

    assert load_config(None, ["train.lora.rank=0", "train.lora.alpha=4"]).train.lora.rank == 0
    assert role_counts(load_config(None, ["algo.kl_coef=0.1"]))["ref"] == 1
    assert role_counts(load_config(None, ["algo.kl_coef=0.1", "train.lora.rank=4"]))["ref"] == 0


@pytest.mark.parametrize(
    "lora, expected",
    [
        (
            LoraConfig(rank=4, target_modules=["q_proj", "qv_proj"]),
            r"'qv_proj', which matches no linear layer.*: q_proj, k_proj, v_proj, o_proj, gate_proj, "
            r"up_proj, down_proj, lm_head ",
        ),
        (LoraConfig(rank=4, modules_to_save=["lm_head"]), r"lm_head, whose weight is tied to .*embed_tokens"),
        (LoraConfig(rank=4, modules_to_save=["self_attn"]), r"'self_attn', which holds .*q_proj"),
        (LoraConfig(rank=4, modules_to_save=["nohead"]), r"'nohead', which matches no module"),
    ],
)  # fmt: skip
def test_targets_that_cannot_take_an_adapter_are_refused_by_name(lora, expected):
    with pytest.raises(TandemError, match=expected):
        apply_lora(tiny_model(), lora)


def test_lora_on_moe_experts_is_refused_and_attention_is_fine():
    cfg = ModelConfig(
        model_type="qwen3_moe", vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=4, moe_intermediate_size=16, qk_norm=True,
        qkv_bias=False, max_position_embeddings=64,
    )  # fmt: skip
    with pytest.raises(
        TandemError, match=r"'gate_proj', which matches model.layers.0.mlp.experts.0.gate_proj.*MoE"
    ):
        apply_lora(CausalLM(cfg), LoraConfig(rank=4))
    with pytest.raises(TandemError, match=r"'gate', which matches model.layers.0.mlp.gate, in an MoE block"):
        apply_lora(CausalLM(cfg), LoraConfig(rank=4, target_modules=["gate"]))
    attention = apply_lora(CausalLM(cfg), LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))
    assert len(_targets(attention)) == 4
    every = apply_lora(CausalLM(cfg), LoraConfig(rank=4, target_modules="all-linear"))
    assert {t.rpartition(".")[2] for t in _targets(every)} == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_the_driver_refuses_bad_targets_and_a_peft_adapter_as_model_path_before_any_actor_starts(tmp_path):
    from tandem.runtime.roles import build_data

    path = write_tiny_checkpoint(tmp_path / "ckpt")
    targets = ["train.lora.rank=4", f"model.path={path}", "train.lora.target_modules=[q_proj,qq_proj]"]
    with pytest.raises(TandemError, match=r"'qq_proj', which matches no linear layer"):
        build_data(load_config(None, targets))
    refuse_adapter_dir(path)  # a plain checkpoint is fine
    (path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/other/base"}))
    cfg = load_config(None, ["train.lora.rank=4", f"model.path={path}", "data.train_size=8"])
    with pytest.raises(
        TandemError, match=r"is a PEFT adapter of the base /other/base.*model.path=/other/base"
    ):
        build_data(cfg)


def test_paths_that_multiply_the_weights_directly_refuse_an_adapted_model():
    with pytest.raises(TandemError, match="past the LoRA adapter of model.layers.0.self_attn.q_proj"):
        fuse_projections(lora_model())
    with pytest.raises(TandemError, match="runs fused projections"):
        apply_lora(fuse_projections(tiny_model()), LORA)
    with pytest.raises(TandemError, match="already"):
        apply_lora(lora_model(), LORA)


def _hf_model(model: CausalLM):
    import tempfile

    import transformers

    with tempfile.TemporaryDirectory() as d:
        save_model(model, d)
        return transformers.AutoModelForCausalLM.from_pretrained(d).float().eval()


def _targets(model: CausalLM) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, LoraLinear)]


def test_fresh_adapters_draw_what_apply_lora_draws_from_the_same_seed():
    """tandem serve's next client gets adapters drawn as a lone model's are: the same A for the
    same seed, B zero, every adapter tensor and nothing else."""
    model = lora_model(seed=3)
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    fresh = fresh_adapters(lora_model(seed=5), 3)
    assert set(fresh) == set(trained)
    assert all(torch.equal(fresh[n], trained[n]) for n in trained)
    assert not torch.equal(fresh_adapters(model, 4)[next(iter(trained))], next(iter(trained.values())))
