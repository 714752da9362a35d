"""End to end: the default `tandem train` raises held-out accuracy by at least 30 points (slow)."""

import json

import pytest

from tandem.cli.main import main

pytestmark = pytest.mark.ray  # every test is `tandem train` on the local Ray


@pytest.mark.slow
def test_default_train_learns(tmp_path, capsys):
    assert main(["train", f"run.out_dir={tmp_path}", "run.progress=false"]) == 0
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    assert summary["val/accuracy_gain_points"] >= 30, summary
    lines = (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "critic/score/mean" in r]  # not the validation lines
    first, last = steps[0]["critic/score/mean"], steps[-1]["critic/score/mean"]
    assert last > first + 0.2, (first, last)
    assert "held-out accuracy" in capsys.readouterr().out


def test_a_short_run_from_the_warm_start_learns_to_carry(tmp_path, capsys):
    """The fast-suite version of the default run: fewer steps, a larger LR, one validation at each end."""
    args = [
        "train",
        f"run.out_dir={tmp_path}",
        "run.progress=false",
        "run.steps=10",
        "run.val_every=0",
        "train.lr=3e-4",
        "data.val_size=128",
        "data.train_size=2000",
    ]
    assert main(args) == 0
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    assert summary["val/accuracy_gain_points"] >= 20, summary


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_the_default_run_on_two_data_parallel_ranks_reaches_95_percent(tmp_path, strategy):
    args = ["train", f"run.out_dir={tmp_path}", "run.progress=false", f"train.strategy={strategy}"]
    assert main([*args, "train.num_workers=2"]) == 0
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    assert summary["val/accuracy_final"] >= 0.95, summary


@pytest.mark.slow
def test_the_default_run_with_a_sleeping_engine_reaches_95_percent(tmp_path):
    """rollout.free_memory_during_train: the engine frees its weights and KV cache before every
    train step and is refilled by the push; the run learns as one whose engine never slept."""
    args = ["train", f"run.out_dir={tmp_path}", "run.progress=false", "rollout.free_memory_during_train=true"]
    assert main(args) == 0
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    assert summary["val/accuracy_final"] >= 0.95, summary


@pytest.mark.slow
def test_ppo_with_a_critic_reaches_95_percent(tmp_path):
    """algo.adv_estimator=gae: a value model on its own worker, GAE advantages, its own optimizer."""
    assert main(["train", f"run.out_dir={tmp_path}", "run.progress=false", "algo.adv_estimator=gae"]) == 0
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    assert summary["val/accuracy_final"] >= 0.95, summary
    lines = (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "critic/vf_loss" in r]
    assert len(steps) == 50
    assert all(k in steps[-1] for k in ("critic/vf_explained_var", "critic/values/mean"))


@pytest.mark.slow
def test_rl_on_the_moe_warm_start_with_routing_replay_learns(tmp_path):
    """builtin:addition-moe (Qwen3-MoE-shaped) with R3: the trainer follows the engine's experts and
    logs how often its own router agreed; the run gains at least 30 points, as the dense one does."""
    args = ["train", f"run.out_dir={tmp_path}", "run.progress=false", "model.path=builtin:addition-moe"]
    assert main([*args, "algo.routing_replay=true"]) == 0
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    assert summary["val/accuracy_gain_points"] >= 30, summary
    lines = (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "actor/pg_loss" in r]
    assert all(0.9 < r["mismatch/routing_agreement"] <= 1 for r in steps)
