"""Runs on Ray in every mode: staleness holds, validation is logged per version, the timeline is
written, a killed rollout worker is recovered from, and reference logprobs come from their worker."""

import json
import time

import pytest
import ray
import torch
from helpers import TINY, train

from tandem import devices
from tandem.errors import TandemError
from tandem.runtime.startup import load_config

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_local")]


def test_sync_mode_is_on_policy_and_leaves_a_timeline(tmp_path):
    summary, steps, vals = train(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["staleness/max"] == 0 for r in steps)
    assert [r["step"] for r in vals] == [0, 2, 4] and [r["val/version"] for r in vals] == [0, 2, 4]
    assert {"val/accuracy_start", "val/accuracy_final", "perf/run_samples_per_s"} <= set(summary)
    assert all(0 <= r["perf/idle_ratio/rollout"] <= 1 and 0 <= r["perf/idle_ratio/train"] <= 1 for r in steps)
    trace = json.loads((tmp_path / "default" / "timeline.json").read_text())["traceEvents"]
    names = {e["name"] for e in trace if e["ph"] == "X"}
    assert {"generate", "reward", "train", "sync", "val"} <= names
    # every sync step is exactly on-policy: π_old comes from the update's own forward, no recompute
    assert "logp" not in names and all(r["actor/old_logprob_source/policy"] == 1 for r in steps)
    # the trainer's advantages reach the metrics (the driver's copies of the samples never had them)
    assert any(r["critic/advantages/max"] > 0 > r["critic/advantages/min"] for r in steps)


@pytest.mark.parametrize("engine", ["builtin", "paged"])
def test_a_sleeping_engine_frees_its_memory_before_every_train_step(tmp_path, engine):
    _, steps, vals = train(tmp_path, "rollout.free_memory_during_train=true", f"rollout.engine={engine}")
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and [r["step"] for r in vals] == [0, 2, 4]
    assert all(r["memory/engine_bytes"] > 0 and r["perf/sleep_s"] >= 0 for r in steps)
    assert all(r["perf/wake_s"] > 0 for r in steps[1:])  # woken by the generation after a sleep
    trace = json.loads((tmp_path / "default" / "timeline.json").read_text())["traceEvents"]
    assert sum(e["name"] == "sleep" for e in trace if e["ph"] == "X") == 4


def test_a_sleeping_engine_needs_sync_mode(tmp_path):
    with pytest.raises(TandemError, match="free_memory_during_train.*needs run.mode=sync"):
        train(tmp_path, "rollout.free_memory_during_train=true", "run.mode=async")


@pytest.mark.parametrize(
    "mode, bound",
    [
        (["run.mode=one_step_off", "run.generate_ahead_steps=1"], 1),
        (
            ["run.mode=async", "run.max_staleness=2", "rollout.on_update=continue", "rollout.chunk_groups=1"],
            2,
        ),
        (["run.mode=async", "run.max_staleness=1", "rollout.on_update=abort", "rollout.chunk_groups=2"], 1),
    ],
    ids=["one_step_off", "async-continue", "async-abort"],
)
def test_off_policy_modes_keep_the_staleness_bound(tmp_path, mode, bound):
    split = ["placement.groups=[actor_train,generate]", "placement.ratios=[0.5,0.5]", "rollout.num_workers=2"]
    summary, steps, vals = train(tmp_path, *mode, *split, "run.steps=5")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert max(r["staleness/max"] for r in steps) <= bound
    assert steps[-1]["buffer/consumed"] == 5 * 4  # every admitted group trained, none twice
    assert any(r["actor/old_logprob_source/recompute"] == 1 for r in steps)  # stale batches recompute π_old
    assert [r["step"] for r in vals] == [0, 2, 4, 5]
    assert vals[-1]["val/version"] == 5


def test_a_killed_rollout_worker_is_restarted_and_nothing_is_lost(tmp_path):
    killed = {}

    def kill_once(loop):
        if loop.version == 2 and not killed:
            killed["worker"] = loop.cluster.rollouts[0]
            killed["at"] = time.time()
            ray.kill(loop.cluster.rollouts[0], no_restart=False)

    summary, steps, _ = train(
        tmp_path,
        "run.mode=async",
        "run.max_staleness=1",
        "rollout.num_workers=2",
        "rollout.chunk_groups=1",
        "run.steps=5",
        on_step=kill_once,
    )
    assert killed
    assert sum(r["rollout/restarts"] for r in steps) == 1
    assert steps[-1]["buffer/consumed"] == 5 * 4
    assert max(r["staleness/max"] for r in steps) <= 1
    assert "val/accuracy_final" in summary


def test_reference_logprobs_come_from_their_own_worker(tmp_path):
    placement = ["placement.groups=[actor_train,ref_logp,generate]", "placement.ratios=[0.5,0.25,0.25]"]
    summary, steps, _ = train(tmp_path, "algo.kl_coef=0.05", *placement, "run.mode=one_step_off")
    assert all("actor/kl_loss" in r for r in steps)
    assert all(0 <= r["perf/idle_ratio/ref"] <= 1 for r in steps)
    trace = json.loads((tmp_path / "default" / "timeline.json").read_text())["traceEvents"]
    assert any(e["name"] == "ref" for e in trace if e["ph"] == "X")


def test_data_parallel_train_workers_and_broadcast_weights(tmp_path):
    summary, steps, _ = train(
        tmp_path, "train.num_workers=2", "sync.transport=broadcast", "rollout.num_workers=2", "run.steps=2"
    )
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["staleness/max"] == 0 for r in steps)


@pytest.mark.parametrize(
    "transport, strategy",
    [("object_store", "ddp"), ("broadcast", "ddp"), ("object_store", "fsdp2"), ("broadcast", "fsdp2")],
)
def test_after_a_push_the_engine_holds_the_trainers_weights_bit_for_bit(transport, strategy):
    from helpers import random_samples

    from tandem.runtime.cluster import RayCluster

    workers = 2 if strategy == "fsdp2" else 1  # fsdp2: every tensor is gathered from two shards
    cfg = load_config(
        None,
        [
            *TINY,
            f"sync.transport={transport}",
            f"train.strategy={strategy}",
            f"train.num_workers={workers}",
            "sync.produce_bucket_mb=1",
            "sync.consume_bucket_mb=0.5",
        ],
    )
    cluster = RayCluster.start(devices.resolve(cfg, 0))
    try:
        trainers, rollout = cluster.trainers, cluster.rollouts[0]

        def weights() -> dict[str, torch.Tensor]:
            return ray.get([t.weights.remote() for t in trainers])[0]

        samples = random_samples(4, 4)  # token ids within the warm start's vocabulary, mixed rewards
        before = weights()
        ray.get([t.train_step.remote(samples) for t in trainers])
        after = weights()
        assert any(not torch.equal(before[n], after[n]) for n in after)
        sends = [t.send_weights.remote(1) for t in trainers]
        handle = sends[0] if transport == "object_store" else None
        ray.get([*sends, rollout.receive_weights.remote(handle, 1)], timeout=60)
        assert ray.get(rollout.apply_pending.remote()) == 1
        version, engine = ray.get(rollout.weights.remote())
        assert version == 1 and engine.keys() == after.keys()
        # the trainer's fp32 master weights, rounded once to the engine's dtype (rollout.dtype)
        assert all(torch.equal(engine[n], after[n].to(engine[n].dtype)) for n in after)
    finally:
        cluster.close()


def test_the_paged_engine_runs_async_with_in_flight_updates(tmp_path):
    split = ["placement.groups=[actor_train,generate]", "placement.ratios=[0.5,0.5]"]
    paged = ["rollout.engine=paged", "rollout.kv_cache_mb=1", "rollout.on_update=continue"]
    summary, steps, vals = train(tmp_path, "run.mode=async", "run.max_staleness=1", *split, *paged)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert max(r["staleness/max"] for r in steps) <= 1
    assert vals[-1]["val/version"] == 4
