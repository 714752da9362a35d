"""run.device, train.dtype and rollout.dtype: resolved once, in the driver, with clear errors."""

import pytest

import tandem.devices as devices
from tandem.config import load_config
from tandem.errors import TandemError


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
