"""A short training on a two-node Ray cluster (simulated with ray.cluster_utils.Cluster), joined
with ray.address the way `ray start --head` clusters are."""

import json
import os

import pytest
import ray
from ray.cluster_utils import Cluster

from tandem.config import load_config
from tandem.runtime.run import run_training

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
