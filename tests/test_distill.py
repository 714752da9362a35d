"""On-policy distillation (algo.distill): the teacher role scores every sampled token, and the
per-token reverse KL, log π_teacher - log μ, is the advantage (alone, or added to the task's)."""

import json

import pytest
import torch
from helpers import random_samples, train_worker, write_tiny_checkpoint
from test_determinism import TINY

from tandem.config.schema import AlgoConfig, DistillConfig
from tandem.errors import TandemError
from tandem.runtime.role_table import in_run
from tandem.runtime.startup import load_config
from tandem.train.advantages import advantages
from tandem.train.batch import pad_rows


def _samples():
    samples = random_samples(2, 4, seed=3)
    gen = torch.Generator().manual_seed(0)
    for s in samples:
        s.teacher_logprobs = (-torch.rand(len(s.response_ids), generator=gen) * 3).tolist()
        s.reward = float(s.index % 2)
    return samples


def test_the_advantage_is_coef_times_teacher_minus_sampling_logprob_per_token():
    samples = _samples()
    width = max(len(s.response_ids) for s in samples)
    mask = pad_rows([s.loss_mask for s in samples], width)
    teacher, mu = (
        pad_rows([getattr(s, f) for s in samples], width) for f in ("teacher_logprobs", "logprobs")
    )
    alone = advantages(samples, mask, AlgoConfig(distill=DistillConfig(teacher="t", coef=0.5)))
    assert torch.equal(alone, 0.5 * (teacher - mu) * mask)
    task = advantages(samples, mask, AlgoConfig())  # GRPO's, from the rewards
    assert task.abs().sum() > 0
    both = advantages(samples, mask, AlgoConfig(distill=DistillConfig(teacher="t", task_reward=True)))
    assert torch.allclose(both, (teacher - mu) * mask + task)


def test_a_sample_without_the_teacher_s_logprobs_is_refused_not_trained_on():
    samples = _samples()
    samples[1].teacher_logprobs = []
    worker = train_worker(algo={"distill": DistillConfig(teacher="t")})
    with pytest.raises(TandemError, match="teacher_logprobs"):
        worker.train_step(samples)


def test_the_teacher_is_a_role_of_the_table_only_when_the_run_distills():
    plain = load_config(None, [])
    distill = load_config(None, ["algo.distill.teacher=builtin:addition"])
    assert "teacher" not in [r.name for r in in_run(plain)]
    assert [r.name for r in in_run(distill)] == ["rollout", "train", "teacher", "reward"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.distill.coef=0"], "algo.distill.coef"),
        (["algo.adv_estimator=gae"], "algo.adv_estimator=gae"),
    ],
)
def test_settings_distillation_cannot_use_are_refused_by_name(overrides, message):
    with pytest.raises(TandemError, match=message):
        load_config(None, ["algo.distill.teacher=builtin:addition", *overrides])


def test_a_teacher_with_another_vocabulary_is_refused_by_name(tmp_path):
    from tandem.runtime.run import run_training

    teacher = write_tiny_checkpoint(tmp_path / "teacher")  # the byte-level tokenizer, one token more
    tokenizer_file = teacher / "tokenizer.json"
    data = json.loads(tokenizer_file.read_text())
    data["added_tokens"].append(
        {"id": max(t["id"] for t in data["added_tokens"]) + 1, "content": "<extra>", "single_word": False,
         "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    )  # fmt: skip
    tokenizer_file.write_text(json.dumps(data))
    cfg = load_config(None, [*TINY, f"algo.distill.teacher={teacher}", f"run.out_dir={tmp_path / 'runs'}"])
    with pytest.raises(TandemError, match=rf"algo.distill.teacher={teacher} has another vocabulary"):
        run_training(cfg)


def test_a_vocabulary_mismatch_counts_within_each_vocabulary(tmp_path):
    """Once "261 vs 261 tokens, 512 of them mapped differently": the student's tokens missing from
    the teacher's and the teacher's missing from the student's were summed into one count."""
    from tandem.runtime.run import run_training

    teacher = write_tiny_checkpoint(tmp_path / "teacher")
    tokenizer_file = teacher / "tokenizer.json"
    data = json.loads(tokenizer_file.read_text())
    special = {t["content"] for t in data["added_tokens"]}
    vocab = data["model"]["vocab"]  # every byte's token renamed: 256 tokens neither vocabulary shares
    data["model"]["vocab"] = {(t if t in special else f"{t}'"): i for t, i in vocab.items()}
    tokenizer_file.write_text(json.dumps(data))
    cfg = load_config(None, [*TINY, f"algo.distill.teacher={teacher}", f"run.out_dir={tmp_path / 'runs'}"])
    with pytest.raises(TandemError) as e:
        run_training(cfg)
    message = " ".join(str(e.value).split())
    assert "261 vs 261 tokens; 256 of the student's 261 have another id in the teacher's or none" in message
    assert "and 256 of the teacher's 261 are not the student's" in message


@pytest.mark.integration  # seconds of CPU: out of the unit tier (< 2 minutes)
def test_a_teacher_equal_to_the_student_gives_exactly_zero_advantages_in_a_deterministic_run(tmp_path):
    """run.deterministic: the teacher's forward is the trainer's and the engine's, bit for bit, so a
    teacher that is the student's own start finds every sampled token exactly as likely as the
    student did: the first step has no signal at all (every row's backward skipped)."""
    from tandem.runtime.run import run_training

    out = tmp_path / "runs"
    overrides = [*TINY, "run.deterministic=true", "run.steps=1", "algo.distill.teacher=builtin:addition"]
    run_training(load_config(None, [*overrides, f"run.out_dir={out}"]))
    rows = [json.loads(line) for line in (out / "default" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "actor/pg_loss" in r)
    assert step["actor/no_signal_fraction"] == 1.0
    assert step["critic/advantages/max"] == 0.0 == step["critic/advantages/min"]


def _steps(out, overrides: list[str]) -> list[dict]:
    """The train steps' metrics of a TINY run distilling from a random model of the student's
    tokenizer (a teacher equal to the student would give no signal at all: see above)."""
    from tandem.runtime.run import run_training

    teacher = write_tiny_checkpoint(out / "teacher")
    run_training(
        load_config(None, [*TINY, f"algo.distill.teacher={teacher}", *overrides, f"run.out_dir={out}"])
    )
    rows = [json.loads(line) for line in (out / "default" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "actor/pg_loss" in r]


@pytest.mark.integration  # seconds of CPU: out of the unit tier (< 2 minutes)
def test_a_lora_student_distills_with_adapter_only_pushes(tmp_path):
    steps = _steps(tmp_path, ["train.lora.rank=4", "train.lr=1e-3"])
    assert len(steps) == 4 and all(r["actor/no_signal_fraction"] < 1 for r in steps)


@pytest.mark.ray
@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_distillation_runs_in_the_overlapped_modes(tmp_path, mode):
    """The teacher worker scores groups as they are rewarded, whichever mode admits them."""
    steps = _steps(tmp_path, [f"run.mode={mode}", "run.deterministic=false"])
    assert len(steps) == 4 and all(r["critic/advantages/max"] > r["critic/advantages/min"] for r in steps)
