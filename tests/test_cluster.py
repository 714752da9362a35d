"""A short training on a two-node Ray cluster (simulated with ray.cluster_utils.Cluster), joined
with ray.address the way `ray start --head` clusters are; with ray.address empty, a Ray of the
run's own, whatever cluster the machine recorded."""

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from tandem.runtime.cluster import start_ray
from tandem.runtime.run import run_training
from tandem.runtime.startup import load_config
from tandem.sync import free_port

pytestmark = pytest.mark.ray


@pytest.fixture
def two_nodes():
    if ray.is_initialized():
        ray.shutdown()  # a module before this one may have left a single-node Ray running
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_training_spans_two_nodes(tmp_path, two_nodes):
    tests = os.path.dirname(os.path.abspath(__file__))
    ray.init(
        address=two_nodes.address, runtime_env={"env_vars": {"PYTHONPATH": tests}}, logging_level="WARNING"
    )
    cfg = load_config(
        None,
        [
            f"run.out_dir={tmp_path}",
            f"ray.address={two_nodes.address}",
            "run.progress=false",
            "run.mode=one_step_off",
            "run.steps=2",
            "run.val_every=0",
            "rollout.batch_size=4",
            "rollout.n=2",
            "rollout.num_workers=2",
            "data.val_size=8",
            "data.train_size=100",
            "reward.num_workers=1",
            # 4 CPUs in all: trainer 2, each rollout worker 1 - more than either node has alone.
            "placement.groups=[actor_train,generate]",
            "placement.ratios=[0.5,0.5]",
        ],
    )
    placed = {}

    def record_nodes(loop):
        placed.update(ray.util.placement_group_table(loop.cluster.pg)["bundles_to_node_id"])

    summary = run_training(cfg, on_step=record_nodes)
    assert len(set(placed.values())) == 2  # the roles' bundles landed on both nodes
    steps = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "critic/score/mean" in r] == [1, 2]
    assert "val/accuracy_final" in summary


@pytest.fixture
def ray_temp_dir(monkeypatch):
    """Ray's temporary directory (RAY_TMPDIR/ray, where `ray start` records its cluster) in a fresh
    folder, not the machine's /tmp/ray; short, for the sockets Ray puts under it."""
    if ray.is_initialized():
        ray.shutdown()  # the session's Ray: `start_ray` must start one
    root = tempfile.mkdtemp(prefix="tr-", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", root)
    yield Path(root) / "ray"
    ray.shutdown()
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("recorded", ["live", "dead"])
def test_an_empty_ray_address_starts_a_ray_of_the_run_s_own_whatever_the_machine_recorded(
    ray_temp_dir, recorded
):
    """`ray.init()` with no address joins the cluster recorded in ray_current_cluster: a live one
    (refused: "num_cpus ... must not be provided", or worse, the run lands there) or a dead one (a
    wait without end). With ray.address empty the run starts its own."""
    live = Cluster(initialize_head=True, head_node_args={"num_cpus": 1}) if recorded == "live" else None
    try:
        address = live.address if live else f"127.0.0.1:{free_port()}"
        if not live:
            ray_temp_dir.mkdir(parents=True, exist_ok=True)
            (ray_temp_dir / "ray_current_cluster").write_text(address)
        assert (ray_temp_dir / "ray_current_cluster").read_text().strip() == address
        assert start_ray(load_config(None, ["ray.num_cpus=2"]))
        assert ray.get_runtime_context().gcs_address != address
        assert ray.cluster_resources()["CPU"] == 2  # the head recorded has 1
    finally:
        ray.shutdown()
        if live:
            live.shutdown()
