"""rollout.agent=openai:...: agents written with the real `openai` client (async and sync, streamed
and not, with tools) against a rollout worker's OpenAI-compatible endpoint, on the built-in engines
and a tiny random decoder. What the client received is what the sample records; its logprobs are
the model's (one full forward, as the trainer recomputes them); a second turn reuses the first
turn's token ids; faults end their episode with reward 0 while the others go on; requests of
concurrent episodes share engine calls."""

import asyncio
import json
import time

import pytest
import torch
from helpers import Scripted, assert_same_logprobs, full_forward_logprobs, tiny_config

openai = pytest.importorskip("openai", reason="the openai client is not installed (pip install openai)")

from tandem.agent import build_agent  # noqa: E402
from tandem.agent.chat import ChatRenderer, parse_tool_calls  # noqa: E402
from tandem.data.tokenizer import build_char_tokenizer  # noqa: E402
from tandem.errors import TandemError  # noqa: E402
from tandem.model.decoder import CausalLM, init_weights  # noqa: E402
from tandem.reward.pool import RewardPool  # noqa: E402
from tandem.rollout.engine import BuiltinEngine  # noqa: E402
from tandem.rollout.group import make_groups  # noqa: E402
from tandem.rollout.paged_engine import PagedEngine  # noqa: E402
from tandem.rollout.worker import RolloutWorker  # noqa: E402
from tandem.sample import Prompt, SamplingParams, Status  # noqa: E402

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=120)
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
RECEIVED: dict[str, list] = {}  # what the agents of a test saw, by episode task id


def model(seed: int = 0) -> CausalLM:
    m = CausalLM(tiny_config(len(TOK), 1024, eos_token_id=EOS, pad_token_id=TOK.pad_token_id))
    init_weights(m, seed)
    return m


def scripted(prompt_ids: list[int], text: str) -> Scripted:
    """A tiny random decoder that writes `text` then EOS after the prompt `prompt_ids`."""
    return Scripted(TOK, {len(prompt_ids): TOK.encode(text, add_special_tokens=False) + [EOS]})


class Counting(BuiltinEngine):
    calls: list[int]

    def generate(self, samples, params, stop_check=None):
        self.calls.append(len(samples))
        return super().generate(samples, params, stop_check=stop_check)


def worker(agent: str, m: CausalLM | None = None, engine_cls=BuiltinEngine, **kw) -> RolloutWorker:
    engine = engine_cls(m if m is not None else model(), [EOS], TOK.pad_token_id, seed=3)
    if isinstance(engine, Counting):
        engine.calls = []
    options = {"timeout_s": 20.0, "max_prompt_length": 512} | kw.pop("options", {})
    return RolloutWorker(
        engine,
        TOK,
        build_agent(f"openai:test_openai_agent:{agent}", TOK, max_turns=kw.get("max_turns", 8), **options),
    )


def episodes(n: int, text: str = "2+3=") -> list:
    prompt = Prompt(messages=[{"role": "user", "content": text}], ground_truth="5", extra_info={"id": text})
    ids = ChatRenderer(TOK).prompt(prompt.messages, None)
    samples = make_groups([prompt], [ids], n)
    for i, s in enumerate(samples):
        s.seed = 100 + i
    return samples


# -- the agents (importable as test_openai_agent:<name>) -------------------------------------------
async def one_call(client, task):
    r = await client.chat.completions.create(
        model="m", messages=task["messages"], max_tokens=12, logprobs=True
    )
    c = r.choices[0]
    RECEIVED.setdefault("one_call", []).append((c.token_ids, [t.logprob for t in c.logprobs.content], r))
    return 1.0, {"answer_len": len(c.message.content or "")}


async def two_turns(client, task):
    first = await client.chat.completions.create(model="m", messages=task["messages"], max_tokens=8)
    reply = first.choices[0].message
    history = [
        *task["messages"],
        {"role": "assistant", "content": reply.content},
        {"role": "user", "content": "again"},
    ]
    second = await client.chat.completions.create(model="m", messages=history, max_tokens=8)
    RECEIVED.setdefault("two_turns", []).append((first.choices[0].token_ids, second.choices[0].token_ids))
    return 0.5


async def streamed(client, task):
    stream = await client.chat.completions.create(
        model="m", messages=task["messages"], max_tokens=10, stream=True
    )
    text = ""
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    RECEIVED.setdefault("streamed", []).append(text)
    return 1.0


async def sync_client(client, task):
    def call():
        sync = openai.OpenAI(
            base_url=str(client.base_url), api_key="x", default_headers=client.default_headers
        )
        done = sync.completions.create(model="m", prompt="12+30=", max_tokens=6)
        return done.choices[0].text

    RECEIVED.setdefault("sync_client", []).append(await asyncio.to_thread(call))
    return 1.0


async def tool_user(client, task):
    r = await client.chat.completions.create(
        model="m", messages=task["messages"], tools=TOOLS, max_tokens=100
    )
    msg = r.choices[0].message
    RECEIVED.setdefault("tool_user", []).append((r.choices[0].finish_reason, msg))
    if not msg.tool_calls:
        return 0.0
    call = msg.tool_calls[0]
    args = json.loads(call.function.arguments)
    history = [
        *task["messages"],
        {"role": "assistant", "content": msg.content, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])},
    ]
    await client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=5)
    return 1.0


async def rewrites(client, task):
    """A draft, then a request with the history rewritten (not extending the draft), then one with
    n=2 choices whose second choice it continues: three chains no request extended."""
    draft = await client.chat.completions.create(model="m", messages=task["messages"], max_tokens=5)
    fresh = [{"role": "user", "content": "again: " + (draft.choices[0].message.content or "")}]
    two = await client.chat.completions.create(model="m", messages=fresh, max_tokens=5, n=2)
    taken = two.choices[1].message
    last = await client.chat.completions.create(
        model="m",
        messages=[*fresh, {"role": "assistant", "content": taken.content}, {"role": "user", "content": "ok"}],
        max_tokens=5,
    )
    RECEIVED.setdefault("rewrites", []).append(
        (
            draft.choices[0].token_ids,
            two.choices[0].token_ids,
            two.choices[1].token_ids,
            last.choices[0].token_ids,
        )
    )
    return 0.25


async def raises(client, task):
    await client.chat.completions.create(model="m", messages=task["messages"], max_tokens=4)
    raise RuntimeError("the agent's own bug")


async def hangs(client, task):
    await asyncio.sleep(60)
    return 1.0


async def silent(client, task):
    return 1.0


async def bad_param(client, task):
    await client.chat.completions.create(model="m", messages=task["messages"], presence_penalty=1.0)
    return 1.0


async def mixed(client, task):
    """Episode 0 raises, 1 hangs, 2 never calls, 3 sends a bad request, the rest work."""
    index = task["index"]
    if index == 0:
        return await raises(client, task)
    if index == 1:
        return await hangs(client, task)
    if index == 2:
        return await silent(client, task)
    if index == 3:
        return await bad_param(client, task)
    await client.chat.completions.create(model="m", messages=task["messages"], max_tokens=4)
    return 1.0


async def greedy_loop(client, task):
    for _ in range(5):
        await client.chat.completions.create(model="m", messages=task["messages"], max_tokens=4)
    return 1.0


# -- the tests ---------------------------------------------------------------------------------------
def test_what_the_client_received_is_what_the_sample_records_and_its_logprobs_are_the_models():
    m = model()
    samples = worker("one_call", m).generate(episodes(3), PARAMS)
    got = RECEIVED.pop("one_call")
    assert len(got) == 3
    by_tokens = {tuple(ids): lps for ids, lps, _ in got}
    for s in samples:
        assert s.status is Status.FINISHED and s.agent_reward == 1.0
        rendered = TOK.apply_chat_template(s.prompt.messages, add_generation_prompt=True, tokenize=False)
        assert s.prompt_ids == TOK.encode(rendered, add_special_tokens=False)
        assert tuple(s.response_ids) in by_tokens
        assert s.logprobs == pytest.approx(by_tokens[tuple(s.response_ids)])
        assert s.loss_mask == [1] * len(s.response_ids)
        recomputed = full_forward_logprobs(m, s.prompt_ids, s.response_ids)
        assert_same_logprobs(s.logprobs, recomputed, m, [s])
        assert s.agent_stats["turns"] == 1 and s.agent_stats["answer_len"] >= 0
    usage = got[0][2].usage
    assert usage.prompt_tokens == len(samples[0].prompt_ids)


@pytest.mark.parametrize("engine_cls", [BuiltinEngine, PagedEngine])
def test_a_second_turn_reuses_the_first_turns_token_ids(engine_cls):
    m = model()
    samples = worker("two_turns", m, engine_cls=engine_cls).generate(episodes(2), PARAMS)
    got = RECEIVED.pop("two_turns")
    for s in samples:
        first, second = next((a, b) for a, b in got if s.response_ids[: len(a)] == a)
        n = len(first)
        context = s.response_ids[n : len(s.response_ids) - len(second)]
        assert s.response_ids == first + context + second
        assert s.loss_mask == [1] * n + [0] * len(context) + [1] * len(second)
        # the context is only what is new: the rest of the first turn and the user's message
        tail = TOK.decode(context)
        assert tail.endswith("<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"), tail
        assert "2+3=" not in tail and s.agent_reward == 0.5 and s.agent_stats["samples"] == 1
        # the trainer's one forward over prompt + both turns gives the engine's logprobs
        recomputed = full_forward_logprobs(m, s.prompt_ids, s.response_ids)
        trained = torch.tensor(s.loss_mask, dtype=torch.bool)
        assert_same_logprobs(torch.tensor(s.logprobs)[trained], recomputed[trained], m, [s])


def test_calls_that_do_not_extend_each_other_become_extra_samples_of_the_episode():
    samples = worker("rewrites").generate(episodes(2), PARAMS)
    got = RECEIVED.pop("rewrites")
    assert len(samples) == 2 + 2 * 2  # each episode: its own sample + the draft + the untaken choice
    for own in samples[:2]:
        draft, other, taken, last = next(g for g in got if own.response_ids[-len(g[3]) :] == g[3])
        assert own.episode_of is None and own.response_ids[: len(taken)] == taken
        extras = [s for s in samples if s.episode_of == own.index]
        assert sorted(s.response_ids for s in extras) == sorted([draft, other])
        for s in [own, *extras]:
            assert s.status is Status.FINISHED and s.agent_reward == 0.25 and s.group_id == own.group_id
        assert all(x.loss_mask == [1] * len(x.response_ids) and x.index >= 1 << 16 for x in extras)
        assert own.agent_stats["samples"] == 3 and extras[0].agent_stats == {}
    assert len({s.key for s in samples}) == len(samples)


def test_a_tools_demonstration_for_tandem_sft_is_the_chain_the_endpoint_records():
    """`tandem sft` with rollout.agent=openai:... (recipes/sft-openai-tools.yaml): the multiply
    task's transcript becomes exactly the tokens and loss mask that the example calculator agent's
    episode records through the endpoint when the model writes that transcript."""
    agent = build_agent("openai:tandem.agent.examples:calculator", TOK, ["calculator"], 4)
    prompt = Prompt(
        messages=[{"role": "user", "content": "37*48="}], ground_truth="1776", data_source="multiply"
    )
    prompt_ids = agent.prompt_ids(prompt, TOK.encode("unused"))
    ids, mask = agent.demonstration("<calc>37*48</calc><result>1776</result>1776")
    m = Scripted(TOK, {len(prompt_ids): ids + [EOS]})
    engine = BuiltinEngine(m, [EOS], TOK.pad_token_id, seed=3)
    w = RolloutWorker(
        engine, TOK, build_agent("openai:tandem.agent.examples:calculator", TOK, max_turns=4, timeout_s=20.0)
    )
    (s,) = w.generate(make_groups([prompt], [TOK.encode("37*48=")], 1), PARAMS)
    assert (
        s.agent_reward == 1.0 and s.agent_stats["tool_calls"] == 1 and s.agent_stats["calculator_calls"] == 1
    )
    assert s.prompt_ids == prompt_ids and s.response_ids == ids + [EOS] and s.loss_mask == mask + [1]


def test_streamed_and_sync_clients_and_plain_completions():
    samples = worker("streamed").generate(episodes(2), PARAMS)
    texts = RECEIVED.pop("streamed")
    assert sorted(texts) == sorted(s.response_text for s in samples)
    samples = worker("sync_client").generate(episodes(2), PARAMS)
    assert sorted(RECEIVED.pop("sync_client")) == sorted(s.response_text for s in samples)
    for s in samples:
        assert s.prompt_ids == TOK.encode("12+30=", add_special_tokens=False)


def test_a_tool_call_in_hermes_format_reaches_the_client_and_the_episode_goes_on():
    messages = [{"role": "user", "content": "add 2 and 3"}]
    prompt = ChatRenderer(TOK).prompt(messages, TOOLS)
    m = scripted(prompt, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    samples = make_groups([Prompt(messages=messages)], [prompt], 1)
    (s,) = worker("tool_user", m).generate(samples, SamplingParams(temperature=0.0, max_new_tokens=200))
    finish, msg = RECEIVED.pop("tool_user")[0]
    assert finish == "tool_calls" and msg.content is None
    assert msg.tool_calls[0].function.name == "add"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"a": 2, "b": 3}
    assert s.agent_reward == 1.0 and s.agent_stats["tool_calls"] == 1 and s.agent_stats["turns"] == 2
    assert "<|im_start|>tool\n5<|im_end|>" in TOK.decode(s.response_ids)  # the result is context
    assert s.prompt_ids == prompt


def test_malformed_tool_call_json_comes_back_as_content_and_is_counted():
    messages = [{"role": "user", "content": "add 2 and 3"}]
    prompt = ChatRenderer(TOK).prompt(messages, TOOLS)
    m = scripted(prompt, '<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>')
    (s,) = worker("tool_user", m).generate(
        make_groups([Prompt(messages=messages)], [prompt], 1),
        SamplingParams(temperature=0.0, max_new_tokens=200),
    )
    finish, msg = RECEIVED.pop("tool_user")[0]
    assert finish == "stop" and not msg.tool_calls and msg.content.startswith("<tool_call>")
    assert s.agent_stats["tool_parse_errors"] == 1 and s.agent_reward == 0.0


@pytest.mark.integration  # seconds of CPU: out of the unit tier (< 2 minutes)
def test_each_fault_ends_its_episode_with_reward_0_and_the_others_go_on():
    w = worker("mixed", engine_cls=Counting, options={"timeout_s": 2.0})
    samples = episodes(6)
    for s in samples:  # the agent reads its index from the task
        s.prompt = Prompt(messages=s.prompt.messages, columns={"index": s.index})
    start = time.monotonic()
    out = w.generate(samples, PARAMS)
    assert time.monotonic() - start < 15  # the hung agent is given up on at its time limit
    stats = [s.agent_stats for s in out]
    assert [s.agent_reward for s in out] == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert stats[0]["errors"] == 1 and stats[1]["timeouts"] == 1 and stats[2]["no_calls"] == 1
    assert stats[3]["bad_requests"] == 1 and stats[3]["errors"] == 1  # the 400 raised in the agent
    assert all(s.status is Status.FINISHED for s in out)
    assert out[2].response_ids == [] and len(out[4].response_ids) > 0


def test_requests_past_the_episodes_turn_limit_are_refused():
    s, extra = worker("greedy_loop", max_turns=2).generate(episodes(1), PARAMS)  # 2 calls, 2 chains
    assert s.agent_stats["turns"] == 2 and s.agent_stats["truncated"] == 1 and extra.agent_reward == 0.0
    assert s.agent_reward == 0.0 and s.agent_stats["errors"] == 1  # the agent did not catch the 400


def test_concurrent_episodes_share_engine_calls():
    w = worker("one_call", engine_cls=Counting)
    w.generate(episodes(8), PARAMS)
    RECEIVED.pop("one_call")
    assert w.engine.calls == [8]  # eight episodes, one engine call


def test_the_reward_role_takes_the_agents_reward():
    (s,) = episodes(1)
    s.agent_reward, s.response_text = 0.25, "wrong"
    pool = RewardPool("auto", num_workers=1)
    try:
        pool.score([s])
    finally:
        pool.close()
    assert s.reward == 0.25 and s.reward_parts == {"agent": 0.25}


def test_tool_call_parsers():
    ok = parse_tool_calls('hi <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    assert ok.content == "hi" and ok.tool_calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert parse_tool_calls("no call").tool_calls == []
    bad = parse_tool_calls("<tool_call>{oops}</tool_call>")
    assert bad.tool_calls == [] and "does not parse" in bad.parse_error
    assert "without" in parse_tool_calls("<tool_call>{").parse_error
    llama = parse_tool_calls('{"name": "f", "parameters": {"x": 2}}', "llama3_json")
    assert json.loads(llama.tool_calls[0]["function"]["arguments"]) == {"x": 2}


def test_a_bad_agent_spec_is_a_clear_error():
    with pytest.raises(TandemError, match="not an `async def` function"):
        build_agent("openai:test_openai_agent:worker", TOK)
    with pytest.raises(TandemError, match="cannot import module"):
        build_agent("openai:no_such_module:run", TOK)


def test_the_template_renders_plain_messages_as_chatml_did():
    plain = (
        "{%- for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
    ]
    for gen in (True, False):
        assert TOK.apply_chat_template(
            msgs, add_generation_prompt=gen, tokenize=False
        ) == TOK.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False, chat_template=plain)


@pytest.mark.ray
def test_tandem_train_through_the_endpoint(tmp_path):
    """`tandem train` with an agent written against the OpenAI API (tandem/agent/examples.py): the
    default task through the rollout workers' endpoints, rewards from the agent, the same warm
    start accuracy as the built-in agent (the same prompts, greedy, on the same weights)."""
    from tandem.cli.main import main

    args = ["train", f"run.out_dir={tmp_path}", "run.progress=false", "run.steps=2", "run.val_every=2"]
    # Greedy decisions, so the accuracy, depend on the dtype: float32, not auto's CPU-dependent pick.
    args.append("train.dtype=float32")
    assert main([*args, "rollout.agent=openai:tandem.agent.examples:answer"]) == 0
    lines = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "timing_s/train" in r]
    assert len(steps) == 2 and all(r["agent/turns/mean"] == 1 and r["agent/errors/mean"] == 0 for r in steps)
    assert all(0 < r["reward/agent/mean"] < 1 for r in steps)
    assert lines[0]["val/accuracy"] == pytest.approx(0.449, abs=0.01)  # the warm start's, as without agents


def push(engine, version: int, seed: int) -> None:
    """Stage another random model's weights as `version`, as a trainer's push does."""
    new = dict(model(seed).named_parameters())
    targets = engine.named_weights()

    def apply():
        for name, t in targets.items():
            t.copy_(new[name])

    engine.set_pending_update(version, apply)


def test_a_request_cut_by_a_weight_update_goes_on_on_the_new_weights():
    """rollout.on_update=abort: the engine returns the request's partial; the endpoint serves it
    again at once, on the new weights; the client sees one completion, its tokens' versions say
    which weights made each."""
    engine = BuiltinEngine(model(), [EOS], TOK.pad_token_id, seed=3, on_update="abort")
    engine.on_step = lambda step: step == 3 and engine.version == 0 and push(engine, 1, seed=9)
    w = RolloutWorker(engine, TOK, build_agent("openai:test_openai_agent:one_call", TOK, timeout_s=20.0))
    (s,) = w.generate(episodes(1), SamplingParams(temperature=1.0, max_new_tokens=120, ignore_eos=True))
    ids, logprobs, _ = RECEIVED.pop("one_call")[0]
    assert s.status is Status.FINISHED and s.agent_reward == 1.0 and s.response_ids == ids
    assert len(ids) == 12 and s.versions == [0] * 3 + [1] * 9
    assert s.logprobs == pytest.approx(logprobs)


def test_an_aborted_worker_returns_its_episodes_empty_and_they_start_afresh():
    """A partial rollout's abort: an episode (a coroutine) cannot move to another worker, so its
    sample comes back ABORTED and empty; re-submitted, the episode runs from its task again."""
    engine = BuiltinEngine(model(), [EOS], TOK.pad_token_id, seed=3)
    w = RolloutWorker(engine, TOK, build_agent("openai:test_openai_agent:one_call", TOK, timeout_s=20.0))
    engine.on_step = lambda step: step == 2 and w.abort()
    samples = w.generate(episodes(2), SamplingParams(temperature=1.0, max_new_tokens=120, ignore_eos=True))
    assert all(s.status is Status.ABORTED and s.response_ids == [] for s in samples)
    engine.on_step = None
    samples = w.generate(samples, PARAMS)
    assert all(s.status is Status.FINISHED and s.agent_reward == 1.0 for s in samples)
    RECEIVED.pop("one_call", None)
