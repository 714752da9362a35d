"""An OpenAI agent's episode as chains (`tandem.agent.chains`), without an endpoint or an engine:
what a request extends, and which chains become samples."""

from tandem.agent.chains import EXTRA_INDEX, Call, Chain, Episode, Served
from tandem.agent.openai_request import Choice, Request
from tandem.sample import Prompt, Sample, Status


def generated(prompt_ids: list[int], ids: list[int], version: int) -> Sample:
    s = Sample(Prompt(text="t"), list(prompt_ids))
    s.extend(ids, [-0.5] * len(ids), [version] * len(ids))
    s.end("stop")
    return s


def served(chain: Chain, context: list[int], s: Sample) -> Served:
    choice = Choice("", list(s.response_ids), list(s.logprobs), [], "stop", "")
    return Served.of(chain.then(context, s), s, choice, chat=False, eos=None)


def request(prompt: list[int]) -> Request:
    return Request(episode="e", chat=False, body={}, prompt=prompt)


def never(*_):
    raise AssertionError("a token prompt needs no renderer or tokenizer")


def test_a_request_extending_a_completion_continues_its_chain_and_only_the_last_chain_is_the_sample():
    ep = Episode("e", Sample(Prompt(text="t"), [1, 2], group_id=3, index=1), {}, deadline=0.0)
    first = served(Chain([1, 2]), [], generated([1, 2], [5, 6], version=0))
    ep.record(Call(None, None, [1, 2], [first]), None, [])
    aside = served(Chain([1, 2]), [], generated([1, 2], [3], version=1))  # a fresh chain, left alone
    ep.record(Call(None, None, [1, 2], [aside]), None, [])
    assert ep.extension(request([1, 2, 9]), never, never) is None  # not after the completion
    parent, context, ids = ep.extension(request([1, 2, 5, 6, 7, 8]), never, never)
    assert parent is first and context == [7, 8] and ids == [1, 2, 5, 6, 7, 8]

    second = served(first.chain, context, generated(ids, [4], version=1))
    ep.record(Call(None, None, ids, [second]), parent, context)
    assert ep.last is second and first.extended and not aside.extended
    assert ep.stats["turns"] == 3 and ep.stats["reused_prompt_tokens"] == 4

    (extra,) = ep.samples(reward=0.5)
    s = ep.sample
    assert s.prompt_ids == [1, 2] and s.response_ids == [5, 6, 7, 8, 4]
    assert s.loss_mask == [1, 1, 0, 0, 1] and s.versions == [0, 0, 1, 1, 1]
    assert s.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert s.status is Status.FINISHED and s.agent_reward == 0.5
    assert extra.response_ids == [3] and extra.agent_reward == 0.5 and extra.episode_of == 1
    assert (extra.group_id, extra.index) == (3, 2 * EXTRA_INDEX)
