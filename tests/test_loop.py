"""The controller loop without Ray: `Loop` over a virtual-clock cluster of fake workers that compute
trivially (fixed tokens, a reward by index, a train step that bumps a version). Every mode keeps its
staleness bound, trains every admitted group exactly once, validates on schedule, survives a dead
rollout worker, and resumes from a checkpoint to the same batches."""

import json
from pathlib import Path

import pytest

from tandem.controller.inputs import Data
from tandem.controller.loop import Loop
from tandem.controller.protocol import CallFailed, WorkerDied
from tandem.controller.recovery import Stopped
from tandem.data.loader import PromptLoader
from tandem.errors import TandemError
from tandem.runtime.startup import load_config
from tandem.sample import Prompt, Sample, Status
from tandem.sim.cluster import Job, SimCluster
from tandem.sim.workers import TimedWorker

TOKENS = [5, 6, 7]


class FakeRollout(TimedWorker):
    """Generates TOKENS for every sample under the weights it holds when the call starts, in a
    time that varies with its groups (so calls finish out of order); pushes land meanwhile."""

    def __init__(self, name: str, die_at_call: int = -1):
        super().__init__(name)
        self.version, self.calls, self.die_at_call = 0, 0, die_at_call

    def lane(self, method: str) -> tuple[str, int]:
        return ("weights", 1) if method == "receive_weights" else ("gen", 1)

    def begin(self, job: Job, now: float) -> None:
        job.state["version"] = self.version
        super().begin(job, now)

    def cost(self, job: Job) -> float:
        if job.method == "generate":
            return 1.0 + sum((s.group_id * 7919 + s.index) % 13 for s in job.args[0]) / 10
        return 0.2 if job.method == "receive_weights" else 0.05

    def result(self, job: Job, now: float):
        if job.method == "generate":
            self.calls += 1
            if self.calls == self.die_at_call:
                return WorkerDied("the rollout worker's process was killed")
            samples, _, kind = job.args
            for s in samples:
                s.response_ids = s.response_ids + TOKENS
                s.logprobs = s.logprobs + [-1.0] * len(TOKENS)
                s.versions = s.versions + [job.state["version"]] * len(TOKENS)
                s.loss_mask = s.loss_mask + [1] * len(TOKENS)
                s.status, s.finish_reason = Status.FINISHED, "stop"
            return samples, self.span(kind, job, now)
        if job.method == "receive_weights":
            self.version = job.args[1]
            return self.span("sync", job, now)
        if job.method == "sleep":
            return {"memory/engine_bytes": 1.0, "perf/sleep_s": 0.0, "perf/wake_s": 0.0}, self.span(
                "sleep", job, now
            )
        return None


class ExtraRollout(FakeRollout):
    """Each finished episode also returns an extra sample (an openai agent's history rewrite)."""

    def result(self, job: Job, now: float):
        out = super().result(job, now)
        if job.method != "generate" or isinstance(out, WorkerDied):
            return out
        samples, span = out
        extras = [
            Sample(
                s.prompt,
                s.prompt_ids,
                s.group_id,
                ((s.index + 1) << 16) + 1,
                response_ids=[9],
                logprobs=[-1.0],
                versions=[job.state["version"]],
                loss_mask=[1],
                status=Status.FINISHED,
                finish_reason="stop",
                episode_of=s.index,
            )  # fmt: skip
            for s in samples
            if s.status is Status.FINISHED
        ]
        return samples + extras, span


class FakeTrainer(TimedWorker):
    def __init__(self, name: str, fail: bool = False, mismatch: float = 0.0, metrics: dict | None = None):
        super().__init__(name)
        self.version, self.fail, self.mismatch, self.metrics = 0, fail, mismatch, metrics or {}
        self.batches = []  # the samples of each train step

    def cost(self, job: Job) -> float:
        return 3.0 if job.method == "train_step" else 0.1

    def result(self, job: Job, now: float):
        if job.method == "train_step":
            if self.fail:
                return CallFailed("Traceback: RuntimeError: the loss is nan")
            self.version += 1
            self.batches.append(job.args[0])
            metrics = {"actor/loss": 0.0, "mismatch/logprob_abs_diff_max": self.mismatch, **self.metrics}
            return metrics, [self.span("train", job, now)]
        if job.method == "send_weights":
            return ("handle", self.version), self.span("sync", job, now)
        if job.method == "save":
            (Path(job.args[0]) / f"{self.name.replace('/', '_')}.json").write_text(json.dumps(self.version))
            return self.span("save", job, now)
        if job.method == "load":
            self.version = json.loads((Path(job.args[0]) / f"{self.name.replace('/', '_')}.json").read_text())
            return self.version
        return None


class FakeReward(TimedWorker):
    def __init__(self, name: str, fails: bool = False):
        super().__init__(name)
        self.fails, self.on_call = fails, None  # every reward errors; a callback(job) per call

    def cost(self, job: Job) -> float:
        return 0.01

    def result(self, job: Job, now: float):
        if self.on_call is not None:
            self.on_call(job)
        samples = job.args[0]
        for s in samples:
            s.reward = 0.0 if self.fails else float(s.index % 2)
        return (
            samples,
            {"reward/errors": float(len(samples)) if self.fails else 0.0},
            self.span(job.args[1] if len(job.args) > 1 else "reward", job, now),
        )


class Log:
    def __init__(self):
        self.steps, self.vals, self.batches = [], [], []

    def log(self, step, metrics):
        (self.steps if "version" in metrics else self.vals).append({"step": step, **metrics})

    def log_batch(self, step, groups):
        self.batches.append((step, groups))


def fake_cluster(
    rollouts=2, die_at_call=-1, trainer_fails=False, mismatch=0.0, metrics=None, rewards_fail=False
):
    workers = {
        f"rollout/{i}": FakeRollout(f"rollout/{i}", die_at_call if i == 0 else -1) for i in range(rollouts)
    }
    workers["train/0"] = FakeTrainer("train/0", trainer_fails, mismatch, metrics)
    workers["reward/0"] = FakeReward("reward/0", rewards_fail)
    names = {
        "rollout": [f"rollout/{i}" for i in range(rollouts)],
        "train": ["train/0"],
        "reward": ["reward/0"],
    }
    return SimCluster(workers, names, pools={})


def fake_data(cfg, val=6):
    prompts = [Prompt(text=f"p{i}") for i in range(200)]
    loader = PromptLoader(prompts, [[1, 2, i % 50] for i in range(200)], cfg.rollout.batch_size, True, 0)
    return Data(loader, [Prompt(text=f"v{i}") for i in range(val)], [[3, i] for i in range(val)])


BASE = ["run.steps=5", "run.val_every=2", "rollout.batch_size=4", "rollout.n=2", "run.progress=false"]


def run(tmp_path, *overrides, cluster=None, val=6):
    cfg = load_config(None, [*BASE, f"run.out_dir={tmp_path}", *overrides])
    loop = Loop(cfg, fake_data(cfg, val), cluster or fake_cluster())
    log = Log()
    summary = loop.run(log)
    return loop, log, summary


def trained_groups(log):
    return [g for _, groups in log.batches for g in groups]


def test_sync_trains_on_policy_and_validates_on_schedule(tmp_path):
    loop, log, summary = run(tmp_path, "run.mode=sync")
    assert [r["step"] for r in log.steps] == [1, 2, 3, 4, 5]
    assert all(r["staleness/max"] == 0 for r in log.steps)
    assert [r["step"] for r in log.vals] == [0, 2, 4, 5]
    assert [r["val/version"] for r in log.vals] == [0, 2, 4, 5]
    assert trained_groups(log) == list(range(20))  # every group once, in order
    assert summary["val/accuracy_final"] == 0.0  # n=1 held-out samples all have index 0: reward 0
    assert all(0 <= r["perf/idle_ratio/train"] <= 1 and r["timing_s/step"] > 3 for r in log.steps)


@pytest.mark.parametrize("mode", [["run.mode=sync"], ["run.mode=async", "run.max_staleness=1"]])
def test_an_episodes_extra_samples_ride_with_its_group_and_do_not_count_as_its_samples(tmp_path, mode):
    """rollout.agent=openai: an episode may return extra samples (Sample.episode_of). A group is
    whole at rollout.n episodes, and trains with every extra; held-out metrics count episodes."""
    cluster = fake_cluster()
    for name in ("rollout/0", "rollout/1"):
        cluster.workers[name] = ExtraRollout(name)
    _, log, summary = run(tmp_path, *mode, cluster=cluster)
    batches = cluster.workers["train/0"].batches
    assert len(batches) == 5 and sorted(trained_groups(log)) == list(range(20))
    for batch in batches:
        assert len(batch) == 4 * 2 * 2  # batch_size groups x rollout.n episodes x (own + extra)
        mains = {(s.group_id, s.index) for s in batch if s.episode_of is None}
        assert len(mains) == 8 and all(
            (s.group_id, s.episode_of) in mains for s in batch if s.episode_of is not None
        )
    assert summary["val/accuracy_final"] == 0.0  # the extras (odd index: reward 1) are not counted


@pytest.mark.parametrize(
    "mode, bound",
    [
        (["run.mode=one_step_off", "run.generate_ahead_steps=1"], 1),
        (["run.mode=one_step_off", "run.generate_ahead_steps=2"], 2),
        (["run.mode=async", "run.max_staleness=1", "rollout.chunk_groups=1"], 1),
        (["run.mode=async", "run.max_staleness=3", "rollout.chunk_groups=2"], 3),
        (["run.mode=async", "run.max_staleness=0", "rollout.chunk_groups=1"], 0),
    ],
)
def test_off_policy_modes_keep_the_staleness_bound_and_train_every_group_once(tmp_path, mode, bound):
    _, log, _ = run(tmp_path, *mode, "run.steps=8")
    assert [r["step"] for r in log.steps] == list(range(1, 9))
    assert max(r["staleness/max"] for r in log.steps) <= bound
    assert sorted(trained_groups(log)) == list(range(32))
    assert log.steps[-1]["buffer/consumed"] == 32


def test_async_overlaps_generation_with_training(tmp_path):
    _, sync, _ = run(tmp_path / "s", "run.mode=sync", "run.steps=8")
    _, off, _ = run(
        tmp_path / "a", "run.mode=async", "run.max_staleness=2", "rollout.chunk_groups=1", "run.steps=8"
    )
    assert max(r["staleness/max"] for r in off.steps) > 0  # it did train on older samples
    sync_s = sum(r["timing_s/step"] for r in sync.steps)
    async_s = sum(r["timing_s/step"] for r in off.steps)
    assert async_s < 0.8 * sync_s


def test_a_dead_rollout_worker_is_resynced_and_nothing_is_lost(tmp_path):
    cluster = fake_cluster(die_at_call=3)
    loop, log, _ = run(
        tmp_path, "run.mode=async", "run.max_staleness=1", "rollout.chunk_groups=1", cluster=cluster
    )
    assert sum(r["rollout/restarts"] for r in log.steps) == 1
    assert sorted(trained_groups(log)) == list(range(20))
    assert max(r["staleness/max"] for r in log.steps) <= 1
    assert loop.slots.syncing == [False, False] and loop.slots.queued == [0, 0]


def test_a_dead_trainer_or_a_failed_call_ends_the_run_naming_it(tmp_path):
    cluster = fake_cluster()
    cluster.workers["train/0"].result = lambda job, now: WorkerDied("killed")
    with pytest.raises(TandemError, match=r"train/0 died during train \(version 0\): killed"):
        run(tmp_path, cluster=cluster)
    with pytest.raises(TandemError, match=r"train on train/0 \(version 0\) failed:\nTraceback.*nan"):
        run(tmp_path, cluster=fake_cluster(trainer_fails=True))


def test_free_memory_during_train_sleeps_every_engine_once_per_step(tmp_path):
    loop, log, _ = run(tmp_path, "run.mode=sync", "rollout.free_memory_during_train=true")
    sleeps = [s for s in loop.timeline.spans if s.name == "sleep"]
    assert len(sleeps) == 5 * 2 and all(r["memory/engine_bytes"] == 2.0 for r in log.steps)


def test_the_deterministic_schedule_trains_batch_i_on_version_i_minus_k(tmp_path):
    _, log, _ = run(tmp_path, "run.mode=one_step_off", "run.deterministic=true", "run.steps=6")
    assert [r["staleness/max"] for r in log.steps] == [0, 1, 1, 1, 1, 1]
    assert [r["staleness/min"] for r in log.steps] == [0, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_a_deterministic_run_stops_when_its_first_step_measures_a_mismatch(tmp_path, mode):
    """The engine and the trainer disagree on tokens the trained version sampled: the promise is
    broken, so the run stops at step 1 naming the figure; without run.deterministic it trains on."""
    with pytest.raises(TandemError, match=r"logprob_abs_diff_max 0\.03, not 0"):
        run(tmp_path, f"run.mode={mode}", "run.deterministic=true", cluster=fake_cluster(mismatch=0.03))
    _, log, _ = run(tmp_path, f"run.mode={mode}", cluster=fake_cluster(mismatch=0.03))
    assert len(log.steps) == 5
    _, log, _ = run(tmp_path, f"run.mode={mode}", "run.deterministic=true")  # 0: trains on
    assert len(log.steps) == 5


def test_resume_continues_to_the_same_batches(tmp_path):
    _, whole, _ = run(tmp_path / "whole", "run.mode=sync")
    cfg = load_config(None, [*BASE, f"run.out_dir={tmp_path / 'cut'}", "run.mode=sync", "run.save_every=2"])
    first = Loop(cfg, fake_data(cfg), fake_cluster())
    first.on_step = lambda version: None
    log = Log()
    first.run(log)
    checkpoint = tmp_path / "cut" / "default" / "checkpoints" / "step_2"
    assert checkpoint.is_dir()
    again = Loop(cfg, fake_data(cfg), fake_cluster())
    again.resume(checkpoint)
    rest = Log()
    again.run(rest)
    assert [s for s, _ in rest.batches] == [3, 4, 5]
    assert log.batches[:2] + rest.batches == whole.batches


def test_the_wait_names_what_it_waited_for_when_nothing_can_end(tmp_path):
    cluster = fake_cluster()
    cluster.workers["train/0"].cost = lambda job: float("inf")
    with pytest.raises(
        TandemError, match=r"Nothing finished in run.timeout_s=600 s; waiting for: train on train/0"
    ):
        run(tmp_path, cluster=cluster)


def test_pushing_every_n_steps_keeps_the_bound_and_still_validates_each_version_it_names(tmp_path):
    loop, log, _ = run(
        tmp_path,
        "run.mode=async",
        "run.max_staleness=3",
        "sync.every=4",
        "rollout.chunk_groups=1",
        "run.steps=9",
    )
    pushed = sorted({s.start for s in loop.timeline.spans if s.name == "sync" and s.worker == "train/0"})
    assert len(pushed) == 5  # after steps 4 and 8, and for validation after 2, 6 and 9 (the last)
    assert max(r["staleness/max"] for r in log.steps) <= 3
    assert sorted(trained_groups(log)) == list(range(36))
    assert [r["val/version"] for r in log.vals] == [0, 2, 4, 6, 8, 9]


def test_pushing_every_n_steps_needs_the_staleness_to_cover_them():
    with pytest.raises(TandemError, match=r"'sync.every' is 4: .*max_staleness >= N - 1"):
        load_config(None, ["run.mode=async", "run.max_staleness=2", "sync.every=4"])
    with pytest.raises(TandemError, match=r"'sync.every' is 2: .*mode 'sync'"):
        load_config(None, ["sync.every=2"])


@pytest.mark.parametrize(
    "metrics, why",
    [
        ({"critic/advantages/max": 0.0, "critic/advantages/min": 0.0}, "every advantage was 0"),
        ({"actor/skipped_fraction": 1.0}, "every update was skipped for a non-finite loss or gradient"),
    ],
)
def test_a_run_that_learns_nothing_for_five_steps_in_a_row_ends_saying_why(tmp_path, metrics, why):
    with pytest.raises(
        TandemError, match=rf"5 steps in a row \(to step 5\) learned nothing; in the last, {why}"
    ):
        run(tmp_path, "run.steps=20", cluster=fake_cluster(metrics=metrics))
    if "actor/skipped_fraction" in metrics:  # broken, not just flat: a shorter run stops at its end
        with pytest.raises(TandemError, match=r"3 steps in a row \(to step 3\)"):
            run(tmp_path / "short", "run.steps=3", cluster=fake_cluster(metrics=metrics))
    else:  # a smoke run of an untrained model: 3 flat steps are no error
        run(tmp_path / "short", "run.steps=3", cluster=fake_cluster(metrics=metrics))
    _, log, _ = run(
        tmp_path / "some", "run.steps=20", cluster=fake_cluster(metrics={"actor/skipped_fraction": 0.5})
    )
    assert len(log.steps) == 20


def test_a_run_whose_held_out_rewards_all_fail_stops_before_its_first_step(tmp_path):
    with pytest.raises(TandemError, match=r"Every reward of the 6 held-out samples of version 0 failed"):
        run(tmp_path, cluster=fake_cluster(rewards_fail=True))
    with pytest.raises(TandemError, match=r"5 steps in a row .*every reward failed"):  # no held-out data
        run(tmp_path / "train", "run.steps=20", cluster=fake_cluster(rewards_fail=True), val=0)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_stop_signal_while_no_train_step_runs_saves_that_version_at_once_and_resumes(tmp_path, mode):
    """The signal comes while step 3's samples are being rewarded (in sync mode no train step runs
    then): the loop stops within a poll, with a checkpoint of version 2 it can resume to the end."""
    cfg = load_config(None, [*BASE, f"run.out_dir={tmp_path}", f"run.mode={mode}", "run.steps=6"])
    cluster = fake_cluster()
    loop = Loop(cfg, fake_data(cfg), cluster)

    def signal_after_step_2(job):
        if loop.version >= 2 and not loop.stop_signal and (mode == "async" or not loop.training):
            loop.stop_signal = "SIGINT"

    cluster.workers["reward/0"].on_call = signal_after_step_2
    with pytest.raises(Stopped) as stopped:
        loop.run(Log())
    version = stopped.value.version  # async: the signal may come while a step trains (it saves at its end)
    assert version == 2 or mode == "async" and 2 <= version < 6
    assert stopped.value.checkpoint.name == f"step_{version}"
    again = Loop(cfg, fake_data(cfg), fake_cluster())
    again.resume(stopped.value.checkpoint)
    log = Log()
    again.run(log)
    assert [step for step, _ in log.batches] == list(range(version + 1, 7))
