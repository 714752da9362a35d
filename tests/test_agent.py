"""Agent loops (tandem/agent): multi-turn tool episodes on the real built-in engines, their token
bookkeeping (tool output is context: loss mask 0, logprob 0.0, ids never re-derived), versions
across weight updates mid-episode, aborts and re-submission, limits; the tools; user agents; the
multiply task, its verifier and its SFT masks.

The engines run a tiny random decoder whose logits get +12 on a scripted token at each position
(`Scripted`): what it writes is known in advance, while everything else — prefill, cache, sampling,
logprobs, stop strings, versions, updates, aborts — is the engines' own code.
"""

import random

import pytest
from helpers import Scripted, tiny_config

from tandem.agent import AGENTS, TOOLS, AgentLoop, ToolAgent, ToolError, agent_class, build_agent
from tandem.agent import tools as tools_module
from tandem.agent.tools import calculate
from tandem.controller.stats import rollout_stats
from tandem.data.tasks import TASKS
from tandem.data.tokenizer import build_char_tokenizer
from tandem.errors import TandemError
from tandem.model.decoder import CausalLM, init_weights
from tandem.reward.verifiers import VERIFIERS
from tandem.rollout.engine import BuiltinEngine
from tandem.rollout.group import make_groups
from tandem.rollout.paged_engine import PagedEngine
from tandem.rollout.worker import RolloutWorker, StopStrings
from tandem.runtime.startup import load_config
from tandem.sample import Prompt, Sample, SamplingParams, Status

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id
PROMPT = TOK.encode("2*3=", add_special_tokens=False)
ONE_CALL = "<calc>2*3</calc><result>6</result>6"
TWO_CALLS = "<calc>2*3</calc><result>6</result><calc>6+1</calc><result>7</result>7"
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=96)


def scripted(script: list[int], prompt_len: int = len(PROMPT), seed: int = 0) -> Scripted:
    """A tiny random decoder that writes `script`: response tokens after a prompt of `prompt_len`."""
    return Scripted(TOK, {prompt_len: script}, max_positions=128, seed=seed)


def script(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False) + [EOS]


def worker(
    text: str, engine_cls=BuiltinEngine, agent="tools", on_update="drain", **agent_kw
) -> RolloutWorker:
    engine = engine_cls(scripted(script(text)), [EOS], TOK.pad_token_id, on_update=on_update)
    kw = {"tools": ["calculator"], "max_turns": 4} | agent_kw
    return RolloutWorker(engine, TOK, build_agent(agent, TOK, kw["tools"], kw["max_turns"]))


def episodes(n: int = 1) -> list[Sample]:
    return make_groups([Prompt(text="2*3=")], [PROMPT], n)


def spans(text: str) -> list[int]:
    """The loss mask the tools agent gives `text` + EOS: 0 on every <result>...</result>."""
    mask = []
    for part in text.replace("<result>", "\0<result>").replace("</result>", "</result>\0").split("\0"):
        mask += [0 if part.startswith("<result>") else 1] * len(part)
    return mask + [1]


def weights_push(engine, version: int, seed: int):
    """Stage the weights of another random model as `version` (what a trainer's push does)."""
    new = dict(tiny_model_like(seed).named_parameters())
    targets = engine.named_weights()

    def apply():
        for name, t in targets.items():
            t.copy_(new[name])

    engine.set_pending_update(version, apply)


def tiny_model_like(seed: int) -> CausalLM:
    model = CausalLM(tiny_config(len(TOK), 128, eos_token_id=EOS, pad_token_id=TOK.pad_token_id))
    init_weights(model, seed)
    return model


# -- the episode's tokens -------------------------------------------------------------------------
@pytest.mark.parametrize("engine_cls", [BuiltinEngine, PagedEngine])
def test_tool_output_is_context_and_earlier_ids_never_change(engine_cls):
    w = worker(TWO_CALLS, engine_cls)
    seen = []  # each sample's response after every engine call
    turn = w._turn

    def spy(samples, params):
        out = turn(samples, params)
        seen.extend(list(s.response_ids) for s in samples)
        return out

    w._turn = spy
    (s,) = w.generate(episodes(), PARAMS)
    assert s.status is Status.FINISHED and s.finish_reason == "stop"
    assert s.response_ids == script(TWO_CALLS) and s.response_text == TWO_CALLS
    assert s.loss_mask == spans(TWO_CALLS)
    assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m == 0)
    assert all(-1e-2 < lp < 0.0 for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m == 1)
    assert len(seen) == 3 and all(s.response_ids[: len(ids)] == ids for ids in seen)  # appended only
    assert s.agent_stats == {
        "turns": 3.0,
        "tool_calls": 2.0,
        "tool_errors": 0.0,
        "tool_use": 1.0,
        "truncated": 0.0,
    }
    assert VERIFIERS.get("multiply")(s.response_text, "7", {}) == 1.0


def test_paged_engine_continues_each_turn_on_its_prefix_cache():
    w = worker(ONE_CALL, PagedEngine)
    (s,) = w.generate(episodes(), PARAMS)
    call = len(TOK.encode("<calc>2*3</calc>"))
    no_cache = len(PROMPT) + (len(PROMPT) + call + len(TOK.encode("<result>6</result>")))
    assert s.response_text == ONE_CALL
    assert w.engine.runner.num_prefill_tokens < no_cache  # the first turn's full blocks were reused


# -- versions across weight updates mid-episode ------------------------------------------------------
def test_a_swap_mid_turn_under_continue_keeps_every_tokens_version():
    w = worker(ONE_CALL, on_update="continue")
    pushed = []

    def on_step(step):
        if step == 5 and not pushed:
            weights_push(w.engine, 1, seed=7)
            pushed.append(step)

    w.engine.on_step = on_step
    (s,) = w.generate(episodes(), PARAMS)
    call = len(TOK.encode("<calc>2*3</calc>"))
    tool = len(TOK.encode("<result>6</result>"))
    # Tokens 0-4 were sampled before the swap; token 5 on is from the new weights' logits; the
    # tool's output takes the version of the newest generated token before it.
    assert s.versions == [0] * 5 + [1] * (call - 5) + [1] * tool + [1, 1]
    assert s.response_text == ONE_CALL and s.version_span == (0, 1)


def test_an_update_between_turns_under_drain_leaves_the_tool_output_on_the_old_version():
    w = worker(ONE_CALL, on_update="drain")
    w.engine.on_step = lambda step: step == 3 and weights_push(w.engine, 1, seed=7)
    (s,) = w.generate(episodes(), PARAMS)
    call = len(TOK.encode("<calc>2*3</calc>"))
    tool = len(TOK.encode("<result>6</result>"))
    # The first turn drains on version 0, the tool output follows it; the next turn is a new
    # engine call, which starts on the newest weights.
    assert s.versions == [0] * call + [0] * tool + [1, 1]


def test_an_abort_on_update_returns_the_partial_and_the_resubmission_goes_on_with_right_versions():
    w = worker(ONE_CALL, on_update="abort")
    w.engine.on_step = lambda step: step == 4 and w.engine.version == 0 and weights_push(w.engine, 1, seed=7)
    (s,) = w.generate(episodes(), PARAMS)
    assert s.status is Status.ABORTED and s.response_ids == script(ONE_CALL)[:4]
    assert s.versions == [0] * 4 and s.agent_stats["tool_calls"] == 0
    w.generate([s], PARAMS)  # re-submitted: the update is applied first, the episode goes on
    assert s.status is Status.FINISHED and s.response_text == ONE_CALL
    assert s.versions == [0] * 4 + [1] * (len(s.response_ids) - 4)
    assert s.loss_mask == spans(ONE_CALL) and s.agent_stats["tool_calls"] == 1.0


# -- aborts and re-submission -----------------------------------------------------------------------
def test_an_episode_aborted_mid_turn_resumes_to_the_same_end():
    w = worker(TWO_CALLS)
    w.engine.on_step = lambda step: step == 3 and w.abort()
    (s,) = w.generate(episodes(), PARAMS)
    assert s.status is Status.ABORTED and len(s.response_ids) == 3
    w.engine.on_step = None
    w.generate([s], PARAMS)
    assert s.response_text == TWO_CALLS and s.loss_mask == spans(TWO_CALLS)
    assert s.agent_stats["turns"] == 3.0 and s.agent_stats["tool_calls"] == 2.0


def test_a_call_generated_but_not_run_is_run_first_when_the_episode_comes_back():
    w = worker(TWO_CALLS)
    (s,) = episodes()
    call = TOK.encode("<calc>2*3</calc>", add_special_tokens=False)
    s.extend(call, [-0.1] * len(call), [0] * len(call))  # stopped right after its first call
    s.agent_stats = {"turns": 1.0, "tool_calls": 0.0, "tool_errors": 0.0, "tool_use": 0.0, "truncated": 0.0}
    s.end("abort")
    w.generate([s], PARAMS)
    assert s.response_text == TWO_CALLS and s.loss_mask == spans(TWO_CALLS)
    assert s.agent_stats["tool_calls"] == 2.0 and s.agent_stats["turns"] == 3.0


def test_an_abort_between_turns_stops_the_episode_with_its_tool_output_in():
    w = worker(TWO_CALLS)
    turn = w._turn
    calls = []

    def abort_after_first(samples, params):
        calls.append(1)
        out = turn(samples, params)
        if len(calls) == 1:
            w.abort()  # the controller stops the call while the tool would run
        return out

    w._turn = abort_after_first
    (s,) = w.generate(episodes(), PARAMS)
    assert s.status is Status.ABORTED and s.response_text == "<calc>2*3</calc><result>6</result>"
    w._turn = turn
    w.generate([s], PARAMS)
    assert s.response_text == TWO_CALLS and s.agent_stats["tool_calls"] == 2.0


def test_abort_of_one_sample_stops_only_its_episode():
    w = worker(ONE_CALL)
    samples = episodes(2)
    partial = Sample(prompt=Prompt(text="2*3="), prompt_ids=PROMPT, group_id=5)  # a re-submitted one
    partial.extend(script(ONE_CALL)[:3], [-0.1] * 3, [0] * 3)
    partial.end("abort")
    w.engine.on_step = lambda step: step == 2 and w.abort([samples[1]])
    w.generate([*samples, partial], PARAMS)
    assert samples[0].status is Status.FINISHED and samples[0].response_text == ONE_CALL
    assert samples[1].status is Status.ABORTED and len(samples[1].response_ids) == 2
    assert partial.status is Status.FINISHED and partial.response_text == ONE_CALL


# -- limits -----------------------------------------------------------------------------------------
def test_max_turns_ends_the_episode_at_the_call_one_too_many():
    w = worker(TWO_CALLS, max_turns=1)
    (s,) = w.generate(episodes(), PARAMS)
    first = "<calc>2*3</calc><result>6</result>"
    assert s.status is Status.FINISHED and s.finish_reason == "length"
    assert s.response_text == first + "<calc>6+1</calc>"  # the second call is not run
    assert s.agent_stats["tool_calls"] == 1.0 and s.agent_stats["truncated"] == 1.0
    assert s.agent_stats["turns"] == 2.0


def test_max_new_tokens_counts_tool_output_and_ends_the_episode():
    call = len(TOK.encode("<calc>2*3</calc>"))
    tool = len(TOK.encode("<result>6</result>"))
    # No room for the tool's output and one more token: it is not appended.
    (s,) = worker(ONE_CALL).generate(episodes(), SamplingParams(max_new_tokens=call + tool))
    assert s.finish_reason == "length" and s.response_text == "<calc>2*3</calc>"
    assert s.agent_stats["truncated"] == 1.0 and s.agent_stats["tool_calls"] == 1.0
    # Room for the output, and one token after it: the cap ends the next turn.
    (s,) = worker(ONE_CALL).generate(episodes(), SamplingParams(max_new_tokens=call + tool + 1))
    assert s.finish_reason == "length" and len(s.response_ids) == call + tool + 1
    assert s.loss_mask[-1] == 1 and s.agent_stats["truncated"] == 1.0
    # A sample's own cap counts the same way.
    samples = episodes()
    samples[0].max_new_tokens = call + tool
    worker(ONE_CALL).generate(samples, PARAMS)
    assert samples[0].finish_reason == "length" and samples[0].agent_stats["truncated"] == 1.0


def test_a_refused_call_shows_the_error_and_counts_it():
    text = "<calc>2*x</calc><result>error: not allowed in a calculation: x</result>0"
    (s,) = worker(text).generate(episodes(), PARAMS)
    assert s.response_text == text and s.loss_mask == spans(text)
    assert s.agent_stats["tool_errors"] == 1.0 and s.agent_stats["tool_use"] == 0.0


def test_agent_counters_become_step_metrics():
    (s,) = worker(ONE_CALL).generate(episodes(), PARAMS)
    plain = Sample(prompt=Prompt(text="x"), prompt_ids=[5], response_ids=[6], versions=[0], loss_mask=[1])
    stats = rollout_stats([s, plain], 0)
    assert stats["agent/tool_use/mean"] == 0.5 and stats["agent/tool_calls/mean"] == 0.5
    assert stats["agent/turns/mean"] == 1.0  # the single-turn sample counts 0: it kept no counters
    assert not any(k.startswith("agent/") for k in rollout_stats([plain], 0))


def test_single_turn_is_one_engine_call_with_unchanged_results():
    engine = BuiltinEngine(scripted(script(ONE_CALL)), [EOS], TOK.pad_token_id, seed=3)
    (s,) = RolloutWorker(engine, TOK).generate(
        episodes(), SamplingParams(max_new_tokens=96, stop=["</calc>"])
    )
    assert s.response_text == "<calc>2*3" and s.loss_mask == [1] * len(s.response_ids)
    assert s.agent_stats == {} and s.finish_reason == "stop"


def test_a_stop_string_counts_only_when_the_newest_token_completes_it():
    check = StopStrings(TOK, ["</calc>"])
    ids = TOK.encode("<calc>2*3</calc><r>", add_special_tokens=False)
    assert check([ids[: len(ids) - 3]]) == [True]  # "</calc>" just completed
    assert check([ids]) == [False]  # an earlier turn's: the window still holds it, it does not end this one


# -- tools ------------------------------------------------------------------------------------------
def test_calculator_is_exact_and_refuses_what_is_not_arithmetic():
    assert calculate("37*48") == "1776"
    assert calculate(" (1 + 2) * -3 ") == "-9"
    assert (
        calculate("7/2") == "3.5"
        and calculate("1/3") == "0.3333333333"
        and calculate("-2/3") == "-0.6666666667"
    )
    assert calculate("0.1+0.2") == "0.3" and calculate("7//2") == "3" and calculate("-7//2") == "-4"
    assert calculate("7%3") == "1" and calculate("2**10") == "1024" and calculate("2**-2") == "0.25"
    for bad, why in [
        ("x+1", "not allowed"),
        ("__import__('os').system('ls')", "not allowed"),
        ("(1).real", "not allowed"),
        ("abs(-1)", "not allowed"),
        ("'a'*3", "not allowed"),
        ("True+1", "not allowed"),
        ("9**9**9", "too large"),
        ("2**5000", "too large"),
        ("10.0**400", "too large"),
        ("2**0.5", "integer exponents"),
        ("1/0", "division by zero"),
        ("5%0", "division by zero"),
        ("1+" * 150 + "1", "longer than"),
        ("1+", "not an arithmetic expression"),
        ("", "empty"),
    ]:
        with pytest.raises(ToolError, match=why):
            calculate(bad)


def test_python_tool_runs_in_the_sandbox(monkeypatch):
    python = TOOLS.get("python")
    assert python.tag == "python" and python("print(6 * 7)") == "42"
    with pytest.raises(ToolError, match="ZeroDivisionError: division by zero"):
        python("x = 1\nprint(x / 0)")
    monkeypatch.setattr(tools_module, "PYTHON_TIMEOUT_S", 0.5)
    with pytest.raises(ToolError, match="timed out"):
        python("while True:\n    pass")


def test_python_calls_in_an_episode():
    text = "<python>print(2*3)</python><result>6</result>6"
    (s,) = worker(text, tools=["calculator", "python"]).generate(episodes(), PARAMS)
    assert s.response_text == text and s.loss_mask == spans(text) and s.agent_stats["tool_use"] == 1.0


# -- building agents ----------------------------------------------------------------------------------
def test_a_user_agent_class_loads_by_its_path_and_runs():
    cls = agent_class("agent_example:Recheck")
    assert issubclass(cls, AgentLoop)
    cfg = load_config(None, ["rollout.agent=agent_example:Recheck"])
    assert cfg.rollout.agent == "agent_example:Recheck"
    text = "ab"
    forced = script(text) + TOK.encode("<again>", add_special_tokens=False) + script("cd")
    engine = BuiltinEngine(scripted(forced), [EOS], TOK.pad_token_id)
    w = RolloutWorker(engine, TOK, build_agent("agent_example:Recheck", TOK))
    (s,) = w.generate(episodes(), PARAMS)
    assert s.response_ids == forced and s.response_text == "ab<again>cd"
    assert s.loss_mask == [1, 1, 1] + [0] * 7 + [1, 1, 1] and s.agent_stats == {"turns": 2.0}


def test_a_bad_agent_or_tool_name_is_a_clear_error():
    with pytest.raises(TandemError, match="rollout.agent.*Unknown agent 'tool'.*single_turn, tools"):
        load_config(None, ["rollout.agent=tool"])
    with pytest.raises(TandemError, match="has no attribute 'Nope'"):
        agent_class("agent_example:Nope")
    with pytest.raises(TandemError, match="Cannot import module 'no_such_module'"):
        agent_class("no_such_module:Agent")
    with pytest.raises(TandemError, match="rollout.tools.*'calc'.*calculator, python"):
        load_config(None, ["rollout.tools=[calc]"])
    with pytest.raises(TandemError, match="rollout.max_turns"):
        load_config(None, ["rollout.max_turns=0"])
    assert AGENTS.names() == ["single_turn", "tools"]


# -- the multiply task ------------------------------------------------------------------------------
def test_multiply_verifier_reads_the_answer_after_the_tool_result():
    verify = VERIFIERS.get("multiply")
    assert verify("<calc>37*48</calc><result>1776</result>1776", "1776", {}) == 1.0
    assert verify("<calc>37*48</calc><result>1776</result>", "1776", {}) == 0.0  # no answer of its own
    assert verify("<calc>37*47</calc><result>1739</result>1739", "1776", {}) == 0.0
    assert (
        verify("1776", "1776", {}) == 1.0 and verify("2000", "1776", {}) == 0.0 and verify("", "1", {}) == 0.0
    )


def test_multiply_task_solutions_and_sft_masks():
    from tandem.train.sft import demonstrations

    task = TASKS.get("multiply")()
    rows = task.make_rows(50, seed=0)
    verify = VERIFIERS.get("multiply")
    truth = [r["reward_model"]["ground_truth"] for r in rows]
    assert all(verify(task.solution(r), t, {}) == 1.0 for r, t in zip(rows, truth, strict=True))
    flawed = [
        verify(task.flawed_solution(r, random.Random(0)), t, {}) for r, t in zip(rows, truth, strict=True)
    ]
    assert sum(flawed) <= 2  # right only when both operands end in 0
    agent = ToolAgent(TOK)
    ids, mask = agent.demonstration(task.solution(rows[0]))
    assert TOK.decode(ids) == task.solution(rows[0]) and mask == spans(task.solution(rows[0]))[:-1]
    cfg = load_config(None, ["data.task=multiply", "rollout.agent=tools", "sft.flawed_fraction=0"])
    (demo,) = demonstrations(cfg, TOK, 1)
    assert demo.response_ids[-1] == EOS and demo.loss_mask == spans(TOK.decode(demo.response_ids[:-1]))
    single = load_config(None, ["data.task=multiply", "sft.flawed_fraction=0"])
    assert demonstrations(single, TOK, 1)[0].loss_mask == [1] * len(demo.response_ids)
