"""rollout.agent=verifiers:...: a verifiers v1 environment (tandem/agent/verifiers_example.py: the
addition rows, asked twice, a rubric of two exact-answer rewards) played by a rollout worker on the
built-in engine and a tiny decoder. The reward a sample records is what the environment's rubric
gives for its completions (recomputed by verifiers alone, against a server replaying them); the
second turn extends the first (its prompt reuses the first turn's token ids); a rubric that raises
ends the episode with reward 0; the environment's own tasks become tandem rows and back."""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import Scripted, tiny_config

pytest.importorskip("openai", reason="the openai client is not installed (pip install openai)")
vf = pytest.importorskip("verifiers.v1", reason="verifiers is not installed (pip install verifiers)")

from tandem.agent import build_agent  # noqa: E402
from tandem.agent.chat import ChatRenderer  # noqa: E402
from tandem.agent.verifiers_env import build_env, reward_of, rows, task_of  # noqa: E402
from tandem.agent.verifiers_example import load_environment  # noqa: E402
from tandem.data.dataset import load_prompts, save_rows  # noqa: E402
from tandem.data.tasks import TASKS  # noqa: E402
from tandem.data.tokenizer import build_char_tokenizer  # noqa: E402
from tandem.errors import TandemError  # noqa: E402
from tandem.model.decoder import CausalLM, init_weights  # noqa: E402
from tandem.rollout.engine import BuiltinEngine  # noqa: E402
from tandem.rollout.group import make_groups  # noqa: E402
from tandem.rollout.worker import RolloutWorker  # noqa: E402
from tandem.sample import Prompt, SamplingParams, Status  # noqa: E402

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=120)
EXAMPLE = "verifiers:tandem.agent.verifiers_example:load_environment"
ROW = TASKS.get("addition")().make_rows(1, 0, "train")[0]  # 61+71= -> 132
QUESTION, SUM = ROW["prompt"][0]["content"], ROW["reward_model"]["ground_truth"]


def raising_rubric_env() -> vf.Env:
    """The example with one more reward function, plugged through verifiers' task config."""
    return load_environment(task={"rewards": {"boom": {"fn": "test_verifiers_env:boom"}}})


async def boom(trace) -> float:
    raise ValueError("the rubric's own bug")


def not_an_env() -> int:
    return 42


def null_harness_env() -> vf.Env:
    return vf.load_environment(
        vf.resolve_env_config({"taskset": {"id": "tandem-addition"}, "agent": {"harness": {"id": "null"}}})
    )


def scripted(script: dict[int, str]) -> Scripted:
    """A tiny random decoder that writes `script[p]` then EOS after `p` prompt tokens."""
    return Scripted(
        TOK, {p: TOK.encode(text, add_special_tokens=False) + [EOS] for p, text in script.items()}
    )


def random_model() -> CausalLM:
    m = CausalLM(tiny_config(len(TOK), 1024, eos_token_id=EOS, pad_token_id=TOK.pad_token_id))
    init_weights(m, 0)
    return m


def worker(m: CausalLM, spec: str = EXAMPLE) -> RolloutWorker:
    engine = BuiltinEngine(m, [EOS], TOK.pad_token_id, seed=3)
    agent = build_agent(spec, TOK, max_turns=8, timeout_s=30.0, max_prompt_length=64)
    return RolloutWorker(engine, TOK, agent)


def episodes(n: int, rows: list[dict] = (ROW,)) -> list:
    prompts = [
        Prompt(
            messages=r["prompt"],
            ground_truth=r["reward_model"]["ground_truth"],
            data_source=r["data_source"],
            extra_info=r["extra_info"],
        )
        for r in rows
    ]
    ids = [ChatRenderer(TOK).prompt(p.messages, None) for p in prompts]
    samples = make_groups(prompts, ids, n)
    for i, s in enumerate(samples):
        s.seed = 100 + i
    return samples


def answers(s) -> list[str]:
    """The text of each generated turn of the sample (what the endpoint returned as content)."""
    turns, current = [], []
    for t, m in zip(s.response_ids, s.loss_mask, strict=True):
        if m:
            current.append(t)
        elif current:
            turns.append(current)
            current = []
    return [TOK.decode(ids, skip_special_tokens=True) for ids in [*turns, current] if ids]


class Replay:
    """An OpenAI-compatible chat endpoint answering each request with the next of `texts`."""

    def __init__(self, texts: list[str]):
        self.texts, self.requests = list(texts), []
        replay = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                replay.requests.append(body)
                text = replay.texts.pop(0)
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
                out = json.dumps(
                    {
                        "id": "r",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body["model"],
                        "choices": [choice],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.server.server_port}/v1"

    def close(self):
        self.server.shutdown()


def rubric_of(task: dict, texts: list[str]) -> tuple[float, dict[str, float]]:
    """The example environment's reward for an episode whose model answers `texts`: verifiers alone
    plays it (tandem's harness, no tandem endpoint) against a server replaying them."""
    env, replay = build_env(EXAMPLE), Replay(texts)

    async def play():
        context = vf.ModelContext(
            model="m", client=vf.EvalClientConfig(base_url=replay.base_url, api_key_var="NO_KEY")
        )
        async with env.serving():
            return await env.run_episode(task_of(env, task), context)

    try:
        return reward_of(asyncio.run(play()))
    finally:
        replay.close()


def task_dict(s) -> dict:
    """The task dict the sample's agent got (the columns the example reads)."""
    p = s.prompt
    return {"messages": p.messages, "text": p.text, "ground_truth": p.ground_truth, "extra_info": {}}


# -- the tests ---------------------------------------------------------------------------------------
@pytest.mark.integration  # seconds of CPU: out of the unit tier (< 2 minutes)
def test_the_reward_is_the_rubrics_and_the_second_turn_extends_the_first():
    """Turn 1 answers 131 (wrong), turn 2 answers 132 (right): reward 0.5 = 0.5 x final_answer."""
    renderer = ChatRenderer(TOK)
    first = renderer.prompt(ROW["prompt"], None)
    history = [*ROW["prompt"], {"role": "assistant", "content": "131"}, {"role": "user", "content": QUESTION}]
    second = renderer.prompt(history, None)
    w = worker(scripted({len(first): "131", len(second): SUM}))
    try:
        samples = w.generate(episodes(2), PARAMS)
    finally:
        w.agent.close()
    for s in samples:
        assert s.status is Status.FINISHED and answers(s) == ["131", SUM]
        assert s.agent_reward == 0.5
        assert s.agent_stats["reward/first_answer"] == 0.0 and s.agent_stats["reward/final_answer"] == 1.0
        assert s.agent_stats["turns"] == 2 and s.agent_stats["errors"] == 0
        # one chain: the first prompt, answer 1, the environment's turn (context), answer 2
        assert s.prompt_ids == first and s.prompt_ids + s.response_ids == second + s.response_ids[-4:]
        n1 = len("131") + 1
        assert s.loss_mask == [1] * n1 + [0] * (len(second) - len(first) - n1) + [1] * 4
        assert s.agent_stats["reused_prompt_tokens"] == len(first) + n1  # the first turn's ids, as they were
        rubric = (0.5, {"reward/final_answer": 1.0, "reward/first_answer": 0.0})
        assert rubric_of(task_dict(s), answers(s)) == rubric


@pytest.mark.integration  # seconds of CPU: out of the unit tier (< 2 minutes)
def test_rewards_of_random_episodes_are_the_rubrics():
    rows_ = TASKS.get("addition")().make_rows(3, 1, "train")
    w = worker(random_model())
    try:
        samples = w.generate(episodes(2, rows_), SamplingParams(temperature=1.0, max_new_tokens=60))
    finally:
        w.agent.close()
    for s in samples:
        assert s.agent_stats["errors"] == 0 and s.agent_stats["turns"] == 2
        reward, info = rubric_of(task_dict(s), answers(s))
        assert s.agent_reward == reward
        assert {k: v for k, v in s.agent_stats.items() if k.startswith("reward/")} == info


def test_a_rubric_that_raises_ends_the_episode_with_reward_0():
    w = worker(scripted({}), "verifiers:test_verifiers_env:raising_rubric_env")
    try:
        samples = w.generate(episodes(2), SamplingParams(temperature=1.0, max_new_tokens=60))
    finally:
        w.agent.close()
    for s in samples:
        assert s.status is Status.FINISHED and s.agent_reward == 0.0
        assert s.agent_stats["errors"] == 1 and not any(k.startswith("reward/") for k in s.agent_stats)


def test_the_environments_tasks_as_tandem_rows(tmp_path):
    """rows -> a tandem data file -> Prompts -> the task dict an agent gets -> the same tasks."""
    env = build_env(EXAMPLE)
    path = str(tmp_path / "rows.jsonl")
    save_rows(rows(env, n=3), path)
    prompts = load_prompts(path)
    originals = list(env.taskset.take(3))
    for p, task in zip(prompts, originals, strict=True):
        assert p.messages == [{"role": "user", "content": task.data.prompt_text}]
        rebuilt = task_of(env, {"messages": p.messages, "text": None, "extra_info": p.extra_info})
        assert rebuilt.key == task.key and rebuilt.data.ground_truth == task.data.ground_truth
    shuffled = rows(env, n=3, seed=1)
    assert len(shuffled) == 3 and shuffled != rows(env, n=3)


def test_bad_specs_are_clear_errors():
    with pytest.raises(TandemError, match="cannot import module"):
        build_agent("verifiers:no_such_module:load_environment", TOK)
    with pytest.raises(TandemError, match="returned a"):
        build_agent("verifiers:test_verifiers_env:not_an_env", TOK)
    with pytest.raises(TandemError, match="tandem-chat"):
        build_agent("verifiers:test_verifiers_env:null_harness_env", TOK)


@pytest.mark.ray
def test_tandem_train_with_a_verifiers_environment(tmp_path):
    """`tandem train` for 5 steps with the example environment: every step's reward is its rubric's
    (0.5 x first_answer + 0.5 x final_answer, the means of the per-function scores)."""
    from tandem.cli.main import main

    args = [
        "train",
        f"run.out_dir={tmp_path}",
        "run.progress=false",
        "run.steps=5",
        "run.val_every=0",
        "rollout.batch_size=8",
        "rollout.n=4",
        "rollout.max_new_tokens=48",
        "data.val_size=32",
        f"rollout.agent={EXAMPLE}",
    ]
    assert main(args) == 0
    lines = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "timing_s/train" in r]
    assert len(steps) == 5
    for r in steps:
        assert r["agent/turns/mean"] > 1.5  # both turns went through the endpoint
        rubric = 0.5 * r["agent/reward/first_answer/mean"] + 0.5 * r["agent/reward/final_answer/mean"]
        assert r["reward/agent/mean"] == pytest.approx(rubric)
    assert any(r["reward/agent/mean"] > 0 for r in steps)
