"""Resume: a train worker's state round-trips bit for bit (one process, bf16 masters, fsdp2 shards),
and whole runs continue from a checkpoint after a crash (sync bit for bit; async every group once)."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import ray
import torch
from helpers import nothing_may_start, on_gloo_ranks, random_samples, records, tiny_model, train, train_worker

from tandem.cli.main import main
from tandem.config import save_config
from tandem.controller.recovery import Stopped
from tandem.errors import TandemError
from tandem.model.checkpoint import load_model
from tandem.runtime.run import run_training
from tandem.runtime.startup import load_config, resolve_inputs
from tandem.train.state import load_state, save_state
from tandem.train.worker import TrainWorker

TRAIN = dict(lr=1e-3, micro_batch_tokens=40, mini_batch_size=8, warmup_steps=3, schedule="cosine")


def worker(dtype=torch.float32, **train) -> TrainWorker:
    algo = dict(entropy_coef=0.01, kl_coef=0.05)
    return train_worker(tiny_model(), algo, {**TRAIN, **train}, dtype=dtype, total_updates=20)


def steps(w: TrainWorker, first: int, count: int) -> list[dict[str, float]]:
    """The metrics of `count` train steps, less their timings."""
    out = [w.train_step(random_samples(4, 4, seed=first + i)) for i in range(count)]
    return [{k: v for k, v in m.items() if not k.startswith("timing_s/")} for m in out]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_resumed_worker_continues_bit_for_bit(tmp_path, dtype):
    """Two steps, save, two more -> the same metrics and weights as a fresh worker that loads the
    save and takes the same two steps (the optimizer's moments, the LR schedule, the mini-batch
    shuffle and the compute copy all come back)."""
    straight = worker(dtype)
    steps(straight, 0, 2)
    save_state(straight, tmp_path)
    after = steps(straight, 2, 2)
    resumed = worker(dtype)
    load_state(resumed, tmp_path)
    assert resumed.version == 2
    assert steps(resumed, 2, 2) == after
    a, b = straight.full_weights(), resumed.full_weights()
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_fresh_worker_differs_from_a_resumed_one(tmp_path):
    """The check above can fail: without load_state the next steps differ (Adam's moments are new)."""
    straight = worker()
    steps(straight, 0, 2)
    after = steps(straight, 2, 1)
    fresh = worker()
    assert steps(fresh, 2, 1) != after


def fsdp2_steps(out: str, phase: str) -> dict:
    """One rank: two steps, save, two more ("straight"), or load the save and take those two."""
    w = worker(strategy="fsdp2")
    w.parallelize(torch.distributed.group.WORLD)
    if phase == "straight":
        steps(w, 0, 2)
        save_state(w, Path(out) / "ckpt")
        metrics = steps(w, 2, 2)
    else:
        load_state(w, Path(out) / "ckpt")
        metrics = steps(w, 2, 2)
    return {"metrics": metrics, "weights": w.full_weights()}


@pytest.mark.integration  # two gloo process groups of two
def test_fsdp2_shards_resume_bit_for_bit(tmp_path):
    """Each rank writes only its shards of the weights and of Adam's state (DCP), and reads them back."""
    straight = on_gloo_ranks(2, fsdp2_steps, str(tmp_path), "straight")
    resumed = on_gloo_ranks(2, fsdp2_steps, str(tmp_path), "resumed")
    for a, b in zip(straight, resumed, strict=True):
        assert a["metrics"] == b["metrics"]
        assert all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])


# ---------------------------------------------------------------- whole runs on Ray

SAVE = "run.save_every=2"  # helpers.train's 4 steps, validating every 2, and saving every 2


class Crash(Exception):
    pass


def crash_after(step: int):
    def on_step(loop):
        if loop.version == step:
            raise Crash(f"killed after step {step}")

    return on_step


def learning(run_dir: Path) -> dict[int, dict]:
    """Each train step's metrics less wall-clock ones (timings, throughput, idle ratios)."""
    steps = [r for r in records(run_dir) if "version" in r]
    assert len({r["step"] for r in steps}) == len(steps), "a step logged twice"
    drop = ("timing_s/", "perf/")
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(drop)} for r in steps}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return dict(load_model(run_dir / "checkpoints" / "final").named_parameters())


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_a_sync_run_resumed_after_a_crash_ends_bit_for_bit_as_one_that_never_stopped(tmp_path):
    train(tmp_path / "straight", SAVE)
    with pytest.raises(Crash):
        train(tmp_path / "crashed", SAVE, on_step=crash_after(3))
    resumed_dir = tmp_path / "crashed" / "default"
    assert (resumed_dir / "checkpoints" / "latest").read_text().strip() == "step_2"
    train(tmp_path / "crashed", SAVE, "run.resume=auto")
    straight, resumed = learning(tmp_path / "straight" / "default"), learning(resumed_dir)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert resumed[step] == straight[step], step
    a, b = final_weights(tmp_path / "straight" / "default"), final_weights(resumed_dir)
    assert all(torch.equal(a[n], b[n]) for n in a)
    vals = [r["step"] for r in records(resumed_dir) if "val/accuracy" in r]
    assert vals == [0, 2, 4]  # validation at the checkpoint's step ran again, once
    summary = json.loads((resumed_dir / "summary.json").read_text())
    assert (
        summary["val/accuracy_start"]
        == json.loads((tmp_path / "straight/default/summary.json").read_text())["val/accuracy_start"]
    )


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_an_async_run_resumed_after_a_crash_trains_every_group_exactly_once(tmp_path):
    overrides = ["run.mode=async", "run.max_staleness=1", "rollout.chunk_groups=1", "run.keep_checkpoints=1"]
    with pytest.raises(Crash):
        train(tmp_path, SAVE, *overrides, on_step=crash_after(3))
    run_dir = tmp_path / "default"
    saved = torch.load(run_dir / "checkpoints" / "step_2" / "driver.pt", weights_only=False)
    train(tmp_path, SAVE, *overrides, "run.resume=auto")
    trained = [g for r in records(run_dir, "batches.jsonl") for g in r["groups"]]
    assert sorted(trained) == list(range(16))  # 4 steps x 4 groups: none lost, none twice
    assert all(r["staleness/max"] <= 1 for r in learning(run_dir).values())
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["final", "latest", "step_4"]
    assert saved["buffer"]["started"] > 8  # groups were in flight at the checkpoint: they came back


def test_a_resume_that_changes_the_batch_is_refused_before_anything_starts(tmp_path, monkeypatch):
    saved = load_config(None, [f"run.out_dir={tmp_path}"])
    step = tmp_path / "default" / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    save_config(resolve_inputs(saved), step / "config.yaml")
    (step.parent / "latest").write_text("step_2\n")
    nothing_may_start(monkeypatch, AssertionError("something started"))
    cfg = load_config(
        None, [f"run.out_dir={tmp_path}", "run.resume=auto", "rollout.batch_size=8", "rollout.n=2"]
    )
    with pytest.raises(TandemError, match=r"rollout.batch_size: 32 in the checkpoint, 8 now; rollout.n: 8"):
        run_training(cfg)


@pytest.mark.slow  # bench/chaos.py kills train workers too
@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_a_killed_train_worker_stops_the_run_naming_it_and_resume_continues(tmp_path):
    def kill_trainer(loop):
        if loop.version == 2:
            ray.kill(loop.cluster.trainers[0])

    start = time.time()
    with pytest.raises(TandemError, match=r"train/0 died .*step_2, with run.resume=auto"):
        train(tmp_path, SAVE, "run.steps=3", on_step=kill_trainer)
    assert time.time() - start < 120  # well within run.timeout_s: the death is seen, not waited out
    train(tmp_path, SAVE, "run.steps=3", "run.resume=auto")
    assert sorted(learning(tmp_path / "default")) == [1, 2, 3]


@pytest.mark.slow  # bench/chaos.py kills reward actors too
@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_a_killed_reward_actor_is_restarted_and_no_sample_is_lost(tmp_path):
    def kill_reward(loop):
        if loop.version == 2:
            ray.kill(loop.cluster.reward, no_restart=False)

    overrides = ["run.mode=async", "run.max_staleness=1", "rollout.chunk_groups=1", "run.steps=3"]
    train(tmp_path, SAVE, *overrides, on_step=kill_reward)
    trained = [g for r in records(tmp_path / "default", "batches.jsonl") for g in r["groups"]]
    assert sorted(trained) == list(range(12))


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_sigterm_saves_at_the_step_boundary_and_resume_finishes_the_run(tmp_path):
    def terminate(loop):
        if loop.version == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped) as stopped:
        train(tmp_path, SAVE, "run.save_every=0", "run.steps=2", on_step=terminate)
    assert stopped.value.version == 1 and stopped.value.checkpoint.name == "step_1"
    assert signal.getsignal(signal.SIGTERM) is before  # the run's handler is gone again
    train(tmp_path, SAVE, "run.save_every=0", "run.steps=2", "run.resume=auto")
    assert sorted(learning(tmp_path / "default")) == [1, 2]


def test_a_stopped_train_says_how_to_continue_and_exits_as_a_shell_would(monkeypatch, capsys, tmp_path):
    def stopped(cfg, on_step=None):
        raise Stopped("SIGINT", 7, tmp_path / "step_7")

    monkeypatch.setattr("tandem.runtime.run.run_training", stopped)
    assert main(["train", "run.steps=9", "run.resume=/old"]) == 130
    out = capsys.readouterr().out
    assert "after step 7" in out and "continue with: tandem train run.steps=9 run.resume=auto" in out


def test_a_checkpoint_that_names_its_model_as_the_user_wrote_it_resumes_on_the_resolved_directory(tmp_path):
    """A tandem before start-up recorded model directories saved "builtin:addition" as written; the
    run now has the directory. Same model: resumable. Another model: refused, naming the key."""
    from tandem.runtime.resume import check_compatible

    now = resolve_inputs(load_config(None, []))
    assert now.model.path != "builtin:addition"  # a directory
    check_compatible(load_config(None, ["model.path=builtin:addition"]), now, tmp_path)
    with pytest.raises(TandemError, match="model.path: 'builtin:addition-moe' in the checkpoint"):
        check_compatible(load_config(None, ["model.path=builtin:addition-moe"]), now, tmp_path)
