"""`tandem sft` for an OpenAI agent: a demonstration written as the endpoint's chain of such an
episode, so supervised training sees the tokens and loss mask RL will (`OpenAIAgent.demonstration`)."""

import json
import re

from tandem.agent.chat import ChatRenderer
from tandem.agent.tools import TOOLS, openai_tool

_TAGGED_CALL = re.compile(r"<(\w+)>(.*?)</\1><result>(.*?)</result>", re.DOTALL)


def demonstration(chat: ChatRenderer, eos: int, tools: list[str], text: str) -> tuple[list[int], list[int]]:
    """A transcript in the tag format of the tools `tools` name (`<calc>37*48</calc><result>1776
    </result>1776`) -> (ids, loss mask) as the endpoint's chain holds such an episode: each call
    written as the template writes a tool call, then EOS (loss mask 1); the tool message and the
    next generation prompt as the template renders them after it (loss mask 0); the rest as text
    (loss mask 1). The template must render a conversation's prefix as a prefix of the whole (as
    the endpoint needs)."""
    schemas = [openai_tool(n) for n in tools]
    names = {TOOLS.get(n).tag: n for n in tools}
    ids: list[int] = []
    mask: list[int] = []
    done = 0
    for m in _TAGGED_CALL.finditer(text):
        if m.group(1) not in names:
            continue
        name = names[m.group(1)]
        args = json.dumps({TOOLS.get(name).argument: m.group(2)})
        call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": args}}
        said = text[done : m.start()]
        written = chat.encode(said + f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>')
        served = [
            {"role": "user", "content": ""},
            {"role": "assistant", "content": said, "tool_calls": [call]},
        ]
        result = [{"role": "tool", "tool_call_id": "call_0", "content": m.group(3)}]
        context = chat.continuation(served, result, schemas, ended_on_eos=True) or []
        ids += written + [eos] + context
        mask += [1] * (len(written) + 1) + [0] * len(context)
        done = m.end()
    rest = chat.encode(text[done:])
    return ids + rest, mask + [1] * len(rest)
