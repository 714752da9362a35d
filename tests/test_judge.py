"""reward.fn=judge: a generative reward model on a judge worker of its own (tandem.reward.judge).
Its parsers and template, its failures (unparsable output, a timeout) counted as reward errors that
cost only their samples, its row in the roles table, the config it refuses, and a run through it."""

import json

import pytest
from test_determinism import TINY

from tandem.config.schema import JudgeConfig
from tandem.data.tasks import build_task
from tandem.errors import TandemError
from tandem.reward.judge import JUDGE_PARSERS, JudgeWorker, render, template_error
from tandem.reward.user_fn import load_reward_fn
from tandem.runtime.role_table import in_run
from tandem.runtime.startup import load_config
from tandem.sample import Prompt, Sample


def _sample(question: str, response: str, truth: str) -> Sample:
    messages = [{"role": "user", "content": question}]
    prompt = Prompt(messages=messages, ground_truth=truth, data_source="addition")
    return Sample(prompt=prompt, prompt_ids=[5], response_text=response)


@pytest.mark.parametrize(
    "parser, text, score",
    [
        ("yes_no", "81 yes", 1.0),
        ("yes_no", "No.", 0.0),
        ("yes_no", "81", None),
        ("yes_no", "yes maybe", None),
        ("score", "Score: 0.8 of 1", 0.8),
        ("score", "7", None),
        ("score", "none", None),
    ],
)
def test_parsers_read_a_verdict_or_say_they_cannot(parser, text, score):
    assert JUDGE_PARSERS.get(parser)(text) == score


def test_the_template_renders_prompt_response_and_reference_and_refuses_other_fields():
    s = _sample("23+58=", "81", "81")
    assert render("{prompt}{response}? ({reference})", s.prompt, "81") == "23+58=81? (81)"
    assert template_error("{prompt}{response}?") == ""
    assert "{answer}" in template_error("{prompt}{answer}")
    assert "response" in template_error("{prompt}")
    assert "format string" in template_error("{prompt")


def test_the_judge_data_claims_right_and_wrong_sums_half_and_half():
    """Half the claims right; about one in seven the sum with its carries dropped (the warm start's
    own mistake: half the wrong claims where the problem has a carry). The working is the sum,
    then the claim beside it, then the verdict."""
    task, addition = build_task("addition_judge"), build_task("addition")
    rows = task.make_rows(1000, seed=0)
    verdicts = [task.solution(r).split(" ")[-1] for r in rows]
    assert [r["reward_model"]["ground_truth"] for r in rows] == verdicts
    assert 0.45 < verdicts.count("yes") / len(rows) < 0.55
    claims = [r["prompt"][0]["content"].removesuffix("?").split("=", 1) for r in rows]
    dropped = [
        c
        for (p, c), v in zip(claims, verdicts, strict=True)
        if v == "no" and c == addition.flawed_solution({"prompt": p + "="}, None)
    ]
    assert 0.1 < len(dropped) / len(rows) < 0.18
    assert task.solution({"prompt": "23+58=71?", "reward_model": {}}) == "81 71 no"
    assert task.solution({"prompt": "23+58=81?", "reward_model": {}}) == "81 81 yes"


def _judge(timeout_s: float = 30.0) -> JudgeWorker:
    """builtin:addition as a judge: it answers a sum ("23+58=81?" -> a number), never yes or no,
    so under the yes_no parser every verdict is garbage."""
    from tandem.data.tokenizer import load_tokenizer
    from tandem.model.checkpoint import load_model
    from tandem.model.config import model_dir
    from tandem.rollout.engine import BuiltinEngine

    path = model_dir("builtin:addition")
    model, tokenizer = load_model(path), load_tokenizer(path)
    engine = BuiltinEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    judge = JudgeConfig(path="builtin:addition", timeout_s=timeout_s)
    return JudgeWorker(engine, tokenizer, judge, load_reward_fn("auto"), model.cfg.max_position_embeddings)


def test_a_judge_answering_garbage_costs_only_its_samples_counted_as_reward_errors():
    samples = [_sample("23+58=", "81", "81"), _sample("2+2=", "5", "4")]
    samples[0].agent_reward = 0.5  # the agent's own reward is kept, never judged
    metrics = _judge().score(samples)
    assert metrics == {"reward/errors": 1.0, "reward/timeouts": 0.0}
    assert samples[0].reward == 0.5
    assert samples[1].reward == 0.0
    assert samples[1].reward_parts == {"judge": 0.0, "verifier": 0.0, "judge/agreement": 0.0}


def test_a_judge_that_does_not_answer_in_time_costs_its_samples_as_timeouts():
    samples = [_sample("23+58=", "81", "81"), _sample("2+2=", "4", "4")]
    metrics = _judge(timeout_s=1e-9).score(samples)
    assert metrics == {"reward/errors": 0.0, "reward/timeouts": 2.0}
    assert [s.reward for s in samples] == [0.0, 0.0]


def test_the_judge_is_a_role_of_the_table_only_with_reward_fn_judge():
    plain = load_config(None, [])
    judged = load_config(None, ["reward.fn=judge", "reward.judge.path=builtin:addition"])
    assert "judge" not in [r.name for r in in_run(plain)]
    assert [r.name for r in in_run(judged)] == ["rollout", "train", "judge", "reward"]
    assert judged.reward.pool_fn == "auto"  # held-out rewards stay the verifier's


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["reward.fn=judge"], "'reward.judge.path' must name the judge model"),
        (["reward.judge.path=builtin:addition"], "reward.fn='auto' never asks a judge"),
        (["reward.fn=judge", "reward.judge.path=x", "reward.judge.parser=yesno"], "Did you mean 'yes_no'"),
        (["reward.fn=judge", "reward.judge.path=x", "reward.judge.template='{answer}'"], "has the field"),
        (["reward.fn=judge", "reward.judge.path=x", "reward.judge.verifier=judge"], "reward.judge.verifier"),
        (["reward.fn=judge", "reward.judge.path=x", "reward.judge.timeout_s=0"], "reward.judge.timeout_s"),
    ],
)
def test_a_bad_judge_config_is_refused_by_name(overrides, message):
    with pytest.raises(TandemError, match=message.replace("(", r"\(")):
        load_config(None, overrides)


def _parity(text: str) -> float | None:
    """A test parser: an odd number is right, an even one wrong, anything else unreadable."""
    return float(int(text) % 2) if text.strip().isdigit() else None


@pytest.mark.integration  # seconds of CPU: out of the unit tier (< 2 minutes)
def test_a_run_rewards_through_the_judge_and_validates_on_the_verifier(tmp_path):
    """The loop's reward calls go to the judge worker, its failures are counted, not fatal, and the
    held-out accuracy is the verifier's."""
    from tandem.runtime.run import run_training

    if "parity" not in JUDGE_PARSERS.names():
        JUDGE_PARSERS.register("parity")(_parity)  # the one-process cluster holds the judge here
    out = tmp_path / "runs"
    judge = ["reward.fn=judge", "reward.judge.path=builtin:addition", "reward.judge.parser=parity"]
    local = "run.cluster=local"  # the test's parser is registered in this process only, not in Ray's
    summary = run_training(load_config(None, [*TINY, *judge, local, f"run.out_dir={out}"]))
    rows = [json.loads(line) for line in (out / "default" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == 4
    assert all("reward/judge/mean" in r and "reward/judge/agreement/mean" in r for r in steps)
    assert all(r["timing_s/judge"] > 0 for r in steps)
    assert 0.0 < summary["val/accuracy_final"] <= 1.0  # the verifier's: the judge never validates


def test_a_judge_that_is_not_there_is_refused_by_its_key_before_any_worker_starts(tmp_path):
    from tandem.runtime.roles import build_data

    cfg = load_config(None, [*TINY, "reward.fn=judge", f"reward.judge.path={tmp_path / 'none'}"])
    with pytest.raises(TandemError, match=r"\(reward.judge.path\) does not exist.*recipes/sft-judge.yaml"):
        build_data(cfg)


@pytest.mark.ray
def test_on_ray_the_judge_worker_answers_every_reward_call_and_only_the_run_s_rule_stops_it(tmp_path):
    """run.mode=async on Ray: the judge is an actor of its own (its row of the roles table), the
    reward calls of every step reach it, and a judge whose every verdict is garbage (builtin:addition
    answers a number, never yes or no) costs its samples, counted; what ends the run is the run's
    own rule (docs/rewards.md "Judge": five steps in a row with nothing to learn from), with its
    message, not a crash of the judge."""
    from tandem.runtime.run import run_training

    out = tmp_path / "runs"
    judge = ["reward.fn=judge", "reward.judge.path=builtin:addition", "reward.judge.parser=yes_no"]
    overrides = [
        *TINY,
        *judge,
        "run.steps=8",
        "run.mode=async",
        "run.deterministic=false",
        f"run.out_dir={out}",
    ]
    with pytest.raises(TandemError, match="5 steps in a row .* learned nothing"):
        run_training(load_config(None, overrides))
    rows = [json.loads(line) for line in (out / "default" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == 5
    assert sum(r.get("timing_s/judge", 0.0) for r in steps) > 0  # async: a step's window may hold none
    assert sum(r["reward/errors"] for r in steps) >= 5 * 4 * 4  # every sample trained on, counted
    assert all(r["reward/judge/mean"] == 0.0 == r["reward/judge/agreement/mean"] for r in steps)


@pytest.mark.slow  # the judge's SFT takes minutes on 2 cores (docs/rewards.md "The addition judge")
def test_the_recipes_train_a_judge_that_agrees_with_the_verifier_and_teaches_the_task(tmp_path):
    """recipes/sft-judge.yaml, then recipes/judge.yaml for 30 steps: the judge agrees with the
    addition verifier on at least 95% of the policy's samples, and its rewards alone take the
    default task from 44.9% to at least 90% held-out."""
    from tandem.runtime.run import run_training
    from tandem.train.sft import run_sft

    judge = run_sft(load_config("recipes/sft-judge.yaml", [f"sft.out={tmp_path / 'judge'}"]))
    out = tmp_path / "runs"
    overrides = [f"reward.judge.path={judge}", f"run.out_dir={out}", "run.steps=30", "run.progress=false"]
    summary = run_training(load_config("recipes/judge.yaml", overrides))
    rows = [json.loads(line) for line in (out / "judge" / "metrics.jsonl").read_text().splitlines()]
    agreement = [r["reward/judge/agreement/mean"] for r in rows if "reward/judge/agreement/mean" in r]
    assert len(agreement) == 30 and sum(agreement) / 30 >= 0.95
    assert summary["val/accuracy_final"] >= 0.90
