"""run.deterministic: the settings it refuses, each request's own seed, and runs that repeat bit
for bit (metrics at every step and the final weights), in sync and one_step_off modes."""

import hashlib
import json
from pathlib import Path

import pytest

from tandem.errors import TandemError
from tandem.rollout.sampler import request_seed
from tandem.runtime.startup import load_config

# Wall-clock figures differ between any two runs; everything else must not.
# Wall-clock readings: seconds and rates, and how many of the groups generating ahead had finished
# when the step logged (buffer/in_flight against buffer/ready; started and consumed are fixed), and
# the processes' peak memory (memory/peak_gb: one process against several on Ray).
VOLATILE = ("timing_s/", "perf/", "memory/peak_gb", "buffer/in_flight", "buffer/ready")


def test_every_request_has_its_own_stable_seed():
    seeds = {request_seed(0, g, i) for g in range(-8, 64) for i in range(8)}
    assert len(seeds) == 72 * 8
    assert request_seed(0, 3, 1) == request_seed(0, 3, 1) != request_seed(1, 3, 1)
    assert all(0 <= s < 2**64 for s in seeds)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["run.mode=async"], "run.mode=async"),
        (["rollout.compile=true"], "Inductor"),
        (["run.mode=one_step_off", "algo.filter_groups=true"], "algo.filter_groups needs run.mode=sync"),
        (["rollout.engine=vllm"], "batch-invariant"),
    ],
)
def test_what_cannot_repeat_is_refused_with_the_reason(overrides, message):
    load_config(None, overrides)  # fine without run.deterministic
    with pytest.raises(TandemError, match="run.deterministic"):
        try:
            load_config(None, ["run.deterministic=true", *overrides])
        except TandemError as e:
            assert message in str(e), str(e)
            raise


TINY = [
    "run.progress=false",
    "run.val_every=2",
    "run.steps=4",
    "rollout.batch_size=4",
    "rollout.n=4",
    "data.val_size=8",
    "data.train_size=200",
    "reward.num_workers=1",
    "run.deterministic=true",
]


def _run(out: Path, overrides: list[str]) -> tuple[list[dict], str]:
    from tandem.runtime.run import run_training

    run_training(load_config(None, [*TINY, *overrides, f"run.out_dir={out}"]))
    rows = [json.loads(line) for line in (out / "default" / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]
    weights = out / "default" / "checkpoints" / "final" / "model.safetensors"
    return rows, hashlib.sha256(weights.read_bytes()).hexdigest()


def _repeats(tmp_path: Path, overrides: list[str]) -> list[dict]:
    first, second = _run(tmp_path / "a", overrides), _run(tmp_path / "b", overrides)
    assert len(first[0]) == len(second[0])
    assert (
        sum("actor/pg_loss" in r for r in first[0]) == 4 and sum("val/accuracy" in r for r in first[0]) == 3
    )
    for a, b in zip(first[0], second[0], strict=True):
        assert a == b, {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}
    assert first[1] == second[1]  # the final weights, hashed
    return first[0]


@pytest.mark.slow  # two runs on Ray: 1.5 minutes, kept out of the fast set's 10
@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_one_step_off_with_two_engines_repeats_bit_for_bit(tmp_path):
    """Two rollout workers that take whichever call comes next, two generations ahead: without
    run.deterministic two such runs differ from step 3 on (measured)."""
    _repeats(tmp_path, ["run.mode=one_step_off", "run.generate_ahead_steps=2", "rollout.num_workers=2"])


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize(
    "overrides",
    [
        [],  # sync
        ["train.num_workers=2", "rollout.num_workers=2"],
        ["run.mode=one_step_off", "train.num_workers=2", "train.strategy=fsdp2"],
        ["train.dtype=float32", "rollout.dtype=float32", "run.mode=one_step_off"],  # the default is bf16 here
        ["train.mini_batch_size=8", "train.epochs=2"],  # sync: π_old is μ, never recomputed
        ["train.lora.rank=8", "train.lora.alpha=16", "train.lr=1e-3"],  # adapters merged on both sides
    ],
)
def test_runs_repeat_bit_for_bit(tmp_path, overrides):
    steps = [r for r in _repeats(tmp_path, overrides) if "actor/pg_loss" in r]
    if "run.mode=one_step_off" not in overrides:  # sampled by the version trained: no mismatch at all
        assert all(r["mismatch/kl"] == 0 and r["mismatch/logprob_abs_diff_max"] == 0 for r in steps)
        assert all(r["actor/old_logprob_source/recompute"] == 0 for r in steps)


@pytest.mark.integration  # 300 batches in bf16: minutes where bf16 matmuls are emulated
@pytest.mark.parametrize("on", [True, False], ids=["invariant", "default"])
def test_a_greedy_request_gets_one_completion_in_any_batch(on):
    """One greedy request submitted 100 times among random others, in batches of 1 to 32, on the
    built-in and the paged engine: with the batch-invariant forward every copy returns the same
    tokens. (bench/determinism.py does 1,000 on the default model.) The default kernels, in bf16 on
    a model with near-tied logits, do not (xfail keeps it visible)."""
    import random

    import torch
    from helpers import tiny_model

    from tandem.rollout.engine import BuiltinEngine
    from tandem.rollout.group import make_groups
    from tandem.rollout.paged_engine import PagedEngine
    from tandem.sample import Prompt, SamplingParams

    rng = random.Random(0)
    model = tiny_model(std=0.3).to(torch.bfloat16).eval().requires_grad_(False)
    model.batch_invariant = on
    engines = [BuiltinEngine(model, [2], 0, max_batch_size=64), PagedEngine(model, [2], 0, block_size=4)]
    target = [rng.randrange(3, 50) for _ in range(12)]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    seen = set()
    for copy in range(300):
        others = [
            [rng.randrange(3, 50) for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(0, 63))
        ]
        at = rng.randint(0, len(others))
        rows = others[:at] + [target] + others[at:]
        samples = make_groups([Prompt(text="")] * len(rows), rows, n=1)
        engines[copy % 2].generate(samples, params)
        seen.add(tuple(samples[at].response_ids))
    if not on and len(seen) == 1:
        pytest.xfail("the default kernels happened to agree on this model")
    assert (len(seen) == 1) == on, len(seen)
