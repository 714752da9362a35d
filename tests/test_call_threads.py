"""No call thread dies: a call that raises a BaseException which is no stop request (torch's
CheckpointException, from a damaged checkpoint's load or a save on a full disk) ends with an error
naming it, and the worker serves the next call; a stop request still ends the calls' thread. On
`tandem train`'s one-process cluster, `tandem serve`'s one-process workers and Ray's actors."""

from dataclasses import replace

import pytest
import torch.distributed.checkpoint as dcp
from helpers import Crash, full_disk, raising, random_samples

from tandem import devices
from tandem.config import Config
from tandem.controller.protocol import CallFailed
from tandem.runtime.local import CallStopped, LocalCluster


def config(tmp_path) -> Config:
    """The default run, writing under `tmp_path`, waiting 30 s at most for a call."""
    cfg = Config()
    return replace(cfg, run=replace(cfg.run, out_dir=str(tmp_path), progress=False, timeout_s=30.0))


def error_of(cluster: LocalCluster, worker: str, method: str, *args) -> Exception | None:
    """The error that ended `worker.method(*args)`, which must end within 30 s."""
    done = cluster.wait_next([cluster.submit(worker, method, *args)], 30)
    assert done is not None, f"{worker}.{method} never ended: the calls' thread died"
    return done.error


def assert_ended(cluster: LocalCluster) -> None:
    """The cluster's calls' thread has ended, or does within 5 s."""
    cluster.thread.join(5)
    assert not cluster.thread.is_alive()


def test_tandem_train_in_one_process_survives_a_base_exception_in_a_train_call_and_a_save(
    tmp_path, monkeypatch
):
    cluster = LocalCluster.start(devices.resolve(config(tmp_path), 0))
    samples = random_samples(2, 2)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(cluster.workers["train/0"].trainer, "train_step", raising(Crash("mid-step")))
            error = error_of(cluster, "train/0", "train_step", samples)
        assert isinstance(error, CallFailed) and "train/0.train_step" in str(error)
        assert "Crash: mid-step" in str(error)
        metrics, _ = cluster.get([cluster.submit("train/0", "train_step", samples)], 30)[0]
        assert "actor/pg_loss" in metrics
        with monkeypatch.context() as patch:
            patch.setattr(dcp, "save", full_disk)
            error = error_of(cluster, "train/0", "save", str(tmp_path / "full"))
        assert isinstance(error, CallFailed) and "CheckpointException" in str(error)
        assert "No space left on device" in str(error)
        cluster.get([cluster.submit("train/0", "save", str(tmp_path / "saved"))], 30)
        assert (tmp_path / "saved" / "model.safetensors").is_file()
    finally:
        cluster.close()
    assert_ended(cluster)


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_a_stop_request_raised_in_a_call_ends_that_call_then_the_calls_thread(stop):
    class Stopping:
        def stop(self) -> None:
            raise stop

    cluster = LocalCluster({"reward/0": Stopping()}, {"reward": ["reward/0"]})
    error = error_of(cluster, "reward/0", "stop")
    assert isinstance(error, CallStopped) and stop.__name__ in str(error)
    assert_ended(cluster)


def test_tandem_serve_in_one_process_survives_a_base_exception_in_a_train_call_and_a_save(
    tmp_path, monkeypatch
):
    """Where the trainer's call thread used to die: that call, every later one and Ctrl-C then
    waited run.timeout_s, and no new model could be made."""
    pytest.importorskip("fastapi")
    from tandem.runtime.startup import resolve_inputs
    from tandem.serve.workers import start_workers

    workers = start_workers(resolve_inputs(config(tmp_path)))
    adam = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, grad_clip=1.0)
    learner = workers.train.workers["train/0"].trainer.learner
    try:
        workers.call("train", "add_model", "m", 0)
        with monkeypatch.context() as patch:
            patch.setattr(learner, "step", raising(Crash("mid-step")))
            with pytest.raises(CallFailed, match="Crash: mid-step"):
                workers.call("train", "optim_step", "m", adam)
        assert "grad_norm:mean" in workers.call("train", "optim_step", "m", adam)
        with monkeypatch.context() as patch:
            patch.setattr(dcp, "save", full_disk)
            with pytest.raises(CallFailed, match=r"CheckpointException(.|\n)*No space left on device"):
                workers.call("train", "save_model", "m", str(tmp_path / "full"))
        workers.call("train", "save_model", "m", str(tmp_path / "saved"))
        # and the engine's thread takes the trained weights
        workers.call("rollout", "serve_weights", workers.call("train", "snapshot", "m"))
    finally:
        workers.close()
    assert_ended(workers.train)
    assert_ended(workers.rollout)


class Flaky:
    """A worker whose train call and save each raise a BaseException the first time -> how many
    calls it has had, which a restarted actor would have forgotten."""

    def __init__(self):
        self.calls = 0

    def ready(self) -> float:
        return 0.0

    def train_step(self) -> int:
        self.calls += 1
        if self.calls == 1:
            raise Crash("mid-step")
        return self.calls

    def save(self) -> int:
        self.calls += 1
        if self.calls == 3:
            full_disk()
        return self.calls


@pytest.mark.ray
def test_a_ray_actor_survives_a_base_exception_in_a_train_call_and_a_save(ray_local):
    """Ray ends such a call with a RayTaskError (a CallFailed to the loop) and the actor, not
    restarted, answers the next."""
    from tandem.runtime.cluster import RayCluster, ray_actor

    cluster = RayCluster({"train": [ray_actor(Flaky).options(num_cpus=0).remote()]}, slots=[])
    call = cluster.submit
    try:
        with pytest.raises(CallFailed, match="Crash: mid-step"):
            cluster.get([call("train/0", "train_step")], 30)
        assert cluster.get([call("train/0", "train_step")], 30) == [2]
        with pytest.raises(CallFailed, match=r"CheckpointException(.|\n)*No space left on device"):
            cluster.get([call("train/0", "save")], 30)
        assert cluster.get([call("train/0", "save")], 30) == [4]
    finally:
        cluster.close()
