"""reasoning-gym as a data source: `data.task=reasoning_gym:<dataset>` with `data.task_config`.

Rows come from the dataset built with its config; the held-out split shares no question with the
training split; the reward is the dataset's own `score_answer`, compared with reasoning-gym itself;
mistakes are refused at config load with what to do. Skipped without reasoning-gym, except the
test of the error that says to install it.
"""

import importlib.util
import json
import re
import sys

import pytest

from tandem.data.dataset import prompts_from_rows
from tandem.data.tasks import build_task, split_of
from tandem.errors import TandemError
from tandem.reward import RewardPool, load_reward_fn
from tandem.runtime.startup import load_config
from tandem.sample import Prompt, Sample

needs_rg = pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None,
    reason="reasoning-gym is not installed (pip install reasoning-gym)",
)

TASK = "reasoning_gym:basic_arithmetic"
CONFIG = {  # "Calculate 3 + 7." with 1-digit operands: the sums of recipes/reasoning-gym.yaml, smaller
    "min_terms": 2,
    "max_terms": 2,
    "max_digits": 1,
    "operators": ["+"],
    "allow_parentheses": False,
    "allow_negation": False,
}
CONFIG_ARG = "data.task_config=" + json.dumps(CONFIG)


def _entry(row: dict) -> dict:
    """The reasoning-gym entry a row was made from, generated again by reasoning-gym itself."""
    import reasoning_gym

    info = row["extra_info"]["reasoning_gym"]
    dataset = reasoning_gym.create_dataset(info["dataset"], **info["config"])
    return dataset[info["metadata"]["source_index"]]


@needs_rg
def test_rows_are_the_datasets_entries_built_with_its_config():
    rows = build_task(TASK, CONFIG).make_rows(60, seed=3, split="train")
    assert len(rows) == 60
    for row in rows:
        entry = _entry(row)
        question = row["prompt"][0]["content"]
        assert row["prompt"] == [{"role": "user", "content": entry["question"]}]
        assert row["reward_model"]["ground_truth"] == entry["answer"]
        assert row["extra_info"]["reasoning_gym"]["metadata"] == entry["metadata"]
        assert row["data_source"] == "reasoning_gym"
        assert re.fullmatch(r"Calculate \d+ \+ \d+\.", question), question  # the config, not the defaults
        a, b = map(int, re.findall(r"\d+", question))
        assert int(entry["answer"]) == a + b and a <= 10 and b <= 10
    config = rows[0]["extra_info"]["reasoning_gym"]["config"]
    assert config["seed"] == 3 and {k: config[k] for k in CONFIG} == CONFIG
    assert rows == build_task(TASK, CONFIG).make_rows(60, seed=3, split="train")  # deterministic


@needs_rg
def test_the_held_out_split_shares_no_question_with_the_training_split():
    """Built as `tandem train` builds them (train: run.seed, held out: run.seed + 1). A seed per split
    alone would not do: reasoning-gym's entry i of seed s + 1 is entry i + 1 of seed s."""
    import reasoning_gym

    task = build_task(TASK, {**CONFIG, "max_digits": 2})
    train = {r["prompt"][0]["content"] for r in task.make_rows(3000, seed=0, split="train")}
    test = {r["prompt"][0]["content"] for r in task.make_rows(200, seed=1, split="test")}
    assert len(test) > 50 and len(train) > 1000
    assert not train & test
    assert all(split_of(q) == "test" for q in test) and all(split_of(q) == "train" for q in train)
    seed0 = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=50, **CONFIG)
    seed1 = reasoning_gym.create_dataset("basic_arithmetic", seed=1, size=50, **CONFIG)
    assert [seed0[i + 1]["question"] for i in range(49)] == [seed1[i]["question"] for i in range(49)]


def _prompts(dataset: str, config: dict, n: int) -> tuple[list[dict], list[Prompt]]:
    rows = build_task(f"reasoning_gym:{dataset}", config).make_rows(n, seed=0, split="test")
    return rows, prompts_from_rows(rows)


@needs_rg
@pytest.mark.parametrize(
    "dataset, config",
    [("basic_arithmetic", CONFIG), ("countdown", {}), ("spell_backward", {})],
    ids=["basic_arithmetic", "countdown-uses-metadata", "spell_backward"],
)
def test_the_reward_is_the_datasets_own_score_answer(dataset, config):
    """On right, wrong, partly right and empty answers, reward.fn=auto gives what reasoning-gym's
    own `score_answer` gives on the entry reasoning-gym generates (countdown's scorer reads the
    entry's metadata, and gives 0.01 / 0.05 / 1.0)."""
    import reasoning_gym

    rows, prompts = _prompts(dataset, config, 8)
    auto = load_reward_fn("auto")
    scores = []
    for row, prompt in zip(rows, prompts, strict=True):
        entry = _entry(row)
        own = reasoning_gym.create_dataset(dataset, **row["extra_info"]["reasoning_gym"]["config"])
        for answer in (entry["answer"], entry["answer"] + " so", "7", "", "-(1)"):
            expected = own.score_answer(answer=answer, entry=entry)
            assert auto(prompt, answer) == (pytest.approx(expected), {}), answer
            scores.append(expected)
    assert 1.0 in scores and len(set(scores)) >= 3  # the answers above tell right from wrong


@needs_rg
def test_the_reward_pool_scores_in_its_worker_processes():
    rows, prompts = _prompts("basic_arithmetic", CONFIG, 4)
    answers = [rows[0]["reward_model"]["ground_truth"], "x", rows[2]["reward_model"]["ground_truth"], "999"]
    samples = [
        Sample(prompt=p, prompt_ids=[1], response_text=a) for p, a in zip(prompts, answers, strict=True)
    ]
    with RewardPool("auto", num_workers=1, timeout_s=30) as pool:
        counts = pool.score(samples)
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0]
    assert counts["reward/errors"] == counts["reward/timeouts"] == 0


@needs_rg
def test_sft_demonstrations_answer_with_the_entrys_answer():
    from tandem.data.tokenizer import build_char_tokenizer
    from tandem.train.sft import demonstrations

    tok = build_char_tokenizer()
    cfg = load_config(None, [f"data.task={TASK}", CONFIG_ARG])
    for s in demonstrations(cfg, tok, 20):
        question = s.prompt.messages[-1]["content"]
        a, b = map(int, re.findall(r"\d+", question))
        assert tok.decode(s.response_ids, skip_special_tokens=True) == str(a + b)
    cfg = load_config(None, [f"data.task={TASK}", CONFIG_ARG, "sft.flawed_fraction=0.5"])
    with pytest.raises(TandemError, match="no flawed solution.*sft.flawed_fraction=0"):
        demonstrations(cfg, tok, 20)


@needs_rg
@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["data.task=reasoning_gym:basic_arithmatic"],
            r"no dataset 'basic_arithmatic'\. Did you mean reasoning_gym:basic_arithmetic.*"
            r"list them with: python -c",
        ),
        (
            [f"data.task={TASK}", "data.task_config.max_term=2"],
            r"'data.task_config' has the key 'max_term', which reasoning-gym's dataset "
            r"'basic_arithmetic' does not take\. Its keys: min_terms, max_terms",
        ),
        (
            [f"data.task={TASK}", "data.task_config.min_terms=3", "data.task_config.max_terms=2"],
            r"'basic_arithmetic' refused data.task_config=.*AssertionError: max_terms must be >= min_terms",
        ),
        ([f"data.task={TASK}", "data.task_config.seed=5"], r"'data.task_config' sets 'seed'.*run.seed"),
        ([f"data.task={TASK}", "data.task_config=3"], r"'data.task_config' must be a mapping"),
        (["data.task=reasoning_gym"], r"not a known task.*Did you mean 'reasoning_gym:<dataset>'"),
    ],
    ids=["unknown-dataset", "unknown-key", "bad-value", "reserved-key", "not-a-mapping", "no-dataset"],
)
def test_mistakes_are_refused_at_config_load(overrides, expected):
    with pytest.raises(TandemError, match=expected):
        load_config(None, overrides)


def test_without_reasoning_gym_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` raises ImportError
    with pytest.raises(TandemError, match=r"needs the reasoning-gym package.*pip install reasoning-gym"):
        load_config(None, [f"data.task={TASK}"])
    load_config(None, [])  # the built-in tasks need no reasoning-gym


def test_task_config_is_a_built_in_tasks_arguments_too():
    rows = build_task("addition", {"max_digits": 1}).make_rows(50, seed=0)
    assert all(len(r["reward_model"]["ground_truth"]) <= 2 for r in rows)
    assert load_config(None, ["data.task_config.max_digits=3"]).data.task_config == {"max_digits": 3}
    with pytest.raises(
        TandemError, match=r"has the key 'digits', which task 'addition' does not take.*max_digits"
    ):
        load_config(None, ["data.task_config.digits=3"])
    with pytest.raises(TandemError, match=r"'data.task_config' is set, but data.train_files"):
        load_config(None, ["data.train_files=[a.jsonl]", "data.task_config.max_digits=3"])


@needs_rg
@pytest.mark.ray
def test_tandem_train_on_a_reasoning_gym_dataset(tmp_path):
    from tandem.cli.main import main

    args = ["train", f"data.task={TASK}", CONFIG_ARG, "run.steps=2", f"run.out_dir={tmp_path}"]
    small = ["run.progress=false", "rollout.batch_size=4", "rollout.n=4", "data.train_size=64"]
    assert main([*args, *small, "data.val_size=16", "reward.num_workers=1"]) == 0
    lines = (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    steps = [r for r in records if "reward/errors" in r]
    assert len(steps) == 2 and all(r["reward/errors"] == r["reward/timeouts"] == 0 for r in steps)
    assert [r["val/reward_errors"] for r in records if "val/accuracy" in r] == [0.0, 0.0]
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    assert "val/accuracy_final" in summary


@needs_rg
def test_rows_written_to_a_file_are_scored_from_the_file(tmp_path):
    """`tandem data make reasoning_gym:<dataset>` writes rows that reward.fn=auto scores from the
    file: countdown's scorer needs the entry's metadata (its numbers and target), kept in extra_info."""
    from tandem.data.dataset import load_prompts
    from tandem.data.tasks import make_dataset

    path = make_dataset("reasoning_gym:countdown", str(tmp_path / "cd.jsonl"), n=5, split="test")
    auto = load_reward_fn("auto")
    for p in load_prompts(path):
        assert auto(p, p.ground_truth) == (1.0, {})
        assert auto(p, "0")[0] == 0.05  # a well-formed expression with the wrong numbers
