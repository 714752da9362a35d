"""run.device, train.dtype and rollout.dtype: resolved once, in the driver, with clear errors."""

import os
import subprocess
import sys

import pytest

import tandem.devices as devices
from tandem.errors import TandemError
from tandem.runtime.startup import load_config


def resolve(overrides, gpus=0):
    return devices.resolve(load_config(None, overrides), gpus)


def test_auto_is_cuda_with_gpus_and_bf16_there():
    cfg = resolve([], gpus=8)
    assert (cfg.run.device, cfg.train.dtype, cfg.rollout.dtype) == ("cuda", "bfloat16", "bfloat16")


@pytest.mark.parametrize("native, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_on_the_cpu_is_bf16_only_with_native_bf16_matmuls(monkeypatch, native, expected):
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: native)
    cfg = resolve([])
    assert (cfg.run.device, cfg.train.dtype, cfg.rollout.dtype) == ("cpu", expected, expected)


def test_explicit_choices_are_kept_and_resolving_twice_changes_nothing():
    cfg = resolve(["run.device=cpu", "train.dtype=float32", "rollout.dtype=bfloat16"], gpus=4)
    assert (cfg.run.device, cfg.train.dtype, cfg.rollout.dtype) == ("cpu", "float32", "bfloat16")
    assert devices.resolve(cfg, 0) == cfg


def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(TandemError, match=r"'run.device' is 'cuda', but the Ray cluster has no GPU"):
        resolve(["run.device=cuda"], gpus=0)


@pytest.mark.parametrize(
    "overrides, gpus, expected",
    [
        ([], 8, True),  # sync on GPUs, every role colocated: the trainer needs the engine's memory
        (["placement.groups=[[generate,actor_train],ref_logp]", "placement.ratios=[0.75,0.25]"], 8, True),
        (["placement.groups=[generate,actor_train]", "placement.ratios=[0.5,0.5]"], 8, False),
        (["run.mode=one_step_off"], 8, False),  # generation overlaps training: it cannot sleep
        ([], 0, False),  # on the CPU: nothing to hand over
        (["rollout.free_memory_during_train=true"], 0, True),  # an explicit choice stays
    ],
)
def test_the_engine_sleeps_by_default_only_where_it_shares_the_trainers_gpus(overrides, gpus, expected):
    assert resolve(overrides, gpus=gpus).rollout.free_memory_during_train is expected


def test_a_process_held_to_avx2_has_no_native_bf16_whatever_the_cpu(monkeypatch):
    """ATEN_CPU_CAPABILITY or ONEDNN_MAX_CPU_ISA below bf16's instructions: bf16 is emulated there, so
    auto is fp32, as on an AVX2-only CPU (how this project tries one on a newer CPU)."""
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    monkeypatch.setattr(devices.torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    assert devices.cpu_has_native_bf16()
    for isa, native in [("avx2", False), ("AVX512_CORE", False), ("AVX512_CORE_BF16", True), ("ALL", True)]:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
        assert devices.cpu_has_native_bf16() is native, isa
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(devices.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not devices.cpu_has_native_bf16()
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx2", "avx512f"})
    monkeypatch.setattr(devices.torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert not devices.cpu_has_native_bf16()


@pytest.mark.integration  # a fresh Python process with torch: a few seconds
def test_auto_in_a_process_whose_aten_is_held_to_avx2_is_fp32():
    """The real switch, in a fresh process (torch reads ATEN_CPU_CAPABILITY once, at import)."""
    if not devices.cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        pytest.skip("this CPU has no native bf16: auto is fp32 here whatever the process holds")
    code = (
        "from tandem.devices import resolve; from tandem.runtime.startup import load_config; "
        "print(resolve(load_config(None, []), 0).train.dtype)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    held = subprocess.run(
        [sys.executable, "-c", code], env={**env, "ATEN_CPU_CAPABILITY": "avx2"},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert held.stdout.strip() == "float32"
