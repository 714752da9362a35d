"""Placement plans: task groups and ratios become per-actor CPU shares and thread counts."""

import pytest

from tandem.config import load_config
from tandem.controller.placement import bundle, plan
from tandem.errors import TandemError


def slots_by_role(overrides, cpus):
    out = {}
    for s in plan(load_config(None, overrides), cpus):
        out.setdefault(s.role, []).append(s)
    return out


def test_colocated_roles_share_every_cpu_and_take_all_threads():
    roles = slots_by_role([], 4)
    assert set(roles) == {"generate", "actor_train"}
    assert [s.threads for r in roles.values() for s in r] == [4, 4]
    assert sum(s.cpus for r in roles.values() for s in r) == pytest.approx(4)


def test_task_groups_split_cpus_by_ratio():
    roles = slots_by_role(
        [
            "placement.groups=[[logp,actor_train],ref_logp,generate]",
            "placement.ratios=[0.5,0.25,0.25]",
            "algo.kl_coef=0.01",
            "rollout.num_workers=2",
        ],
        8,
    )
    assert [s.cpus for s in roles["actor_train"]] == [4]
    assert [s.cpus for s in roles["ref_logp"]] == [2]
    assert [(s.cpus, s.threads) for s in roles["generate"]] == [(1, 1), (1, 1)]
    bundles = [s.bundle for r in roles.values() for s in r]
    assert sorted(bundles) == list(range(len(bundles)))


def test_ref_worker_joins_the_trainers_group_when_not_placed():
    roles = slots_by_role(
        ["placement.groups=[actor_train,generate]", "placement.ratios=[0.5,0.5]", "algo.kl_coef=0.1"], 4
    )
    assert [s.cpus for s in roles["actor_train"]] == [1] and [s.cpus for s in roles["ref_logp"]] == [1]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["placement.groups=[actor_train,generate]", "placement.ratios=[1.0]"], "one ratio per task group"),
        (["placement.groups=[actor_train,generate]", "placement.ratios=[0.7,0.7]"], "add up to 1"),
        (["placement.groups=[[actor_train],[generate,logp]]", "placement.ratios=[0.5,0.5]"], "same group"),
        (["placement.groups=[actor_train,rollout]", "placement.ratios=[0.5,0.5]"], "Valid names"),
        (["placement.groups=[actor_train]", "placement.ratios=[1.0]"], "must place 'generate'"),
        (["placement.ratios=[1.0]"], "needs placement.groups"),
    ],
)
def test_bad_placement_is_a_clear_error(overrides, message):
    with pytest.raises(TandemError, match=message):
        load_config(None, overrides)


def test_a_group_with_nothing_to_run_is_an_error():
    cfg = load_config(
        None, ["placement.groups=[actor_train,ref_logp,generate]", "placement.ratios=[0.5,0.25,0.25]"]
    )
    with pytest.raises(TandemError, match="runs nothing"):
        plan(cfg, 4)


def test_vllm_rollout_workers_each_reserve_a_gpu_and_nothing_else_does():
    slots = plan(load_config(None, ["rollout.engine=vllm", "rollout.num_workers=2"]), 4)
    assert [bundle(s)["GPU"] for s in slots if s.role == "generate"] == [1.0, 1.0]
    assert all("GPU" not in bundle(s) for s in slots if s.role != "generate")
    assert all("GPU" not in bundle(s) for s in plan(load_config(None, []), 4))
