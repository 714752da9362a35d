"""run.device, train.dtype and rollout.dtype: resolved once, in the driver, with clear errors."""

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
