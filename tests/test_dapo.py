"""DAPO: overlong reward shaping against hand-computed values, dynamic sampling's drops, refills
and round cap, and a run on Ray that filters groups and still trains full batches."""

import json

import pytest

from tandem.buffer import RolloutBuffer
from tandem.controller.dynamic_sampling import DynamicSampling, uninformative_groups
from tandem.errors import TandemError
from tandem.reward.shaping import overlong_penalty
from tandem.runtime.startup import load_config
from tandem.sample import Prompt, Sample


@pytest.mark.parametrize(
    "length, buffer, factor, expected",
    [
        (4, 4, 1.0, 0.0),  # L <= L_max - buf: no penalty
        (5, 4, 1.0, -0.25),  # one token into the buffer: -(5 - 4) / 4
        (6, 4, 1.0, -0.5),
        (8, 4, 1.0, -1.0),  # at the cap: the whole factor
        (9, 4, 1.0, -1.0),  # never below -factor
        (7, 4, 0.5, -0.375),  # -(7 - 4) / 4 * 0.5
        (8, 0, 1.0, 0.0),  # buffer 0: off
        (1, 7, 2.0, 0.0),  # L_max - buf = 1
        (2, 7, 2.0, -2 / 7),  # -(2 - 1) / 7 * 2
    ],
)
def test_overlong_penalty_is_dapos_linear_ramp(length, buffer, factor, expected):
    assert overlong_penalty(length, 8, buffer, factor) == pytest.approx(expected, abs=1e-12)


def group(gid: int, rewards: list[float]) -> list[Sample]:
    return [Sample(Prompt(text="p"), [1], group_id=gid, index=i, reward=r) for i, r in enumerate(rewards)]


def test_uninformative_groups_are_those_with_equal_rewards():
    samples = group(0, [1, 1, 1]) + group(1, [0, 1, 0]) + group(2, [0, 0, 0]) + group(3, [0.5, 0.5, 0.25])
    assert uninformative_groups(samples) == {0, 2}


def test_dropped_groups_leave_the_buffer_and_are_refilled():
    buffer = RolloutBuffer(2, 0, whole_batches=True)
    for gid in range(2):
        buffer.start(gid, 0)
    sampling = DynamicSampling(batch_size=2, max_rounds=3)
    kept, dropped = sampling.keep(group(0, [1, 1]) + group(1, [0, 1]), buffer, version=0)
    assert dropped == 1 and {s.group_id for s in kept} == {1}
    assert buffer.started == 1 and buffer.admissible(0) == 1  # group 0's place is free again
    assert sampling.refilled(1) == 1 and sampling.refilled(1) == 0  # one replacement was owed


def test_the_round_cap_stops_the_run_with_a_clear_error():
    buffer = RolloutBuffer(2, 1)
    sampling = DynamicSampling(batch_size=2, max_rounds=2)  # at most 2 dropped per step
    for gid in range(3):
        buffer.start(gid, 0)
    sampling.keep(group(0, [1, 1]) + group(1, [0, 0]), buffer, version=4)
    with pytest.raises(TandemError, match=r"dropped 3 groups .* step 5 .*max_filter_rounds=2 allows 2"):
        sampling.keep(group(2, [1, 1]), buffer, version=4)


def test_filter_groups_needs_groups_of_two():
    with pytest.raises(TandemError, match="algo.filter_groups"):
        load_config(None, ["algo.filter_groups=true", "rollout.n=1"])


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_a_filtered_run_drops_groups_refills_them_and_trains_full_batches(tmp_path):
    from tandem.runtime.run import run_training

    overrides = [
        "run.progress=false",
        "run.steps=3",
        "run.val_every=0",
        "rollout.batch_size=4",
        "rollout.n=4",
        "data.val_size=8",
        "data.train_size=200",
        "reward.num_workers=1",
        "reward.overlong_buffer=2",
        "algo.filter_groups=true",
        f"run.out_dir={tmp_path}",
    ]
    run_training(load_config(None, overrides))
    lines = (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "filter/dropped_groups" in r]
    assert len(steps) == 3
    assert sum(r["filter/dropped_groups"] for r in steps) > 0  # the warm start solves many prompts 4/4
    assert sum(r["filter/extra_prompts"] for r in steps) > 0
    assert all(r["buffer/consumed"] == 4 * r["step"] for r in steps)  # full batches of kept groups
    assert all("reward/overlong_penalty/mean" in r for r in steps)
    batches = [json.loads(x) for x in (tmp_path / "default" / "batches.jsonl").read_text().splitlines()]
    assert all(len(b["groups"]) == 4 for b in batches)
